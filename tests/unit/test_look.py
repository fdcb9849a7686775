"""``look``: what one look at an attempt sees, from what a driver read, as a table (every driver shares it)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from trainyard.backends.base import AttemptStatus, NodeStatus
from trainyard.recovery.logwatch import LogSilence
from trainyard.recovery.look import FAULT, PREEMPTED, SPARES, SUCCEEDED, AttemptView, Reads, Sight, look
from trainyard.recovery.watch import BEATLESS, CRASH, HANG, Detection

VIEW = AttemptView(3, ["a", "b"], 2, Path("/hb"), 100.0, 60.0, grace_s=600.0)
RUNNING = AttemptStatus([NodeStatus("a", "running"), NodeStatus("b", "running")])
FAILED = AttemptStatus([NodeStatus("a", "running"), NodeStatus("b", "failed", 1)])
DONE = AttemptStatus([NodeStatus("a", "succeeded"), NodeStatus("b", "succeeded")])
CRASHED = Detection(CRASH, "b exited 1")
STORE = "a rank reported a fault or a notice to leave on the store"
QUIET = LogSilence(12.0, 10.0, "iter 34: loss 3.58")
CALM = LogSilence(9.9, 10.0, "iter 34: loss 3.58")

CASES = [
    ("nothing wrong", Reads(RUNNING), None),
    ("the group succeeded, spares or not", Reads(DONE, spares=["c"]), Sight(SUCCEEDED)),
    ("a crash", Reads(FAILED, CRASHED), Sight(CRASH, "b exited 1")),
    ("a crash the store explains", Reads(FAILED, CRASHED, faulted=True), Sight(FAULT, STORE)),
    ("a crash before spares", Reads(FAILED, CRASHED, spares=["c"]), Sight(CRASH, "b exited 1")),
    ("a hang names its suspects", Reads(RUNNING, Detection(HANG, "quiet", ["b"])), Sight(HANG, "quiet", ["b"])),
    ("beatless", Reads(RUNNING, Detection(BEATLESS, "no beat")), Sight(BEATLESS, "no beat")),
    (
        "a hang before a notice",
        Reads(RUNNING, Detection(HANG, "quiet", ["b"]), leaving=["a"]),
        Sight(HANG, "quiet", ["b"]),
    ),
    (
        "a group node leaving on notice",
        Reads(RUNNING, leaving=["a", "z"]),
        Sight(PREEMPTED, "a given notice (SIGTERM), leaving at a step boundary", ["a"]),
    ),
    ("a node outside the group leaving is no news", Reads(RUNNING, leaving=["z"]), None),
    ("the fault counter alone", Reads(RUNNING, faulted=True), Sight(FAULT, STORE)),
    # Issue 51: a script without heartbeats whose log stopped showing steps past training.log_silence_s.
    (
        "a log silent past its limit is a hang, no node named",
        Reads(RUNNING, log=QUIET),
        Sight(HANG, QUIET.reason(), from_log=True),
    ),
    ("a log quiet within its limit is no news", Reads(RUNNING, log=CALM), None),
    ("a crash before a silent log", Reads(FAILED, CRASHED, log=QUIET), Sight(CRASH, "b exited 1")),
    ("spares once nothing is wrong", Reads(RUNNING, spares=["c"]), Sight(SPARES, "", ["c"])),
]


@pytest.mark.parametrize(("why", "reads", "expected"), CASES, ids=[c[0] for c in CASES])
def test_a_look_sees(why: str, reads: Reads, expected: Sight | None) -> None:
    assert look(VIEW, reads) == expected


def test_the_view_judges_a_first_beat_by_its_grace(tmp_path: Path) -> None:
    """The view carries the spec's ``startup_grace_s`` to ``detect``: no beat 200 s in is news only past it."""
    started = time.time() - 200
    view = AttemptView(1, ["a"], 1, tmp_path, started, 10.0, grace_s=600.0, beatless_said=False)
    assert view.detect(AttemptStatus([NodeStatus("a", "running")])) is None
    late = AttemptView(1, ["a"], 1, tmp_path, started, 10.0, grace_s=100.0, beatless_said=False)
    found = late.detect(AttemptStatus([NodeStatus("a", "running")]))
    assert found is not None and found.trigger == BEATLESS
