"""Preemption on 3 local nodes: a node given notice (SIGTERM) leaves at a step boundary, blamed for nothing.

In place, the group regroups without it before it ends (it exits 0, left out) and the survivors go on
from the step it left at: one attempt, nothing lost. On the relaunch path the attempt is retried on the
same nodes: the node given notice is not excluded.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_in_place import IN_PLACE
from test_recovery import events, finish, run_with

from trainyard.checkpoint.format import read_manifest
from trainyard.pipeline import stages
from trainyard.recovery.figures import recovery_figures

pytestmark = pytest.mark.integration

NOTICE = "[{fault: preempt, node: node-1, step: 12}]"


def node_log(run, node: str) -> str:
    [path] = [p for p in run.dir.rglob(f"{node}.log")]
    return path.read_text(errors="replace")


def test_a_node_given_notice_leaves_at_a_step_boundary_in_place(tmp_path: Path) -> None:
    run = run_with(tmp_path, NOTICE, spec=IN_PLACE)
    result = stages.train(run, ["node-0", "node-1", "node-2"])
    assert result.attempts == 1 and result.last_step == 20  # no relaunch
    assert stages.check_checkpoint(run, result.checkpoint, 20).step == 20
    [classified] = events(run, "failure_classified")
    assert classified["kind"] == "preempted" and classified["culprits"] == []  # notice blames no host
    assert "node-1 given notice (SIGTERM)" in classified["evidence"]  # the store's word, not a timeout
    [decision] = events(run, "decision")
    assert decision["action"] == "regroup" and decision["path"] == "in_place"
    assert decision["new_nodes"] == ["node-0", "node-2"] and decision["left_out"] == ["node-1"]
    assert not events(run, "nodes_marked") and not events(run, "rejoining")
    [regrouped] = events(run, "regrouped")
    assert regrouped["generation"] == 2 and regrouped["world_size"] == 2
    assert regrouped["from_step"] >= 12  # the step it left after: nothing redone
    assert read_manifest(Path(result.checkpoint))["world_size"] == 2
    [failure] = recovery_figures(run.ledger)["failures"]
    assert failure["path"] == "in_place" and failure["lost_steps"] == 0
    said = node_log(run, "node-1")
    # It left on its own, after the step, with no failed collective: the group let it go first.
    assert "given notice (SIGTERM); leaving generation 1 after step" in said and "given notice, leaving" in said
    assert "Traceback" not in said and "collective failed" not in node_log(run, "node-0")


def test_notice_on_the_relaunch_path_retries_on_the_same_nodes(tmp_path: Path) -> None:
    """torchrun's agent gets the SIGTERM (as a pod's first process does): the attempt ends, classified
    preempted; the next attempt runs on the same three nodes (nothing excluded) from the checkpoint."""
    run = run_with(tmp_path, NOTICE)
    manifest = finish(run)
    [classified] = events(run, "failure_classified")
    assert classified["kind"] == "preempted" and classified["culprits"] == [], classified["evidence"]
    [decision] = events(run, "decision")
    assert decision["action"] == "retry"
    assert not events(run, "nodes_marked")
    assert [e["nodes"] for e in events(run, "attempt_start")] == [["node-0", "node-1", "node-2"]] * 2
    assert manifest["world_size"] == 3
