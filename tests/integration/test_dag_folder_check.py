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
from airflow_helpers import ROOT, airflow_env

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


# What ``airflow dags list --local`` and ``airflow dags list-import-errors --local`` each print, from one parse of
# the folder by the DagBag both build (``airflow.cli.commands.dag_command``): one Airflow start, not two (~8 s).
DAG_BAG = """
import json
from airflow.dag_processing.dagbag import DagBag
bag = DagBag()
print(json.dumps({"dags": {d.dag_id: d.fileloc for d in bag.dags.values()}, "import_errors": bag.import_errors}))
"""


def test_airflow_keeps_the_good_dag_and_names_the_bad_files(env: dict[str, str]) -> None:
    done = subprocess.run([sys.executable, "-c", DAG_BAG], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    bag = json.loads(next(line for line in done.stdout.splitlines()[::-1] if line.startswith('{"dags": ')))
    dags = bag["dags"]
    assert dags.keys() == {"good"}, dags
    assert dags["good"].endswith("pipelines.py")
    errors = bag["import_errors"]
    assert [Path(file).name for file in errors] == ["pipeline_spec_errors.py"], errors
    [text] = errors.values()
    assert "my pipeline.yaml: pipeline: the file name" in text and "twin.yaml: pipeline: DAG id 'good'" in text
