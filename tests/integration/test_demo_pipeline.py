"""The demo pipeline end to end through a real ``airflow dags test`` on 2 local nodes."""

from __future__ import annotations

import json
import sqlite3
import subprocess
from pathlib import Path

import pytest
from airflow_helpers import STAGES, TASKS, airflow, airflow_env, run_state, task_states

from trainyard.checkpoint.format import verify
from trainyard.events.ledger import Ledger
from trainyard.protocol import steps as progress

pytestmark = pytest.mark.integration
DATE = "2026-11-28"


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    env = airflow_env(tmp_path_factory.mktemp("demo"))
    subprocess.run(["trainyard", "demo-data", "--date", DATE], env=env, check=True, capture_output=True)
    return env


@pytest.mark.alone  # its pressure test measures this machine: see pyproject (the other two end before it)
def test_demo_pipeline_runs_end_to_end(env: dict[str, str]) -> None:
    done = airflow(env, "dags", "test", "nightly_pretrain", DATE)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert {t: s for t, (s, _) in task_states(env, "nightly_pretrain", DATE).items()} == dict.fromkeys(TASKS, "success")
    assert run_state(env, "nightly_pretrain", DATE) == "success"

    home = Path(env["TRAINYARD_HOME"])
    hot = home / "checkpoints" / "nightly_pretrain" / "step_000060"
    published = home / "cold" / "checkpoints" / "nightly_pretrain"
    cold = published / json.loads((published / "PUBLISHED").read_text())["path"]  # readers follow the pointer
    assert cold.name.startswith("step_000060.") and verify(hot) == [] and verify(cold) == []
    assert (
        json.loads((cold / "manifest.json").read_text())["files"]
        == json.loads((hot / "manifest.json").read_text())["files"]
    )

    [run_dir] = (home / "runs" / "nightly_pretrain").iterdir()
    ledger = Ledger.in_dir(run_dir)
    assert {e["stage"] for e in ledger.events(event="stage_end")} == set(STAGES)
    steps = list(ledger.events("train", "step"))  # summarised: one event per 30 s and per checkpoint
    assert progress.steps_trained(steps) == 60 and steps[-1]["loss"] < steps[0]["loss"]
    assert len([e for e in ledger.events("burn_in", "node_verdict")]) == 2
    assert (run_dir / "report.html").exists() and (run_dir / "spec.json").exists()
    # Each checkpoint was validated while training ran; the pointer names the last one.
    validated = [e for e in ledger.events("train", "checkpoint_validated")]
    assert [(e["step"], e["valid"]) for e in validated] == [(20, True), (40, True), (60, True)]
    assert json.loads((hot.parent / "LATEST").read_text())["path"] == "step_000060"
    assert json.loads((run_dir / "metric_quality.json").read_text())["success"] is True
    with sqlite3.connect(Path(env["AIRFLOW_HOME"]) / "airflow.db") as db:
        [(extra,)] = db.execute(
            "SELECT e.extra FROM asset_event e JOIN asset a ON a.id = e.asset_id"
            " WHERE a.uri = 'trainyard://checkpoints/nightly_pretrain'"
        ).fetchall()
    assert json.loads(extra)["uri"].endswith(f"/cold/checkpoints/nightly_pretrain/{cold.name}")

    summary = subprocess.run(
        ["trainyard", "summary", "--dag-id", "nightly_pretrain"], env=env, capture_output=True, text=True
    )
    assert summary.returncode == 0, summary.stderr
    assert "steps trained:    60" in summary.stdout and str(hot) in summary.stdout


def test_invalid_param_is_refused_with_the_schema_message(env: dict[str, str]) -> None:
    done = airflow(env, "dags", "test", "nightly_pretrain", "2026-11-27", "-c", json.dumps({"nodes": 99}))
    assert done.returncode != 0
    assert "Invalid input for param nodes: 99 is greater than the maximum of 2" in done.stdout + done.stderr
    assert task_states(env, "nightly_pretrain", "2026-11-27") == {}  # refused before any task ran


def test_bad_data_fails_fast_without_retry(env: dict[str, str]) -> None:
    partition = Path(env["TRAINYARD_HOME"]) / "cold" / "tokens" / "2026-11-26"
    partition.mkdir(parents=True)
    (partition / "shard_0000.tok").write_bytes(b"not a shard at all")
    done = airflow(env, "dags", "test", "nightly_pretrain", "2026-11-26")
    states = task_states(env, "nightly_pretrain", "2026-11-26")
    assert states["stage_dataset"] == ("success", 1)
    assert states["check_dataset"] == ("failed", 1)  # AirflowFailException: no retry
    assert states["train"][0] == "upstream_failed"
    assert states["report"][0] == "success"  # the report is written whatever happened
    assert run_state(env, "nightly_pretrain", "2026-11-26") == "failed"  # and the run says what happened
    out = done.stdout + done.stderr
    assert "DataError: shard" in out and "shard_0000.tok: truncated header" in out
