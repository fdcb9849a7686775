"""In place and relaunched, one loss curve: 3 -> 2 nodes with the global batch kept (issue 17, item 4).

The loop is deterministic (batches and learning rate are functions of the step), so the survivors that
regroup in place and keep their state in memory must train what a relaunch from the checkpoint trains,
up to the rounding of a different all-reduce order.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_recovery import SPEC, events, run_with

from trainyard.pipeline import stages

pytestmark = pytest.mark.integration

STEP_EVENTS = SPEC.replace("heartbeat_timeout_s: 6", "heartbeat_timeout_s: 6\n  progress_every_s: 0")
IN_PLACE = STEP_EVENTS.replace("backoff_s: 0.2}}", "backoff_s: 0.2, in_place: true, rejoin: false}}")
RELAUNCH = STEP_EVENTS.replace("backoff_s: 0.2}}", "backoff_s: 0.2, in_place: false}}")  # the path compared with
NODES = ["node-0", "node-1", "node-2"]


def losses(run) -> dict[int, float]:
    """Each step's loss; a step trained again after the fault replaces the lost one."""
    return {e["step"]: e["loss"] for e in events(run, "step")}


def test_in_place_reproduces_the_loss_of_the_relaunch_path(tmp_path: Path) -> None:
    drills = "[{fault: kill, node: node-1, step: 12}]"
    in_place = run_with(tmp_path / "in-place", drills, spec=IN_PLACE)
    assert stages.train(in_place, NODES).attempts == 1
    relaunched = run_with(tmp_path / "relaunch", drills, spec=RELAUNCH)
    assert stages.train(relaunched, NODES).attempts == 2
    assert [d["action"] for d in events(in_place, "decision")] == ["regroup"]
    assert [d["action"] for d in events(relaunched, "decision")] == ["scale_down"]
    ours, theirs = losses(in_place), losses(relaunched)
    assert sorted(ours) == sorted(theirs) == list(range(1, 21))
    assert {e["world_size"] for e in events(in_place, "step") if e["step"] > 12} == {2}
    worst = max(abs(ours[s] - theirs[s]) for s in ours)
    assert worst <= 1e-4, f"in place and relaunched losses differ by {worst:.2e}"
    assert ours[1] == theirs[1]  # before the fault, the same processes' arithmetic: bit for bit
