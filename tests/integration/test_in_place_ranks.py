"""In-place recovery with two ranks per node (3 nodes x 2 ranks, gloo on CPU): the node is the unit.

A node killed takes both its ranks out and the four survivors regroup in the same attempt; a warm spare
node brings both of its ranks, which receive the state. Every rank that finishes holds the same parameters.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_recovery import SPEC, events, run_with

from trainyard.checkpoint.format import read_manifest
from trainyard.pipeline import stages
from trainyard.recovery.figures import recovery_figures

pytestmark = pytest.mark.integration

TWO_RANKS = (
    SPEC.replace("backoff_s: 0.2}}", "backoff_s: 0.2, in_place: true, rejoin: false}}")
    .replace("nodes: {{count: 3, min: 2}}", "nodes: {{count: 3, min: 2, procs_per_node: 2}}")
    .replace("global_batch: 12", "global_batch: 24")  # 6 ranks x 2 x 2, and 4 ranks x 2 x 3
)
FINISHED = re.compile(r"(node-\d): finished at step (\d+) in generation (\d+), params ([0-9a-f]{16})")


def finished(tmp_path: Path) -> list[tuple[str, int, int, str]]:
    """What each rank that finished logged: its node, step, generation and parameters' digest."""
    return sorted(
        (node, int(step), int(gen), digest)
        for log in tmp_path.rglob("node-*.log")
        for node, step, gen, digest in FINISHED.findall(log.read_text(errors="replace"))
    )


def test_a_node_of_two_ranks_lost_takes_both_out_and_the_four_survivors_regroup(tmp_path: Path) -> None:
    run = run_with(tmp_path, "[{fault: kill, node: node-1, step: 12}]", spec=TWO_RANKS)
    result = stages.train(run, ["node-0", "node-1", "node-2"])
    assert result.attempts == 1 and result.last_step == 20  # no relaunch
    [path] = events(run, "recovery_path")
    assert path["in_place"] is True
    [classified] = events(run, "failure_classified")
    assert classified["kind"] == "node_lost" and classified["culprits"] == ["node-1"]
    [decision] = events(run, "decision")
    assert decision["action"] == "regroup" and decision["new_nodes"] == ["node-0", "node-2"]
    assert decision["left_out"] == ["node-1"] and decision["generation"] == 2
    [regrouped] = events(run, "regrouped")
    assert regrouped["generation"] == 2 and regrouped["world_size"] == 4 and regrouped["node"] == "node-0"
    assert [e["world_size"] for e in events(run, "attempt_start")] == [6]
    manifest = read_manifest(Path(result.checkpoint))
    assert manifest["world_size"] == 4 and manifest["global_batch"] == 24  # kept by accumulation
    [failure] = recovery_figures(run.ledger)["failures"]
    assert failure["path"] == "in_place" and failure["lost_steps"] <= 1
    ends = finished(tmp_path)
    assert [(node, step, gen) for node, step, gen, _ in ends] == [("node-0", 20, 2)] * 2 + [("node-2", 20, 2)] * 2
    assert len({digest for *_, digest in ends}) == 1  # every surviving rank holds the same parameters
    assert not events(run, "store_refused")


def test_a_warm_spare_node_brings_both_its_ranks_and_they_receive_the_state(tmp_path: Path) -> None:
    spec = TWO_RANKS.replace("min: 2, procs_per_node: 2", "min: 2, spare: 1, procs_per_node: 2")
    run = run_with(tmp_path, "[{fault: kill, node: node-1, step: 12}]", spec=spec)
    result = stages.train(run, ["node-0", "node-1", "node-2"], spares=["node-3"])
    assert result.attempts == 1 and result.last_step == 20
    [decision] = events(run, "decision")
    assert decision["action"] == "regroup" and decision["joiners"] == ["node-3"]
    assert decision["new_nodes"] == ["node-0", "node-2", "node-3"]
    assert [e["world_size"] for e in events(run, "regrouped")] == [6]
    assert read_manifest(Path(result.checkpoint))["world_size"] == 6
    ends = finished(tmp_path)
    assert [node for node, *_ in ends] == ["node-0"] * 2 + ["node-2"] * 2 + ["node-3"] * 2
    assert len({digest for *_, digest in ends}) == 1  # the joiner's ranks got the survivors' state
    figures = recovery_figures(run.ledger)
    assert figures["spares_joined"] == "node-3" and figures["lost_steps"] <= 1
    assert not events(run, "store_refused")
