"""``trainyard run SPEC``: one real ``airflow dags test`` of a spec, in the project's environment, exiting by the
DAG run's state as Airflow records it (``dags test`` itself exits 0 either way). And the command's stdout closed by
its reader (``trainyard check ... | head``) ends it quietly, as other CLIs end."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from airflow_helpers import ROOT, airflow_env, run_state

pytestmark = pytest.mark.integration
DAG_ID = "tiny_run"
DATE = "2026-11-27"


def test_run_exits_by_the_dag_runs_state_and_prints_its_summary(tmp_path: Path) -> None:
    spec = yaml.safe_load((ROOT / "dags" / "pipelines" / "nightly_pretrain.yaml").read_text())
    spec.update(pipeline=DAG_ID, nodes={"count": 1, "min": 1, "backend": "local"}, pressure_test={"enabled": False})
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "tiny.yaml").write_text(yaml.safe_dump(spec))
    env = airflow_env(tmp_path)
    del env["AIRFLOW__CORE__DAGS_FOLDER"]  # trainyard run makes the DAGs folder of the spec itself
    # No partition for DATE: stage_dataset fails, the run fails, and dags test still exits 0.
    done = subprocess.run(
        ["trainyard", "run", f"file://{tmp_path}/specs/tiny.yaml", "--date", DATE, "-o", "json"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert run_state(env, DAG_ID, DATE) == "failed"  # what Airflow shows is what the exit code says
    summary = json.loads(done.stdout)
    assert summary["state"] == "failed" and not summary["stages"]["stage_dataset"]["ok"]
    assert "holds no objects to stage" in summary["stages"]["stage_dataset"]["error"]
    assert Path(summary["run_dir"]).parent == Path(env["TRAINYARD_HOME"]) / "runs" / DAG_ID
    assert f"airflow dags test {DAG_ID} {DATE}: run failed" in done.stderr and "Traceback" not in done.stderr


def test_a_closed_stdout_ends_the_command_with_141_and_nothing_on_stderr() -> None:
    read, write = os.pipe()
    os.close(read)  # the reader (head) is gone before the first line
    try:
        done = subprocess.run(
            ["trainyard", "check", str(ROOT / "dags" / "pipelines")], stdout=write, stderr=subprocess.PIPE, timeout=120
        )
    finally:
        os.close(write)
    assert done.returncode == 141 and done.stderr == b""
