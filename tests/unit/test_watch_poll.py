"""The blocking watch aims at ``POLL_CPU_SHARE`` of a core: a costly poll (many ranks' beats) waits longer, up to
``POLL_WAIT_MAX_S`` (what detection may take)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from trainyard.backends.base import AttemptStatus, LaunchPlan, NodeStatus
from trainyard.protocol.env import TrainEnv
from trainyard.recovery.attempt import POLL_CPU_SHARE, POLL_WAIT_MAX_S, watch_attempt
from trainyard.recovery.look import AttemptView
from trainyard.recovery.observations import AttemptSucceeded


class Launcher:
    """Running for three polls, then succeeded; each poll burns ``cost_s`` of this thread's CPU."""

    def __init__(self, cost_s: float):
        self.cost_s, self.polls = cost_s, 0

    def poll(self, handle: object) -> AttemptStatus:
        end = time.thread_time() + self.cost_s
        while time.thread_time() < end:
            pass
        self.polls += 1
        return AttemptStatus([NodeStatus("node-0", "succeeded" if self.polls > 3 else "running")])


@pytest.mark.parametrize("cost_s", [0.0, 0.02, 0.2])
def test_the_wait_between_polls_grows_with_their_cost(tmp_path: Path, cost_s: float) -> None:
    plan = LaunchPlan("r", 1, ["node-0"], 1, "train.py", [], TrainEnv(tmp_path, tmp_path, 1), tmp_path)
    pauses: list[float] = []
    view = AttemptView.of(plan, time.time(), 60.0, tmp_path / "hb")
    seen = watch_attempt(Launcher(cost_s), None, plan, view, poll_s=0.01, pause=pauses.append)
    assert isinstance(seen, AttemptSucceeded) and len(pauses) == 3
    if cost_s > POLL_WAIT_MAX_S * POLL_CPU_SHARE:
        assert pauses == [POLL_WAIT_MAX_S] * 3  # 200 ms of CPU would buy 4 s: detection would wait too long
    elif cost_s:
        assert all(cost_s / POLL_CPU_SHARE <= p <= POLL_WAIT_MAX_S for p in pauses), pauses  # 20 ms: 0.4 s at least
    else:
        assert max(pauses) < 0.05, pauses  # a cheap poll keeps the configured interval
