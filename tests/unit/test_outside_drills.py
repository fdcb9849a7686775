"""Drills for any script: who acts each one (the spec check), and when the supervisor acts one out from outside."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from trainyard.backends.base import LaunchPlan, SignalsNodes
from trainyard.events.ledger import Ledger
from trainyard.protocol.env import FaultDrill
from trainyard.recovery.drills import Actor, Progress, due, refused, unreached
from trainyard.spec.checks import drill_refusal

NODES = ["node-0", "node-1"]
KILL = FaultDrill("kill", 10, "node-1")


@pytest.mark.parametrize(
    ("fault", "entrypoint", "backend", "says"),
    [
        ("kill", "trainyard.workload", "kubernetes", None),  # the reference workload acts every drill itself
        ("nan", "trainyard.workload", "local", None),
        ("kill", "/opt/train.py", "local", None),  # any script: the local launcher signals its processes
        ("hang", "/opt/train.py", "local", None),
        ("slow", "my.trainer", "local", None),
        # Told to the script (TRAINYARD_DRILLS): the runtime's loop or a framework callback acts it out, and for a
        # script that does not the supervisor says so when the attempt ends.
        ("nan", "/opt/train.py", "local", None),
        ("oom", "/opt/train.py", "kubernetes", None),
        ("kill", "/opt/train.py", "kubernetes", "the kubernetes backend cannot signal a node's processes"),
    ],
)
def test_who_acts_out_a_drill(fault: str, entrypoint: str, backend: str, says: str | None) -> None:
    why = drill_refusal(fault, entrypoint, backend)
    assert (why is None) if says is None else (why is not None and says in why)


@pytest.mark.parametrize(
    ("drill", "seen", "struck"),
    [
        (KILL, Progress({"node-0": 12, "node-1": 9}), None),  # its node is behind the step
        (KILL, Progress({"node-0": 9, "node-1": 11}), (11, "heartbeats")),  # a poll late: the step reached
        (KILL, Progress({}, checkpoint=10), (10, "checkpoints")),  # no heartbeats: the checkpoints' steps
        (KILL, Progress({}, checkpoint=5), None),
        (KILL, Progress({"node-0": 3}, checkpoint=20), None),  # beats count first; node-1 has not beaten
        (FaultDrill("hang", 4), Progress({"node-0": 4}), (4, "heartbeats")),  # no node: node-0
        (FaultDrill("hang", 4), Progress({}, checkpoint=10), None),  # a hang waits for beats: only they find it
    ],
)
def test_a_drill_strikes_once_its_node_reached_its_step(
    drill: FaultDrill, seen: Progress, struck: tuple | None
) -> None:
    found = due([drill], NODES, seen)
    assert [(step, source) for _, _, step, source in found] == ([struck] if struck else [])
    if struck:
        assert found[0][1] == (drill.node or "node-0")


@pytest.mark.parametrize(
    ("drill", "seen", "says"),
    [
        (KILL, Progress({}, beatless=True), None),  # a kill needs no heartbeats: the checkpoints may do
        (FaultDrill("hang", 5, "node-1"), Progress({}, beatless=False), None),  # not known yet
        (FaultDrill("hang", 5, "node-1"), Progress({}, beatless=True), "hang detection is off"),
        (FaultDrill("kill", 5, "node-7"), Progress({}), "node-7 is not a node of the attempt"),
    ],
)
def test_a_drill_that_cannot_be_acted_out_is_refused_with_why(
    drill: FaultDrill, seen: Progress, says: str | None
) -> None:
    why = refused(drill, NODES, seen)
    assert (why is None) if says is None else (why is not None and says in why)
    if drill.fault == "hang" and says:
        assert "trainyard.runtime.heartbeat(step, metrics)" in why


def test_a_drill_that_never_struck_says_what_progress_was_missing() -> None:
    assert "saved no checkpoint of step 10" in unreached(KILL, Progress({}, beatless=True))
    assert "heartbeats never reported step 10" in unreached(KILL, Progress({"node-1": 3}))


def actor_of(tmp_path: Path, drills: list[FaultDrill]) -> tuple[Actor, Ledger]:
    """An attempt's drill actor over a real ledger (the launcher is never called at an attempt's end)."""
    ledger = Ledger.in_dir(tmp_path)
    plan = cast(LaunchPlan, SimpleNamespace(attempt=1, nodes=NODES))
    return Actor(drills, plan, cast(SignalsNodes, None), ledger, started=0.0, timeout_s=10.0), ledger


@pytest.mark.parametrize(
    ("fired_by_the_script", "says"),
    [
        (True, None),  # a framework callback or the runtime's loop acted it out: nothing to say
        (False, "nan at step 3 is acted out inside the training process, and the script did not"),
    ],
)
def test_a_drill_the_script_must_act_out_is_said_not_acted_out_when_it_did_not(
    tmp_path: Path, fired_by_the_script: bool, says: str | None
) -> None:
    actor, ledger = actor_of(tmp_path, [FaultDrill("nan", 3)])
    if fired_by_the_script:
        ledger.writer("attempt-1.node-0.rank-0").append("train", "drill_fired", fault="nan", node="node-0", step=3)
    actor.ended(failed=True)
    refused = list(ledger.events("train", "drill_refused"))
    if says is None:
        assert refused == [] and actor.left == []
    else:
        [why] = [r["reason"] for r in refused]
        assert says in why and "TrainyardCallback" in why


def test_a_script_that_acts_out_its_drills_is_left_its_kill(tmp_path: Path) -> None:
    """It said so as it started (drills_acted): the supervisor never signals its node, so nothing is acted twice."""
    actor, ledger = actor_of(tmp_path, [KILL])
    ledger.writer("attempt-1.node-1.rank-1").append("train", "drills_acted", attempt=1, node="node-1", faults=["kill"])
    actor(handle=None)  # the launcher is None: a signal would raise
    assert actor.left == [KILL] and not list(ledger.events("train", "drill_fired"))
