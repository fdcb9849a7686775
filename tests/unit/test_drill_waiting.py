"""A drill whose node the pressure test left out as a spare does nothing until that node joins the group: the
attempt's start says so (``drill_waiting``, a warning line), and the summary and report show it until it strikes."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from trainyard.backends.base import Launcher, LaunchPlan
from trainyard.events.ledger import Ledger
from trainyard.protocol.env import FaultDrill
from trainyard.recovery.attempt import start_attempt
from trainyard.recovery.drills import waiting
from trainyard.report.pages import report_html
from trainyard.report.summary import format_summary, summarize

GROUP = ["node-1", "node-2"]  # the pressure test ranked node-0 last: it is the warm spare
SPARE_KILL = FaultDrill("kill", 30, "node-0")


def test_a_drill_on_a_spare_waits_and_says_why() -> None:
    [(drill, why)] = waiting([SPARE_KILL, FaultDrill("kill", 30, "node-1")], GROUP, warm=["node-0"])
    assert drill == SPARE_KILL
    assert "node-0 is a warm spare waiting outside the attempt's group (node-1, node-2)" in why
    assert "strikes only if node-0 joins the group before step 30" in why and "name one of node-1, node-2" in why
    [(_, cold)] = waiting([SPARE_KILL], GROUP, warm=[])  # relaunch path: spares are not started with the attempt
    assert "not a node of the attempt (node-1, node-2) and not started with it" in cold


@pytest.mark.parametrize("drill", [FaultDrill("kill", 30, "node-1"), FaultDrill("nan", 30), FaultDrill("kill", 30)])
def test_a_drill_on_a_node_of_the_group_does_not_wait(drill: FaultDrill) -> None:
    """A drill without a node strikes every node or the attempt's first: always in the group."""
    assert waiting([drill], GROUP, warm=["node-0"]) == []


class Launched:
    """A launcher that only remembers what it was asked to launch."""

    def __init__(self) -> None:
        self.plans: list[LaunchPlan] = []

    def launch(self, plan: LaunchPlan) -> Any:
        self.plans.append(plan)
        return "handle"


def start(tmp_path: Path, drills: list[FaultDrill], outside: list[FaultDrill] | None = None) -> Ledger:
    ledger = Ledger.in_dir(tmp_path)
    env = SimpleNamespace(heartbeat_dir=None, micro_batch=4, resume_from="none", checkpoint_dir=tmp_path,
                          drills=tuple(drills))  # fmt: skip
    plan = cast(LaunchPlan, SimpleNamespace(attempt=1, nodes=GROUP, world_size=2, train_env=env))
    assert start_attempt(cast(Launcher, Launched()), plan, ledger, ["node-0"], outside) == "handle"
    return ledger


def test_the_attempts_start_records_and_logs_a_waiting_drill(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="trainyard.recovery.drills"):
        ledger = start(tmp_path, [SPARE_KILL, FaultDrill("kill", 40, "node-2")])
    [event] = ledger.events("train", "drill_waiting")
    assert (event["attempt"], event["fault"], event["node"], event["step"]) == (1, "kill", "node-0", 30)
    assert "warm spare" in event["reason"]
    assert "attempt 1: drill kill at step 30 waits: node-0 is a warm spare" in caplog.text


def test_a_drill_acted_out_from_outside_is_not_said_to_wait(tmp_path: Path) -> None:
    """The supervisor refuses those itself (``drill_refused``: not a node of the attempt), and never waits."""
    ledger = start(tmp_path, [SPARE_KILL], outside=[SPARE_KILL])
    assert list(ledger.events("train", "drill_waiting")) == []


def test_the_summary_and_report_show_a_drill_that_still_waits(tmp_path: Path) -> None:
    ledger = start(tmp_path, [SPARE_KILL])
    summary = summarize(ledger)
    [said] = summary["drills_waiting"]
    assert said.startswith("kill at step 30 on node-0: node-0 is a warm spare")
    assert f"  drill waiting:    {said}" in format_summary(summary)
    assert "Drill waiting: kill at step 30 on node-0" in report_html(
        summary, {"dag_id": "d", "run_id": "r", "ds": None}
    )
    # It joined and struck: nothing waits any more.
    ledger.writer("attempt-1.node-0.rank-0").append("train", "drill_fired", fault="kill", node="node-0", step=30)
    assert summarize(ledger)["drills_waiting"] == []
