"""UI Params: each spec's trigger form, rendered through Airflow's own Param, refuses what the spec would.

No Airflow DB here: ``airflow.sdk.Param`` validates with JSON schema alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import get_args

import pytest
from airflow.sdk import Param
from airflow.sdk.definitions.param import ParamsDict
from airflow.sdk.exceptions import ParamValidationError

from trainyard.airflow.params import param_schemas
from trainyard.errors import SpecError
from trainyard.events.ledger import Ledger
from trainyard.pipeline.run import RUN_STAGE, SNAPSHOT, load_run, open_run
from trainyard.spec import (
    PARAM_FIELDS,
    ParamName,
    check_files,
    load_spec,
    spec_from_data,
    valid_resume,
    with_params,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "dags" / "pipelines").glob("*.yaml"))

SPEC = """\
dataset: {{source: "file://{root}/cold", name: tokens, hot: "file://{root}/hot"}}
runs_root: "file://{root}/runs"
nodes: {{count: 2, max: 4, spare: 1}}
training: {{max_steps: 10, global_batch: 16, micro_batch: 2, checkpoint_every: 5, args: {{lr: 0.003}}}}
params: [nodes, min_nodes, max_steps, micro_batch, lr, resume_from]
"""


@pytest.fixture
def path(tmp_path: Path) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(SPEC.format(root=tmp_path))
    return path


def form(path: Path) -> ParamsDict:
    """The DAG's Params exactly as dag_builder makes them."""
    return ParamsDict({name: Param(**schema) for name, schema in param_schemas(load_spec(path)).items()})


@pytest.mark.parametrize("spec_path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_param_is_titled_described_and_in_a_section(spec_path: Path) -> None:
    params = form(spec_path)
    assert params.validate()  # the spec's own values pass (a scheduled DAG with invalid defaults fails to import)
    for name in params:
        param = params.get_param(name)
        assert param.description and param.schema["title"] and param.schema["section"], name


def test_every_knob_has_a_name_a_field_and_a_schema() -> None:
    spec = load_spec(EXAMPLES[0]).model_copy(update={"params": list(PARAM_FIELDS)})
    assert set(get_args(ParamName)) == set(PARAM_FIELDS) == set(param_schemas(spec))


# (param, value, None if accepted else a fragment of Airflow's message)
CASES = [
    ("nodes", 4, None),
    ("nodes", 1, None),
    ("nodes", 5, "5 is greater than the maximum of 4"),
    ("nodes", 0, "0 is less than the minimum of 1"),
    ("nodes", 3, "3 is not one of [1, 2, 4]"),  # 16 sequences do not split over 3 nodes
    ("nodes", "2", "'2' is not of type 'integer'"),
    ("min_nodes", 4, None),
    ("min_nodes", 9, "9 is greater than the maximum of 4"),
    ("max_steps", 500, None),
    ("max_steps", 0, "0 is less than the minimum of 1"),
    ("micro_batch", 8, None),
    ("micro_batch", 3, "3 is not one of [1, 2, 4, 8, 16]"),
    ("micro_batch", 32, "32 is greater than the maximum of 16"),
    ("lr", 0.01, None),
    ("lr", 0, "0 is less than or equal to the minimum of 0"),
    ("lr", 3, "3 is greater than the maximum of 1.0"),
    ("resume_from", "latest", None),
    ("resume_from", "none", None),
    ("resume_from", "/ckpt/p/step_000020", None),
    ("resume_from", "ckpt/step_000020", "does not match"),
    ("resume_from", "/ckpt/../etc", "does not match"),
    ("resume_from", "LATEST", "does not match"),
]


@pytest.mark.parametrize("name,value,refused", CASES, ids=[f"{n}={v!r}" for n, v, _ in CASES])
def test_values_are_accepted_or_refused_with_the_schema_message(
    path: Path, name: str, value: object, refused: str | None
) -> None:
    params = form(path)
    if refused is None:
        params[name] = value
        assert params[name] == value
    else:
        with pytest.raises(ParamValidationError, match=refused.replace("[", r"\[").replace("]", r"\]")):
            params[name] = value


@pytest.mark.parametrize("value", ["latest", "none", "/", "/a/b", "/a..b/c", "/a/../b", "/..", "rel", "", "nones"])
def test_resume_pattern_is_the_spec_rule(path: Path, value: str) -> None:
    accepted = (
        Param(**param_schemas(load_spec(path))["resume_from"]).resolve(value, suppress_exception=True) is not None
    )
    assert accepted == valid_resume(value)


def test_resume_from_offers_the_keywords_and_the_spec_path(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(SPEC.format(root=tmp_path).replace("micro_batch: 2,", "micro_batch: 2, resume_from: /ck/step_5,"))
    schema = param_schemas(load_spec(path))["resume_from"]
    assert schema["examples"] == ["latest", "none", "/ck/step_5"] and schema["default"] == "/ck/step_5"


def test_choices_follow_the_knobs_a_trigger_may_turn(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    # micro_batch fixed at 4: 16 sequences over 4 x n -> n in {1, 2, 4}, but nodes.max 4 and 4 x 4 = 16 fits.
    path.write_text(
        SPEC.format(root=tmp_path)
        .replace("micro_batch: 2", "micro_batch: 4")
        .replace("[nodes, min_nodes, max_steps, micro_batch, lr, resume_from]", "[nodes]")
    )
    assert param_schemas(load_spec(path))["nodes"]["enum"] == [1, 2, 4]
    # nodes fixed at 2: micro-batches m with 2 x m dividing 16.
    path.write_text(
        SPEC.format(root=tmp_path).replace(
            "[nodes, min_nodes, max_steps, micro_batch, lr, resume_from]", "[micro_batch]"
        )
    )
    assert param_schemas(load_spec(path))["micro_batch"]["enum"] == [1, 2, 4, 8]


def test_a_spec_beyond_the_typo_bounds_keeps_its_own_default(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        SPEC.format(root=tmp_path).replace("lr: 0.003", "lr: 2.5").replace("max_steps: 10", "max_steps: 20000000")
    )
    assert form(path).validate() == {
        "nodes": 2,
        "min_nodes": 1,
        "max_steps": 20_000_000,
        "micro_batch": 2,
        "lr": 2.5,
        "resume_from": "latest",
    }


def test_new_knobs_reach_the_spec(path: Path) -> None:
    changed = with_params(load_spec(path), {"micro_batch": 1, "lr": 0.01, "nodes": 4}, path)
    assert (changed.training.micro_batch, changed.training.args["lr"], changed.nodes.count) == (1, 0.01, 4)


def test_a_combination_the_form_cannot_see_fails_when_the_run_opens(path: Path) -> None:
    # Each value is in its own enum; together 16 x 2 = 32 ranks' worth does not divide 16.
    form(path).update({"nodes": 2, "micro_batch": 16})
    with pytest.raises(SpecError, match=r"training\.global_batch: 16 must be divisible by .* \(16 x 2 x 1 = 32\)"):
        with_params(load_spec(path), {"nodes": 2, "micro_batch": 16}, path)


@pytest.mark.parametrize(
    "args,problem",
    [
        ("{}", "params[4]: 'lr' overrides training.args.lr, which is not set to a positive number"),
        ("{lr: fast}", "params[4]: 'lr' overrides training.args.lr, which is not set to a positive number"),
        ("{lr: 0}", "params[4]: 'lr' overrides training.args.lr, which is not set to a positive number"),
    ],
)
def test_lr_needs_a_learning_rate_in_the_args(tmp_path: Path, args: str, problem: str) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(SPEC.format(root=tmp_path).replace("args: {lr: 0.003}", f"args: {args}"))
    lines = check_files([path])  # {lr: fast} is also not a number for the reference workload: its own line
    assert f"{path}: {problem}; set it (the entrypoint's --lr) or drop 'lr' from params" in lines


def test_the_chosen_values_are_recorded_once_per_run(path: Path) -> None:
    params = form(path)
    params.update({"nodes": 4, "lr": 0.01})
    chosen = params.validate()  # what Airflow hands the tasks: every Param, defaults included
    for _ in range(3):  # every task opens the run
        run = open_run(path, "p", "manual__1", "2026-11-28", chosen)
    [event] = list(Ledger.in_dir(run.dir).events(RUN_STAGE, "params"))
    assert event["params"] == chosen
    assert event["overrides"] == {"nodes": {"spec": 2, "run": 4}, "lr": {"spec": 0.003, "run": 0.01}}
    assert event["spec_file"] == str(path) and event["snapshot"] == SNAPSHOT
    snapshot = json.loads((run.dir / SNAPSHOT).read_text())
    assert snapshot["params"] == chosen
    assert (snapshot["spec"]["nodes"]["count"], snapshot["spec"]["training"]["args"]["lr"]) == (4, 0.01)
    # The snapshot alone reproduces the run: it loads as the spec that ran.
    assert spec_from_data(snapshot["spec"], path) == run.spec


def test_a_run_without_params_records_an_empty_choice(path: Path) -> None:
    run = open_run(path, "p", "scheduled__1", "2026-11-28")
    [event] = list(run.ledger.events(RUN_STAGE, "params"))
    assert (event["params"], event["overrides"]) == ({}, {})


def test_a_task_killed_between_event_and_snapshot_does_not_record_twice(path: Path) -> None:
    run = open_run(path, "p", "manual__2", "2026-11-28", {"nodes": 4})
    (run.dir / SNAPSHOT).unlink()
    open_run(path, "p", "manual__2", "2026-11-28", {"nodes": 4})
    assert len(list(run.ledger.events(RUN_STAGE, "params"))) == 1 and (run.dir / SNAPSHOT).exists()


def test_the_pinned_spec_outlives_an_edit_of_the_file(path: Path) -> None:
    run = open_run(path, "p", "manual__3", "2026-11-28", {"nodes": 4})
    path.write_text(path.read_text().replace("max_steps: 10", "max_steps: 99"))
    # Every later task of the run (and a retry, and the report) reads the snapshot, not the file.
    for later in (load_run(run.dir / SNAPSHOT), open_run(path, "p", "manual__3", "2026-11-28", {"nodes": 4})):
        assert later.spec == run.spec and later.spec.training.max_steps == 10 and later.spec.nodes.count == 4
        assert (later.dag_id, later.run_id, later.ds, later.spec_path) == ("p", "manual__3", "2026-11-28", path)
    assert open_run(path, "p", "manual__4", "2026-11-29").spec.training.max_steps == 99  # the next run has it


def test_a_damaged_snapshot_is_a_spec_error_naming_the_file_and_the_fix(path: Path) -> None:
    run = open_run(path, "p", "manual__5", "2026-11-28")
    (run.dir / SNAPSHOT).write_text('{"spec": {"nodes": ')
    with pytest.raises(SpecError, match=r"spec\.json: cannot read the run's pinned spec .*clear the run's first task"):
        load_run(run.dir / SNAPSHOT)
