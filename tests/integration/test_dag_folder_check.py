"""A DAG folder with a good spec, a file name that is no DAG id and a second spec with the good one's id (issue 52):
``trainyard check`` refuses the folder naming both bad files, and real Airflow still loads the good pipeline while
``pipeline_spec_errors.py`` carries the bad files as its import error (a bad file name used to raise in
``pipelines.py`` and hide every pipeline)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from airflow_helpers import ROOT, airflow, airflow_env

SPEC = """\
{pipeline}dataset: {{source: "file://{cold}", name: {name}}}
nodes: {{count: 1}}
training: {{max_steps: 2, global_batch: 2, micro_batch: 2, checkpoint_every: 1}}
"""


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("dag_folder_check")
    dags = home / "dags"
    (dags / "pipelines").mkdir(parents=True)
    # Both DAG files, as README says: without pipeline_spec_errors.py bad specs would vanish without a word.
    for name in ("pipelines.py", "pipeline_spec_errors.py"):
        shutil.copy(ROOT / "dags" / name, dags / name)
    cold = home / "cold"
    cold.mkdir()
    specs = {"good.yaml": ("", "good"), "my pipeline.yaml": ("", "mine"), "twin.yaml": ("pipeline: good\n", "twin")}
    for file, (pipeline, name) in specs.items():
        (dags / "pipelines" / file).write_text(SPEC.format(pipeline=pipeline, cold=cold, name=name))
    return airflow_env(home, dags)


def test_check_refuses_the_folder_naming_both_bad_files(env: dict[str, str]) -> None:
    folder = Path(env["AIRFLOW__CORE__DAGS_FOLDER"]) / "pipelines"
    done = subprocess.run(
        [sys.executable, "-m", "trainyard.cli", "check", str(folder)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"{folder / 'my pipeline.yaml'}: pipeline: the file name 'my pipeline.yaml'" in done.stdout
    assert f"{folder / 'twin.yaml'}: pipeline: DAG id 'good' is already used by good.yaml" in done.stdout
    assert "good.yaml: " not in done.stdout.replace("used by good.yaml", "") and "Traceback" not in done.stderr


def test_airflow_keeps_the_good_dag_and_names_the_bad_files(env: dict[str, str]) -> None:
    listed = airflow(env, "dags", "list", "--local", "-o", "json")
    assert listed.returncode == 0, listed.stderr[-3000:]
    dags = {row["dag_id"]: row["fileloc"] for row in json_rows(listed.stdout)}
    assert dags.keys() == {"good"}, dags
    assert dags["good"].endswith("pipelines.py")
    errors = airflow(env, "dags", "list-import-errors", "--local", "-o", "json")
    rows = json_rows(errors.stdout)
    assert [Path(row["filepath"]).name for row in rows] == ["pipeline_spec_errors.py"], rows
    [text] = [row["error"] for row in rows]
    assert "my pipeline.yaml: pipeline: the file name" in text and "twin.yaml: pipeline: DAG id 'good'" in text


def json_rows(stdout: str) -> list[dict[str, str]]:
    """The JSON list ``-o json`` prints, after any log lines (which may start with ``[warning``)."""
    rows: list[dict[str, str]] = json.loads(next(x for x in stdout.splitlines()[::-1] if x.startswith(("[{", "[]"))))
    return rows
