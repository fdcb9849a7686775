"""DAG integrity: every spec gives a DAG, one broken spec hides no other."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from airflow.dag_processing.dagbag import DagBag
from airflow.sdk.exceptions import ParamValidationError

ROOT = Path(__file__).resolve().parents[2]
STAGES = ["stage_dataset", "check_dataset", "burn_in", "train", "check_checkpoint", "publish", "report"]


@pytest.fixture(scope="module")
def bag() -> DagBag:
    return DagBag(dag_folder=str(ROOT / "dags"))


def test_every_spec_is_a_dag_and_nothing_fails(bag: DagBag) -> None:
    specs = {p.stem for p in (ROOT / "dags" / "pipelines").glob("*.yaml")}
    assert bag.import_errors == {}
    assert set(bag.dags) == specs == {"nightly_pretrain", "finetune_manual"}


@pytest.mark.parametrize("dag_id", ["nightly_pretrain", "finetune_manual"])
def test_stages_are_chained_in_order(bag: DagBag, dag_id: str) -> None:
    dag = bag.dags[dag_id]
    assert sorted(t.task_id for t in dag.tasks) == sorted(STAGES)
    for upstream, downstream in zip(STAGES, STAGES[1:]):
        assert downstream in dag.get_task(upstream).downstream_task_ids, (upstream, downstream)
    assert dag.get_task("report").trigger_rule == "all_done"


def test_schedule_and_retries_come_from_the_spec(bag: DagBag) -> None:
    nightly, manual = bag.dags["nightly_pretrain"], bag.dags["finetune_manual"]
    assert nightly.schedule == "0 2 * * *"
    assert nightly.max_active_runs == 1
    assert manual.schedule is None
    assert nightly.get_task("train").retries == 1  # attempts are the supervisor's; this one is for a dead worker


def test_params_validate_with_their_schema(bag: DagBag) -> None:
    params = bag.dags["nightly_pretrain"].params
    assert params.dump() == {"nodes": 2, "min_nodes": 1, "max_steps": 60, "resume_from": "latest"}
    with pytest.raises(ParamValidationError, match="99 is greater than the maximum of 2"):
        params["nodes"] = 99
    with pytest.raises(ParamValidationError, match="does not match"):
        params["resume_from"] = "relative/path"
    manual = bag.dags["finetune_manual"].params
    manual["nodes"] = 4  # nodes.max: 4 in the spec
    assert manual["nodes"] == 4


def test_one_broken_spec_is_an_import_error_and_hides_no_other(tmp_path: Path) -> None:
    dags = tmp_path / "dags"
    shutil.copytree(ROOT / "dags", dags, ignore=shutil.ignore_patterns("__pycache__"))
    (dags / "pipelines" / "broken.yaml").write_text((dags / "pipelines" / "finetune_manual.yaml").read_text()
                                                    .replace("min: 1", "min: 7"))
    bag = DagBag(dag_folder=str(dags))
    assert {"nightly_pretrain", "finetune_manual"} <= set(bag.dags)
    assert "broken" not in bag.dags
    # Reported by the file that builds no DAG: Airflow marks every DAG of a file with an import error stale.
    assert list(bag.import_errors) == [str(dags / "pipeline_spec_errors.py")]
    [message] = bag.import_errors.values()
    assert f"{dags}/pipelines/broken.yaml: nodes.min: 7 must be <= nodes.count (2)" in message


def test_parsing_touches_no_tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    DagBag(dag_folder=str(ROOT / "dags"))
    assert not (tmp_path / "home").exists()
    assert os.environ["TRAINYARD_HOME"] == str(tmp_path / "home")
