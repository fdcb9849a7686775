"""What ``trainyard drill`` expects of a fault is the recovery policy's own decision for the spec: in place
(``regroup``) on a default spec, where the attempt can regroup; the relaunch actions where it cannot
(``recovery.in_place: false``, or a script whose ranks never formed a group)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainyard.pipeline.drill import DrillReport, Expected, expected
from trainyard.spec import Drill, PipelineSpec
from trainyard.spec.load import spec_from_text

SPEC = """\
dataset: {source: "file:///tmp/cold", name: tokens, hot: "file:///tmp/hot"}
nodes: {count: 2, min: 1}
training: {max_steps: 60, global_batch: 16, micro_batch: 4, checkpoint_every: 10}
checkpoint: {hot: "file:///tmp/ckpt", cold: "file:///tmp/coldckpt"}
"""
NODES = ["node-0", "node-1"]
UNGROUPED = "its ranks never formed a group on the coordination store"


def spec(recovery: str = "") -> PipelineSpec:
    return spec_from_text(SPEC + (f"recovery: {recovery}\n" if recovery else ""), Path("drill.yaml"))


def expect(fault: str, recovery: str = "", step: int = 30, node: str | None = "node-1", spares: list[str] | None = None,
           why_not: str = "") -> Expected:  # fmt: skip
    return expected(spec(recovery), Drill(fault=fault, step=step, node=node), NODES, spares or [], why_not)


@pytest.mark.parametrize(
    ("fault", "recovery", "why_not", "action", "end"),
    [
        # a default spec recovers in place what the survivors can heal
        ("kill", "", "", "regroup", "succeeded"),
        ("hang", "", "", "regroup", "succeeded"),
        ("preempt", "", "", "regroup", "succeeded"),
        # ... and relaunches the rest, as it would without in place
        ("oom", "", "", "retry", "succeeded"),
        ("nan", "", "", "rollback", "succeeded"),
        ("exception", "", "", "fail", "failed"),
        ("slow", "", "", None, "succeeded"),
        ("corrupt_checkpoint", "", "", None, "succeeded"),
        # recovery.in_place: false relaunches every failure
        ("kill", "{in_place: false}", "recovery.in_place is false", "scale_down", "succeeded"),
        ("hang", "{in_place: false}", "recovery.in_place is false", "scale_down", "succeeded"),
        ("preempt", "{in_place: false}", "recovery.in_place is false", "retry", "succeeded"),
        ("oom", "{in_place: false}", "recovery.in_place is false", "retry", "succeeded"),
        # a default spec whose script never formed a group relaunches, and says why
        ("kill", "", UNGROUPED, "scale_down", "succeeded"),
        # the spec's own actions are the policy's input too
        ("kill", "{actions: {node_lost: fail}}", "", "fail", "failed"),
    ],
)
def test_a_drill_expects_what_the_policy_decides_for_the_spec(
    fault: str, recovery: str, why_not: str, action: str | None, end: str
) -> None:
    want = expect(fault, recovery, why_not=why_not)
    assert (want.action, want.end) == (action, end), want.reason


def test_the_expectation_says_the_path_and_why() -> None:
    assert "regroup in place, 2 -> 1 nodes" in expect("kill").reason
    assert "relaunch, not in place" not in expect("kill", "{in_place: false}").reason  # off: nothing was offered
    assert f"relaunch, not in place: {UNGROUPED}" in expect("kill", why_not=UNGROUPED).reason
    # a spare the pressure test left keeps the size, in place
    assert "spare node-2 joins with the survivors' state, 2 nodes kept" in expect("kill", spares=["node-2"]).reason


def test_a_divergence_before_the_first_save_has_nothing_to_roll_back_to() -> None:
    """A fresh start diverging before its first checkpoint fails: the same seed would diverge again."""
    assert (expect("nan", step=25).action, expect("nan", step=25).end) == ("rollback", "succeeded")
    early = expect("nan", step=5)
    assert (early.action, early.end) == ("fail", "failed"), early.reason


def test_a_drill_without_a_node_strikes_the_attempts_first() -> None:
    assert "node_lost on node-0" in expect("kill", node=None).reason


def test_the_report_is_ok_when_the_run_took_the_expected_action() -> None:
    def report(actions: list[str], end: str) -> DrillReport:
        return DrillReport("kill", actions, end, expect("kill"), {}, Path("."))

    assert report(["regroup"], "succeeded").ok
    assert not report(["scale_down"], "succeeded").ok  # the old expectation's answer, on a default spec
    assert not report(["regroup"], "failed").ok
