"""DAG integrity: every spec gives a DAG, one broken spec hides no other."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
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
    assert sorted(t.task_id for t in dag.tasks) == sorted(["pin_spec", *STAGES])
    for upstream, downstream in itertools.pairwise(STAGES):
        assert downstream in dag.get_task(upstream).downstream_task_ids, (upstream, downstream)
    # Every stage reads the spec pin_spec pinned; the report is the run's teardown, never a leaf that decides it.
    pin, report = dag.get_task("pin_spec"), dag.get_task("report")
    assert pin.is_setup and pin.downstream_task_ids == set(STAGES)
    assert report.is_teardown and report.trigger_rule == "all_done_setup_success"
    # The stages decide the run's state: a teardown with on_failure_fail_dagrun would be its only judge.
    assert not report.on_failure_fail_dagrun and [t.task_id for t in dag.leaves] == ["report"]


def test_the_doc_and_links_point_to_the_runs_view(bag: DagBag) -> None:
    dag = bag.dags["nightly_pretrain"]
    assert dag.doc_md.startswith("Nightly continual pretraining")
    assert "| `max_steps` | `60` |" in dag.doc_md and "(/trainyard/)" in dag.doc_md
    for task_id in ("train", "report"):
        assert [link.name for link in dag.get_task(task_id).operator_extra_links] == ["Training run"], task_id


def test_schedule_and_retries_come_from_the_spec(bag: DagBag) -> None:
    nightly, manual = bag.dags["nightly_pretrain"], bag.dags["finetune_manual"]
    assert nightly.schedule == "0 2 * * *"
    assert nightly.max_active_runs == 1
    assert manual.schedule is None
    assert nightly.get_task("train").retries == 1  # attempts are the supervisor's; this one is for a dead worker


def test_params_validate_with_their_schema(bag: DagBag) -> None:
    params = bag.dags["nightly_pretrain"].params
    assert params.dump() == {"nodes": 2, "min_nodes": 1, "max_steps": 60, "micro_batch": 4, "resume_from": "latest"}
    with pytest.raises(ParamValidationError, match="99 is greater than the maximum of 2"):
        params["nodes"] = 99
    with pytest.raises(ParamValidationError, match="does not match"):
        params["resume_from"] = "relative/path"
    with pytest.raises(ParamValidationError, match=r"3 is not one of \[1, 2, 4, 8, 16\]"):
        params["micro_batch"] = 3
    manual = bag.dags["finetune_manual"].params
    manual["nodes"] = 4  # nodes.max: 4 in the spec
    assert manual["nodes"] == 4


FORM = {
    # nightly_pretrain lists no params: the default set, micro_batch included
    "nightly_pretrain": {
        "Nodes": ["nodes", "min_nodes"],
        "Training": ["max_steps", "micro_batch"],
        "Checkpoint": ["resume_from"],
    },
    "finetune_manual": {"Nodes": ["nodes", "min_nodes"], "Training": ["max_steps"], "Checkpoint": ["resume_from"]},
}


@pytest.mark.parametrize("dag_id", list(FORM))
def test_the_trigger_form_survives_serialization(bag: DagBag, dag_id: str) -> None:
    # The API server renders the form from the serialized DAG, not from the parsed one.
    from airflow.serialization.serialized_objects import DagSerialization

    dag = DagSerialization.from_dict(DagSerialization.to_dict(bag.dags[dag_id]))
    sections: dict[str, list[str]] = {}
    for name in dag.params:
        param = dag.params.get_param(name)
        assert param.description and param.schema["title"], name
        sections.setdefault(param.schema["section"], []).append(name)
    assert sections == FORM[dag_id]


@pytest.mark.parametrize(
    "dag_id,slots",
    [
        ("nightly_pretrain", {"burn_in": 2, "train": 2}),  # count 2, no max, no spare
        ("finetune_manual", {"burn_in": 5, "train": 4}),
    ],
)  # max 4, spare 1
def test_node_tasks_take_a_slot_per_node_a_run_may_use(bag: DagBag, dag_id: str, slots: dict[str, int]) -> None:
    dag = bag.dags[dag_id]
    assert {t.task_id: (t.pool, t.pool_slots) for t in dag.tasks if t.pool != "default_pool"} == {
        task_id: ("training_nodes", n) for task_id, n in slots.items()
    }
    # The nodes Param cannot ask for more than the slots the train task holds.
    assert dag.params.get_param("nodes").schema["maximum"] <= dag.get_task("train").pool_slots


def test_the_pool_fits_every_pipeline(bag: DagBag) -> None:
    # A task asking for more slots than its pool has is never scheduled: the run would wait forever.
    from trainyard.airflow.settings import load_settings

    [pool] = [p for p in load_settings(ROOT / "airflow_settings.yaml")["pools"] if p["pool_name"] == "training_nodes"]
    assert pool["pool_include_deferred"] is True  # a deferred train task's pods still hold their nodes
    assert (
        max(t.pool_slots for dag in bag.dags.values() for t in dag.tasks if t.pool == "training_nodes")
        <= pool["pool_slot"]
    )


def test_one_broken_spec_is_an_import_error_and_hides_no_other(tmp_path: Path) -> None:
    dags = tmp_path / "dags"
    shutil.copytree(ROOT / "dags", dags, ignore=shutil.ignore_patterns("__pycache__"))
    (dags / "pipelines" / "broken.yaml").write_text(
        (dags / "pipelines" / "finetune_manual.yaml").read_text().replace("min: 1", "min: 7")
    )
    bag = DagBag(dag_folder=str(dags))
    assert {"nightly_pretrain", "finetune_manual"} <= set(bag.dags)
    assert "broken" not in bag.dags
    # Reported by the file that builds no DAG: Airflow marks every DAG of a file with an import error stale.
    assert list(bag.import_errors) == [str(dags / "pipeline_spec_errors.py")]
    [message] = bag.import_errors.values()
    assert f"{dags}/pipelines/broken.yaml: nodes.min: 7 must be <= nodes.count (2)" in message


def test_a_dataset_folder_nested_in_anothers_is_no_dag(tmp_path: Path) -> None:
    """Staging or evicting ``tokens`` would touch ``tokens/{{ ds }}``'s nights: the later spec is refused."""
    dags = tmp_path / "dags"
    shutil.copytree(ROOT / "dags", dags, ignore=shutil.ignore_patterns("__pycache__"))
    nightly = (dags / "pipelines" / "nightly_pretrain.yaml").read_text()
    assert "name: tokens/{{ ds }}" in nightly
    (dags / "pipelines" / "z_all_tokens.yaml").write_text(nightly.replace("name: tokens/{{ ds }}", "name: tokens"))
    bag = DagBag(dag_folder=str(dags))
    assert {"nightly_pretrain", "finetune_manual"} <= set(bag.dags) and "z_all_tokens" not in bag.dags
    [message] = bag.import_errors.values()
    assert f"{dags}/pipelines/z_all_tokens.yaml: dataset.name: 'tokens' may be the folder of" in message


def test_parsing_touches_no_tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    DagBag(dag_folder=str(ROOT / "dags"))
    assert not (tmp_path / "home").exists()
    assert os.environ["TRAINYARD_HOME"] == str(tmp_path / "home")


def test_parsing_imports_neither_torch_nor_the_kubernetes_clients() -> None:
    """The DAG processor parses every file often; torch alone takes seconds to import."""
    code = (
        "import sys; from airflow.dag_processing.dagbag import DagBag; bag = DagBag(dag_folder=sys.argv[1]);"
        " assert not bag.import_errors, bag.import_errors;"
        " print(sorted(m for m in ('torch', 'kubernetes', 'kubernetes_asyncio') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code, str(ROOT / "dags")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_a_parsed_dag_lets_its_tasks_pull_the_stages_typed_results() -> None:
    """The stages' results travel as XComs: serialized as Airflow stores them, rebuilt as the pulling task
    (which parsed the DAG file) rebuilds them, typed; in a process that parsed no DAG, serde refuses them."""
    import json

    from airflow.sdk.bases.xcom import BaseXCom

    from trainyard.pipeline.results import BurnInResult, DataCheckResult, GateResult, StagingResult, TrainResult

    results = [
        # The data stages' results are the storage and quality layers' own classes, allowed the same way.
        StagingResult(
            hot_dir="/hot/tokens",
            files=4,
            bytes_total=4096,
            transferred=1,
            bytes_transferred=1024,
            seconds=0.5,
            extra_files=1,
            unstaged=1,
            warnings=["input.txt at the source is not staged"],
        ),
        DataCheckResult(
            shards=4,
            non_empty=4,
            tokens=8192,
            vocab_size=256,
            expectations=6,
            seconds=1.5,
            result=None,
            extra_files=["meta.pkl"],
            warnings=["input.txt at the source is not staged"],
        ),
        BurnInResult(
            healthy=["node-0"], spare=["node-1"], evicted={"node-2": "slow"}, references={"local": {"mm": 1.0}}
        ),
        TrainResult(nodes=["node-0"], start_step=10, target_step=30, last_step=30, checkpoint="/c/step_30", attempts=2),
        GateResult(checkpoint="/c/step_30", step=30, metrics={"loss": 2.5}),
    ]
    stored = [json.dumps(BaseXCom.serialize_value(r)) for r in results]
    code = (
        "import json, sys; from airflow.sdk.bases.xcom import BaseXCom; from types import SimpleNamespace as S\n"
        "pull = lambda: [BaseXCom.deserialize_value(S(value=json.loads(v))) for v in json.loads(sys.argv[2])]\n"
        "try: pull()\n"
        "except ImportError: print('result: refused before parsing')\n"
        "from airflow.dag_processing.dagbag import DagBag; DagBag(dag_folder=sys.argv[1])\n"
        "print('result:', repr(pull()))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "dags"), json.dumps(stored)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # (The DagBag logs to stdout too.)
    refused, pulled = [
        line.removeprefix("result: ") for line in done.stdout.splitlines() if line.startswith("result: ")
    ]
    assert refused == "refused before parsing"
    assert pulled == repr(results)
