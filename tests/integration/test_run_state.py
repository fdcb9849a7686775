"""What Airflow shows is what happened: real ``airflow dags test`` runs that fail, and a spec edited mid-run.

Each failing run must end as a *failed* DAG run (the grid, failure callbacks,
``max_consecutive_failed_dag_runs`` and ``backfill --reprocess-behavior failed``
all read that state), and its report must still be written. The happy path and
a failed data check are in test_demo_pipeline.py.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from airflow_helpers import ROOT, airflow, airflow_env, run_state, task_states

from trainyard.ledger import Ledger

pytestmark = pytest.mark.integration

BASE = yaml.safe_load((ROOT / "dags" / "pipelines" / "nightly_pretrain.yaml").read_text())


def small(**changes: object) -> str:
    """The shipped nightly spec cut down to seconds: one node, no pressure test, four steps."""
    spec = copy.deepcopy(BASE)
    spec.pop("schedule")
    spec["nodes"] = {"count": 1, "min": 1, "procs_per_node": 1, "backend": "local"}
    spec["pressure_test"] = {"enabled": False}
    spec["training"].update(max_steps=4, checkpoint_every=2, global_batch=4, micro_batch=4)
    spec["recovery"]["backoff_s"] = 0.5
    for dotted, value in changes.items():
        *parents, key = dotted.split("__")
        node = spec
        for part in parents:
            node = node[part]
        node[key] = value
    return yaml.safe_dump(spec, sort_keys=False)


SPECS = {
    "pinned_night": small(),
    # Two nodes, both needed; the pressure test's drill crashes one: too few healthy nodes.
    "few_nodes": small(nodes={"count": 2, "min": 2, "procs_per_node": 1, "backend": "local"}, training__micro_batch=2,
                       pressure_test={"duration_s": 2, "matmul_size": 64, "membw_mb": 8, "disk_mb": 8,
                                      "drills": [{"node": "node-1", "fault": "crash"}]}),
    # One attempt only, and it loses its node: the recovery budget is spent at once.
    "no_budget": small(recovery__max_attempts=1, drills=[{"fault": "kill", "step": 2, "node": "node-0"}]),
}
DATES = {"pinned_night": ["2026-11-20", "2026-11-21"], "few_nodes": ["2026-11-22"], "no_budget": ["2026-11-23"]}


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("run-state")
    dags = home / "dags"
    (dags / "pipelines").mkdir(parents=True)
    shutil.copy(ROOT / "dags" / "pipelines.py", dags / "pipelines.py")
    for dag_id, text in SPECS.items():
        (dags / "pipelines" / f"{dag_id}.yaml").write_text(text)
    env = airflow_env(home, dags)
    for date in sorted(d for dates in DATES.values() for d in dates):
        subprocess.run(["trainyard", "demo-data", "--date", date], env=env, check=True, capture_output=True, timeout=120)
    return env


def run_dir(env: dict[str, str], dag_id: str, date: str) -> Path | None:
    """The run folder of ``dag_id``'s run for ``date`` (its pinned ``ds``: run ids of unscheduled DAGs carry the time)."""
    root = Path(env["TRAINYARD_HOME"]) / "runs" / dag_id
    for folder in root.iterdir() if root.exists() else []:
        if (folder / "spec.json").exists() and json.loads((folder / "spec.json").read_text())["ds"] == date:
            return folder
    return None


def failed_stage(env: dict[str, str], dag_id: str, date: str) -> dict:
    [failed] = Ledger.in_dir(run_dir(env, dag_id, date)).events(event="stage_failed")
    return failed


def assert_failed_with_a_report(env: dict[str, str], dag_id: str, date: str, out: str) -> dict[str, str]:
    states = {t: s for t, (s, _) in task_states(env, dag_id, date).items()}
    assert run_state(env, dag_id, date) == "failed", (states, out[-3000:])
    assert states["report"] == "success" and (run_dir(env, dag_id, date) / "report.html").exists(), states
    return states


def test_too_few_healthy_nodes_fails_the_run(env: dict[str, str]) -> None:
    [date] = DATES["few_nodes"]
    done = airflow(env, "dags", "test", "few_nodes", date)
    states = assert_failed_with_a_report(env, "few_nodes", date, done.stdout + done.stderr)
    assert states["burn_in"] == "failed" and states["train"] == "upstream_failed"
    assert failed_stage(env, "few_nodes", date)["error"] == "NodeUnhealthy"


def test_an_exhausted_recovery_budget_fails_the_run(env: dict[str, str]) -> None:
    [date] = DATES["no_budget"]
    done = airflow(env, "dags", "test", "no_budget", date)
    states = assert_failed_with_a_report(env, "no_budget", date, done.stdout + done.stderr)
    assert states["train"] == "failed" and states["check_checkpoint"] == "upstream_failed"
    assert failed_stage(env, "no_budget", date)["error"] == "TrainingFailed"


def test_a_spec_edited_mid_run_changes_only_the_next_run(env: dict[str, str]) -> None:
    first, second = DATES["pinned_night"]
    spec_file = Path(env["AIRFLOW__CORE__DAGS_FOLDER"]) / "pipelines" / "pinned_night.yaml"
    log = Path(env["AIRFLOW_HOME"]) / "pinned-night.log"
    with log.open("w") as out:
        running = subprocess.Popen(["airflow", "dags", "test", "pinned_night", first], env=env, stdout=out,
                                   stderr=subprocess.STDOUT)
    try:
        # Once training has started, tighten the gate so that no checkpoint of this model could pass it.
        deadline = time.monotonic() + 300
        while not any(True for _ in ledger_of(env, "pinned_night", first).events("train", "stage_start")):
            assert running.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        spec_file.write_text(small(checkpoint__expectations={"max_loss": 1e-6}))
        running.wait(timeout=600)
    finally:
        running.kill()
    # The running run finished with the spec it started with: its gate still had max_loss 10.
    assert run_state(env, "pinned_night", first) == "success", log.read_text()[-3000:]
    pinned = json.loads((run_dir(env, "pinned_night", first) / "spec.json").read_text())
    assert pinned["spec"]["checkpoint"]["expectations"]["max_loss"] == 10.0

    # The next run uses the edit, and its gate fails: a gate failure fails the run.
    done = airflow(env, "dags", "test", "pinned_night", second)
    states = assert_failed_with_a_report(env, "pinned_night", second, done.stdout + done.stderr)
    assert states["train"] == "success" and states["check_checkpoint"] == "failed"
    assert states["publish"] == "upstream_failed"
    failed = failed_stage(env, "pinned_night", second)
    assert failed["stage"] == "check_checkpoint" and failed["error"] == "CheckpointInvalid"


def ledger_of(env: dict[str, str], dag_id: str, date: str) -> Ledger:
    folder = run_dir(env, dag_id, date)
    return Ledger.in_dir(folder) if folder else Ledger("/nonexistent/events.jsonl")
