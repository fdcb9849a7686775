"""The TRAINYARD_* contract: one typed value from the plan to the training process and back."""

from __future__ import annotations

import os
import stat
from dataclasses import fields, replace
from pathlib import Path
from typing import get_args

import pytest

import trainyard.runtime
from trainyard.backends.base import LaunchPlan
from trainyard.backends.local.launcher import node_env
from trainyard.protocol import records
from trainyard.protocol.env import ContractPath, FaultDrill, TrainEnv, variable_table
from trainyard.runtime import process as runtime
from trainyard.spec.models import FailureKind

REQUIRED = {"TRAINYARD_DATA_DIR": "/hot/data", "TRAINYARD_CHECKPOINT_DIR": "/hot/ckpt", "TRAINYARD_MAX_STEPS": "10"}
FULL = TrainEnv(
    data_dir=Path("/hot/data"),
    checkpoint_dir=Path("/hot/ckpt"),
    max_steps=120,
    resume_from="/hot/ckpt/step_000040",
    heartbeat_dir=Path("/runs/r/attempt-2/heartbeat"),
    events_dir=Path("/runs/r/events.d"),
    run_id="manual__2026-01-01",
    node="node-1",
    host="gpu-7",
    attempt=2,
    global_batch=64,
    micro_batch=4,
    checkpoint_every=20,
    checkpoint_async=True,
    seed=7,
    progress_every_s=2.5,
    drills=(FaultDrill("kill", 30, "node-1"), FaultDrill("slow", 5, None, factor=2.0, attempt=2)),
)


def test_every_field_survives_the_environment() -> None:
    env = FULL.to_env()
    assert all(isinstance(v, str) for v in env.values())
    assert TrainEnv.from_env(env) == FULL
    assert env["TRAINYARD_CHECKPOINT_ASYNC"] == "1" and env["TRAINYARD_MICRO_BATCH"] == "4"


def test_unset_values_are_left_out_and_read_back_as_the_defaults() -> None:
    bare = TrainEnv.from_env(REQUIRED)
    assert bare.to_env().keys() >= REQUIRED.keys()
    assert "TRAINYARD_HEARTBEAT_DIR" not in bare.to_env() and "TRAINYARD_DRILLS" not in bare.to_env()
    assert (bare.global_batch, bare.micro_batch, bare.checkpoint_every, bare.progress_every_s) == (32, None, 50, 30.0)
    assert (bare.events_dir, bare.heartbeat_dir, bare.drills, bare.node) == (None, None, (), "")
    assert TrainEnv.from_env(bare.to_env()) == bare


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("TRAINYARD_DATA_DIR", None, "TRAINYARD_DATA_DIR is not set; the trainyard launcher sets it"),
        ("TRAINYARD_MAX_STEPS", "  ", "TRAINYARD_MAX_STEPS is not set"),
        ("TRAINYARD_MAX_STEPS", "ten", "TRAINYARD_MAX_STEPS='ten' is not an integer; set a whole number >= 1"),
        ("TRAINYARD_MAX_STEPS", "0", "TRAINYARD_MAX_STEPS=0 must be >= 1"),
        ("TRAINYARD_MICRO_BATCH", "-2", "TRAINYARD_MICRO_BATCH=-2 must be >= 1"),
        ("TRAINYARD_PROGRESS_EVERY_S", "nan", "TRAINYARD_PROGRESS_EVERY_S=nan must be a finite number >= 0.0"),
        ("TRAINYARD_PROGRESS_EVERY_S", "soon", "TRAINYARD_PROGRESS_EVERY_S='soon' is not a number"),
        ("TRAINYARD_CHECKPOINT_ASYNC", "yes", "TRAINYARD_CHECKPOINT_ASYNC='yes' must be 1 or 0"),
        ("TRAINYARD_DRILLS", "[{", "TRAINYARD_DRILLS is not JSON; it is a list of drills"),
        ("TRAINYARD_DRILLS", '{"fault": "kill"}', "TRAINYARD_DRILLS must be a JSON list of drills, not dict"),
        ("TRAINYARD_DRILLS", '[{"fault": "kill"}]', "TRAINYARD_DRILLS: drill 0 must be an object with a 'fault' and"),
        ("TRAINYARD_DRILLS", '[{"fault": "kill", "step": "3"}]', "TRAINYARD_DRILLS: drill 0: 'step' must be int"),
        ("TRAINYARD_DRILLS", '[{"fault": "kill", "step": 3, "when": 1}]', "drill 0: unknown field 'when'"),
    ],
)
def test_a_missing_or_malformed_variable_is_named_with_the_fix(name: str, value: str | None, says: str) -> None:
    env = {**REQUIRED, name: value} if value is not None else {k: v for k, v in REQUIRED.items() if k != name}
    with pytest.raises(ValueError) as err:
        TrainEnv.from_env(env)
    assert says in str(err.value)


def test_paths_declare_what_a_pod_may_write() -> None:
    assert FULL.paths() == [
        ContractPath("TRAINYARD_DATA_DIR", Path("/hot/data"), writable=False, is_dir=True),
        ContractPath("TRAINYARD_CHECKPOINT_DIR", Path("/hot/ckpt"), writable=True, is_dir=True),
        ContractPath("TRAINYARD_HEARTBEAT_DIR", Path("/runs/r/attempt-2/heartbeat"), writable=True, is_dir=True),
        ContractPath("TRAINYARD_EVENTS_DIR", Path("/runs/r/events.d"), writable=True, is_dir=True),
        ContractPath("TRAINYARD_RESUME_FROM", Path("/hot/ckpt/step_000040"), writable=False, is_dir=True),
    ]
    latest = TrainEnv.from_env({**REQUIRED, "TRAINYARD_RESUME_FROM": "latest"})
    assert [p.name for p in latest.paths()] == ["TRAINYARD_DATA_DIR", "TRAINYARD_CHECKPOINT_DIR"]  # no events file


def test_the_plan_carries_the_contract_and_each_node_gets_its_own_name(tmp_path: Path) -> None:
    plan = LaunchPlan("r", 2, ["node-0", "node-1"], 1, "trainyard.workload", [], FULL.for_node(""), tmp_path)
    assert "TRAINYARD_NODE" not in plan.env and "TRAINYARD_LEDGER" not in plan.env
    env = node_env(plan, "node-1", {})
    # The local node is its own host; its processes beat (and record failures) in a folder of their own.
    own = Path("/runs/r/attempt-2/heartbeat/node-1")
    assert TrainEnv.from_env(env) == replace(FULL.for_node("node-1"), heartbeat_dir=own)
    assert (env["TRAINYARD_NODE"], env["TRAINYARD_HOST"]) == ("node-1", "node-1")


def test_the_runtime_fills_the_node_and_host_from_this_machine() -> None:
    ctx = runtime.context(REQUIRED)
    assert ctx.node and ctx.host and runtime.RunContext is TrainEnv
    assert runtime.context({**REQUIRED, "TRAINYARD_NODE": "node-3"}).node == "node-3"


def test_the_runtime_docstring_lists_the_contract_as_declared() -> None:
    face = trainyard.runtime  # what a script's author reads: ``help(trainyard.runtime)``
    assert face.__doc__ is not None and variable_table() in face.__doc__
    assert len({f.metadata["env"] for f in fields(TrainEnv)}) == len(fields(TrainEnv))


def test_failure_record_kinds_are_the_specs_failure_kinds() -> None:
    assert records.KINDS == get_args(FailureKind)


def test_a_training_process_lets_its_group_write_what_it_creates(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Pods (uid 1000) and the orchestrator (uid 50000) share the hot tier through their group: a rank's
    checkpoint folders must be group-writable, whatever umask the image gave it, for the orchestrator to tidy."""
    for name, value in TrainEnv(tmp_path / "data", tmp_path / "ckpt", 3).to_env().items():
        monkeypatch.setenv(name, value)
    old = os.umask(0o022)  # a typical image: group and others may not write
    try:
        runtime.context()
        (tmp_path / "step_000001").mkdir()
        (tmp_path / "step_000001" / "model.distcp").write_bytes(b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "step_000001").stat().st_mode) == 0o775  # others still may not write
    assert stat.S_IMODE((tmp_path / "step_000001" / "model.distcp").stat().st_mode) == 0o664
