"""Run the real Airflow CLI against a throwaway metadata DB (shared by the integration tests)."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
STAGES = ["stage_dataset", "check_dataset", "burn_in", "train", "check_checkpoint", "publish", "report"]


def airflow_env(home: Path, dags: Path = ROOT / "dags", **extra: str) -> dict[str, str]:
    """An environment with its own AIRFLOW_HOME (migrated, settings loaded) and TRAINYARD_HOME."""
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home / "airflow"),
        "TRAINYARD_HOME": str(home / "trainyard"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "PATH": f"{BIN}:{os.environ['PATH']}",
        **extra,
    }
    for argv in (
        ["airflow", "db", "migrate"],
        [sys.executable, "-m", "trainyard.airflow.settings", str(ROOT / "airflow_settings.yaml")],
    ):
        subprocess.run(argv, env=env, check=True, capture_output=True, timeout=300)
    return env


def airflow(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["airflow", *args], env=env, capture_output=True, text=True, timeout=600)


def task_states(env: dict[str, str], dag_id: str, date: str) -> dict[str, tuple[str, int]]:
    """``task_id -> (state, try_number)`` of the run at logical ``date`` (``dags test`` exits 0 either way)."""
    with sqlite3.connect(Path(env["AIRFLOW_HOME"]) / "airflow.db") as db:
        rows = db.execute(
            "SELECT ti.task_id, ti.state, ti.try_number FROM task_instance ti JOIN dag_run r"
            " ON ti.dag_id = r.dag_id AND ti.run_id = r.run_id WHERE r.dag_id = ? AND r.logical_date LIKE ?",
            (dag_id, f"{date}%"),
        ).fetchall()
    return {task: (state, tries) for task, state, tries in rows}
