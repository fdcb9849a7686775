"""Preemption on 3 local nodes: a node given notice (SIGTERM) leaves at a step boundary, blamed for nothing.

In place, the group regroups without it before it ends (it exits 0, left out) and the survivors go on
from the step it left at: one attempt, nothing lost. On the relaunch path the attempt is retried on the
same nodes: the node given notice is not excluded.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from test_elastic_group import KILL_AT, WAIT_S, _exit_cleanly, _finished, _kill_left, _start, _wait_for
from test_in_place import IN_PLACE
from test_recovery import RELAUNCH, events, finish, run_with

from trainyard.checkpoint.format import read_manifest
from trainyard.pipeline import stages
from trainyard.protocol.coordinator import Coordinator
from trainyard.protocol.coordstore import Generation, node_keys
from trainyard.protocol.sealing import new_secret
from trainyard.protocol.shards import write_synthetic_corpus
from trainyard.recovery import storehost
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
    run = run_with(tmp_path, NOTICE, spec=RELAUNCH)  # the relaunch path: in place (the default) regroups
    manifest = finish(run)
    [classified] = events(run, "failure_classified")
    assert classified["kind"] == "preempted" and classified["culprits"] == [], classified["evidence"]
    [decision] = events(run, "decision")
    assert decision["action"] == "retry"
    assert not events(run, "nodes_marked")
    assert [e["nodes"] for e in events(run, "attempt_start")] == [["node-0", "node-1", "node-2"]] * 2
    assert manifest["world_size"] == 3


def test_the_worker_side_every_rank_leaves_after_the_same_step_and_a_spare_given_notice_just_ends(
    tmp_path: Path,
) -> None:
    """The test is the supervisor (as in test_elastic_group): node-1 gets SIGTERM before step 6; every rank
    leaves generation 1 after step 6, node-1 reports leave/node-1 and exits 0; generation 2 (node-1 out, the
    warm spare node-3 in) goes on from step 6 with no fault reported. node-4, a spare that trains nothing,
    ends at once on its SIGTERM (as before: nothing to hand over), not at a step boundary that never comes."""
    write_synthetic_corpus(tmp_path / "data", shards=2, tokens_per_shard=4096)
    store, port = storehost.serve()
    nodes = ["node-0", "node-1", "node-2"]
    keys = node_keys(new_secret(), [*nodes, "node-3", "node-4"])
    coord = Coordinator(storehost.attempt_store(store, 1), keys)
    coord.publish(Generation(1, nodes, micro_batch=2))
    drills = [{"fault": "preempt", "step": KILL_AT, "node": "node-1"}]
    procs = {n: _start(n, port, keys[n], tmp_path, drills) for n in [*nodes, "node-3", "node-4"]}
    survivors = ["node-0", "node-2", "node-3"]
    try:
        _wait_for("node-1's leave report", lambda: coord.leaving(1) == ["node-1"], procs, tmp_path)
        coord.publish(Generation(2, survivors, micro_batch=2, joiners=["node-3"]))  # accumulation 2
        assert coord.wait_ready(2, survivors, timeout_s=WAIT_S)
        assert coord.ready_steps(2) == dict.fromkeys(survivors, KILL_AT)  # left after step 6: nothing redone
        assert procs["node-1"].wait(timeout=WAIT_S) == 0  # left out, cleanly
        _wait_for("node-4 waiting as a spare", lambda: coord.spare_ready("node-4"), procs, tmp_path)
        os.kill(procs["node-4"].pid, signal.SIGTERM)
        assert procs["node-4"].wait(timeout=WAIT_S) == -signal.SIGTERM
        _exit_cleanly(procs, survivors, tmp_path)
    finally:
        _kill_left(procs)
    assert coord.faults() == {}  # no collective failed: the group let node-1 go first
    assert len({_finished(tmp_path, node) for node in survivors}) == 1
    said = (tmp_path / "node-1.log").read_text()
    assert f"leaving generation 1 after step {KILL_AT}" in said and "Traceback" not in said
