"""The recovery policy as a table of cases: budget, actions, backoff, micro-batch, world size, rollback, overrides."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from trainyard.recovery.classify import Classified
from trainyard.recovery.policy import (
    MAX_DELAY_S,
    AttemptRecord,
    GiveUp,
    InPlace,
    Regroup,
    Retry,
    Rollback,
    ScaleDown,
    Situation,
    decide,
    fitting_micro_batch,
)  # fmt: skip
from trainyard.spec import RecoverySpec

EVIDENCE = {
    "node_lost": "node-1 exit -9; peers lost it: node-0: [rank0]: RuntimeError: Connection closed by peer",
    "hang": "no heartbeat from node-1 after step 40",
    "transient": "node-0: [rank0]: RuntimeError: Connection reset by peer",
    "oom": "node-1: [rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
    "diverged": "node-1: [rank1]: trainyard.errors.TrainingFailed: loss is nan at step 30",
    "user_error": "node-1: [rank1]: ValueError: bad shape for head: expected 64 got 48",
    "data_error": "node-0: [rank0]: trainyard.errors.DataError: shard tokens-0003.bin is truncated",
    "preempted": "node-1 given notice (SIGTERM): left at a step boundary after step 40",
}


def failed(kind: str, *culprits: str, step: int | None = None) -> Classified:
    return Classified(kind, EVIDENCE[kind], list(culprits), step)


def notice(*leaving: str, step: int | None = 40) -> Classified:
    """A preemption as classify says it: the nodes given notice leave; no culprit."""
    return Classified("preempted", EVIDENCE["preempted"], [], step, list(leaving))


def world(count: int = 4, spares: int = 0, min_nodes: int = 1, procs: int = 1, global_batch: int = 12,
          micro: int = 3, valid: tuple[int, ...] = (), resumed: int | None = None,
          in_place: InPlace | None = None, followed: bool = True) -> Situation:  # fmt: skip
    return Situation(
        nodes=[f"node-{i}" for i in range(count)],
        spares=[f"node-{count + i}" for i in range(spares)],
        min_nodes=min_nodes,
        procs_per_node=procs,
        global_batch=global_batch,
        micro_batch=micro,
        valid_steps=list(valid),
        resumed_from=resumed,
        in_place=in_place,
        batch_followed=followed,
    )


def before(*kinds: str) -> list[AttemptRecord]:
    return [AttemptRecord(i + 1, kind, "retry", ["node-0", "node-1"]) for i, kind in enumerate(kinds)]


def policy(**kw: Any) -> RecoverySpec:
    return RecoverySpec(**{"max_attempts": 10, "backoff_s": 5.0, "in_place": True, **kw})


NODES = [f"node-{i}" for i in range(4)]

CASES = [
    # id, history, failure, situation, policy, expected type, expected fields, reason must contain
    # ---- the attempt budget counts the attempt that just failed
    (
        "budget-exhausted",
        before("transient", "transient"),
        failed("transient"),
        world(),
        policy(max_attempts=3),
        GiveUp,
        {},
        "attempt budget of 3 exhausted: transient: node-0: [rank0]: RuntimeError: Connection reset by peer",
    ),
    (
        "budget-of-one",
        [],
        failed("node_lost", "node-1"),
        world(),
        policy(max_attempts=1),
        GiveUp,
        {},
        "attempt budget of 1 exhausted: node_lost",
    ),
    (
        "budget-left",
        before("transient"),
        failed("transient"),
        world(),
        policy(max_attempts=3),
        Retry,
        {"delay_s": 10.0, "micro_batch": None},
        "retry on the same 4 nodes",
    ),
    # ---- fail: no retry helps, and that is said before any budget
    (
        "user-error-fails-fast",
        [],
        failed("user_error"),
        world(),
        policy(),
        GiveUp,
        {},
        "user_error (node-1: [rank1]: ValueError: bad shape for head",
    ),
    (
        "data-error-fails-fast",
        [],
        failed("data_error"),
        world(),
        policy(),
        GiveUp,
        {},
        "data_error (node-0: [rank0]: trainyard.errors.DataError",
    ),
    (
        "fail-named-over-budget",
        before("transient", "transient"),
        failed("user_error"),
        world(),
        policy(max_attempts=3),
        GiveUp,
        {},
        "recovery action for user_error is fail",
    ),
    # ---- retry with exponential backoff per kind
    (
        "transient-first",
        [],
        failed("transient"),
        world(),
        policy(),
        Retry,
        {"delay_s": 5.0, "micro_batch": None},
        "transient (node-0",
    ),
    (
        "transient-third",
        before("transient", "transient"),
        failed("transient"),
        world(),
        policy(),
        Retry,
        {"delay_s": 20.0},
        "in 20 s",
    ),
    (
        "backoff-counts-the-same-kind-only",
        before("node_lost", "oom", "transient"),
        failed("transient"),
        world(),
        policy(),
        Retry,
        {"delay_s": 10.0},
        "transient",
    ),
    (
        "backoff-capped",
        before(*["transient"] * 5),
        failed("transient"),
        world(),
        policy(backoff_s=600),
        Retry,
        {"delay_s": MAX_DELAY_S},
        "in 3600 s",
    ),
    (
        "no-backoff",
        before("transient"),
        failed("transient"),
        world(),
        policy(backoff_s=0),
        Retry,
        {"delay_s": 0.0},
        "in 0 s",
    ),
    # ---- oom: half the micro-batch, the largest that still divides the per-rank batch
    (
        "oom-halves",
        [],
        failed("oom", "node-1"),
        world(2, global_batch=32, micro=4),
        policy(),
        Retry,
        {"micro_batch": 2, "delay_s": 5.0},
        "micro-batch 4 -> 2 (micro-batch 2 x 8 accumulation, global batch 32",
    ),
    (
        "oom-half-does-not-divide",
        [],
        failed("oom", "node-1"),
        world(2, global_batch=60, micro=15),
        policy(),
        Retry,
        {"micro_batch": 6},
        "micro-batch 15 -> 6",
    ),  # 30 per rank: 7 does not divide it, 6 does
    (
        "oom-to-one",
        before("oom"),
        failed("oom", "node-1"),
        world(2, global_batch=12, micro=3),
        policy(),
        Retry,
        {"micro_batch": 1, "delay_s": 10.0},
        "micro-batch 3 -> 1",
    ),
    (
        "oom-at-micro-1",
        [],
        failed("oom", "node-1"),
        world(2, global_batch=12, micro=1),
        policy(),
        GiveUp,
        {},
        "out of memory at micro-batch 1",
    ),
    # ---- scale down: largest world size that divides the global batch, global batch kept
    (
        "scale-down-12-on-4",
        [],
        failed("node_lost", "node-1"),
        world(4, global_batch=12, micro=3),
        policy(),
        ScaleDown,
        {"nodes": ["node-0", "node-2", "node-3"], "micro_batch": 2},
        "node_lost on node-1 (node-1 exit -9; peers lost it: node-0: [rank0]: RuntimeError: Connection closed by peer):"
        " scale down 4 -> 3 nodes, micro-batch 2 x 2 accumulation, global batch 12 kept",
    ),
    (
        "scale-down-skips-3-for-16",
        [],
        failed("node_lost", "node-1"),
        world(4, global_batch=16, micro=4),
        policy(),
        ScaleDown,
        {"nodes": ["node-0", "node-2"], "micro_batch": 4},
        "scale down 4 -> 2 nodes",
    ),
    (
        "scale-down-with-procs",
        [],
        failed("hang", "node-2"),
        world(3, procs=2, global_batch=12, micro=2),
        policy(),
        ScaleDown,
        {"nodes": ["node-0", "node-1"], "micro_batch": 1},
        "hang on node-2",
    ),  # 2 x 2 ranks: 3 per rank
    (
        "scale-down-two-culprits",
        [],
        failed("node_lost", "node-0", "node-3"),
        world(4, global_batch=12, micro=1),
        policy(),
        ScaleDown,
        {"nodes": ["node-1", "node-2"], "micro_batch": 1},
        "node_lost on node-0, node-3",
    ),
    (
        "scale-down-to-min",
        [],
        failed("node_lost", "node-1"),
        world(2, min_nodes=1, global_batch=12, micro=3),
        policy(),
        ScaleDown,
        {"nodes": ["node-0"], "micro_batch": 3},
        "scale down 2 -> 1 nodes",
    ),
    (
        "below-min-fails",
        [],
        failed("node_lost", "node-1"),
        world(4, min_nodes=3, global_batch=16, micro=2),
        policy(),
        GiveUp,
        {},
        "no world size from 3 down to nodes.min 3 x 1 procs divides the global batch 16",
    ),
    (
        "spare-replaces",
        [],
        failed("node_lost", "node-1"),
        world(4, spares=2, global_batch=16, micro=4),
        policy(),
        ScaleDown,
        {"nodes": ["node-0", "node-2", "node-3", "node-4"], "micro_batch": 4},
        "replace with spare node-4, scaling back up to 4 nodes",
    ),
    (
        "too-few-spares-still-help",
        [],
        failed("node_lost", "node-1", "node-2"),
        world(4, spares=1, global_batch=12),
        policy(),
        ScaleDown,
        {"nodes": ["node-0", "node-3", "node-4"], "micro_batch": 2},
        "(spare node-4 joins)",
    ),
    (
        "no-culprit-keeps-the-nodes",
        [],
        failed("hang"),
        world(4),
        policy(),
        Retry,
        {"micro_batch": None, "delay_s": 5.0},
        "no node to leave out; retry on the same 4 nodes",
    ),
    (
        # A host outside the attempt's is named as such (its pods were not pinned to the plan's hosts).
        "unknown-culprit-keeps-the-nodes",
        [],
        failed("node_lost", "node-9"),
        world(4),
        policy(),
        Retry,
        {"micro_batch": None},
        "node-9 is not among the attempt's hosts node-0, node-1, node-2, node-3",
    ),
    (
        # Hosts are compared with hosts: a spare that is itself blamed never replaces a culprit.
        "a-blamed-spare-is-not-taken",
        [],
        failed("node_lost", "node-1", "node-4"),
        world(4, spares=2),
        policy(),
        ScaleDown,
        {"nodes": ["node-0", "node-2", "node-3", "node-5"]},
        "replace with spare node-5",
    ),
    (
        "scale-down-backoff",
        before("node_lost"),
        failed("node_lost", "node-1"),
        world(4, global_batch=12),
        policy(),
        ScaleDown,
        {"delay_s": 10.0},
        "scale down 4 -> 3",
    ),
    # ---- rollback: below the divergence, and further back each time it recurs
    (
        "rollback-newest",
        [],
        failed("diverged", step=32),
        world(valid=(10, 20, 30)),
        policy(),
        Rollback,
        {"to_step": 30, "delay_s": 5.0},
        "roll back to step 30, the newest valid checkpoint below step 32",
    ),
    (
        "rollback-strictly-below",
        [],
        failed("diverged", step=30),
        world(valid=(10, 20, 30)),
        policy(),
        Rollback,
        {"to_step": 20},
        "roll back to step 20",
    ),
    (
        "rollback-step-unknown",
        [],
        failed("diverged"),
        world(valid=(10, 20)),
        policy(),
        Rollback,
        {"to_step": 20},
        "roll back to step 20",
    ),
    (
        "rollback-first-after-resume",
        before("node_lost"),
        failed("diverged", step=30),
        world(valid=(10, 20), resumed=20),
        policy(),
        Rollback,
        {"to_step": 20},
        "step 20",
    ),  # resumed after a node loss: 20 is not suspect yet
    (
        "rollback-recurs",
        before("diverged"),
        failed("diverged", step=30),
        world(valid=(10, 20, 25), resumed=20),
        policy(),
        Rollback,
        {"to_step": 10, "delay_s": 10.0},
        "below step 20",
    ),
    (
        "rollback-recurs-to-fresh",
        before("diverged", "diverged"),
        failed("diverged", step=30),
        world(valid=(10, 20), resumed=10),
        policy(),
        Rollback,
        {"to_step": 0},
        "start fresh",
    ),
    (
        "fresh-start-diverged",
        [],
        failed("diverged", step=3),
        world(valid=()),
        policy(),
        GiveUp,
        {},
        "a fresh start diverged and there is no valid checkpoint below step 3",
    ),
    # ---- the spec's overrides
    (
        "override-transient-fail",
        [],
        failed("transient"),
        world(),
        policy(actions={"transient": "fail"}),
        GiveUp,
        {},
        "recovery action for transient is fail",
    ),
    (
        "override-node-lost-retry",
        [],
        failed("node_lost", "node-1"),
        world(),
        policy(actions={"node_lost": "retry"}),
        Retry,
        {"micro_batch": None},
        "retry on the same 4 nodes",
    ),
    (
        "override-oom-scale-down",
        [],
        failed("oom", "node-1"),
        world(4, global_batch=16, micro=4),
        policy(actions={"oom": "scale_down"}),
        ScaleDown,
        {"nodes": ["node-0", "node-2"], "micro_batch": 4},
        "oom on node-1",
    ),
    (
        "override-user-error-retry",
        [],
        failed("user_error"),
        world(),
        policy(actions={"user_error": "retry"}),
        Retry,
        {"delay_s": 5.0},
        "user_error",
    ),
    (
        "override-hang-rollback",
        [],
        failed("hang", "node-1", step=40),
        world(valid=(20, 40)),
        policy(actions={"hang": "rollback"}),
        Rollback,
        {"to_step": 20},
        "hang (no heartbeat from node-1",
    ),
]


CAN = InPlace(True)
ELASTIC = "relaunch, not in place: the script does not use the elastic runtime"

CASES += [
    # ---- in place first: survivors regroup; each reason it cannot is said in the relaunch decision
    (
        "in-place-node-lost",
        [],
        failed("node_lost", "node-1", step=40),
        world(in_place=CAN),
        policy(),
        Regroup,
        {"nodes": ["node-0", "node-2", "node-3"], "joiners": [], "leave_out": ["node-1"], "micro_batch": 2},
        "node_lost on node-1 (node-1 exit -9; peers lost it: node-0: [rank0]: RuntimeError: Connection closed by"
        " peer): regroup in place, 4 -> 3 nodes, micro-batch 2 x 2 accumulation, global batch 12 kept;"
        " survivors keep their state",
    ),
    (
        "in-place-spare-joins",
        [],
        failed("hang", "node-2", step=40),
        world(spares=1, in_place=CAN),
        policy(),
        Regroup,
        {
            "nodes": ["node-0", "node-1", "node-3", "node-4"],
            "joiners": ["node-4"],
            "leave_out": ["node-2"],
            "micro_batch": 3,
        },
        "regroup in place, spare node-4 joins with the survivors' state, 4 nodes kept",
    ),
    (
        "in-place-transient-same-nodes",
        [],
        failed("transient"),
        world(in_place=CAN),
        policy(),
        Regroup,
        {"nodes": NODES, "joiners": [], "leave_out": [], "micro_batch": 3},
        "regroup in place, the same 4 nodes in a new group",
    ),
    (
        "in-place-not-offered-by-the-attempt",
        [],
        failed("node_lost", "node-1"),
        world(in_place=InPlace(False, "the script does not use the elastic runtime")),
        policy(),
        ScaleDown,
        {"nodes": ["node-0", "node-2", "node-3"]},
        "scale down 4 -> 3 nodes, micro-batch 2 x 2 accumulation, global batch 12 kept; " + ELASTIC,
    ),
    (
        "in-place-off-in-the-spec",
        [],
        failed("node_lost", "node-1"),
        world(in_place=CAN),
        policy(in_place=False),
        ScaleDown,
        {"nodes": ["node-0", "node-2", "node-3"]},
        "scale down 4 -> 3 nodes",
    ),
    (
        "in-place-hang-of-unknown-node",
        [],
        failed("hang"),
        world(in_place=CAN),
        policy(),
        Retry,
        {},
        "relaunch, not in place: the silent node of the hang is not known",
    ),
    (
        "in-place-no-progress-since-the-last-regroup",
        [],
        failed("node_lost", "node-2", step=40),
        world(in_place=InPlace(True, regroups=[("node_lost", 40)])),
        policy(),
        ScaleDown,
        {"nodes": ["node-0", "node-1", "node-3"]},
        "relaunch, not in place: node_lost again at step 40, where the last regroup resumed",
    ),
    (
        "in-place-too-often",
        [],
        failed("transient", step=90),
        world(
            in_place=InPlace(
                True, regroups=[("transient", 10), ("node_lost", 20), ("transient", 30), ("transient", 60)]
            )
        ),
        policy(),
        Retry,
        {},
        "relaunch, not in place: transient regrouped in place 3 times in this attempt already",
    ),
    (
        "in-place-too-often-since-the-last-checkpoint",
        [],
        failed("transient", step=90),
        world(valid=(20, 25), in_place=InPlace(True, regroups=[("transient", s) for s in (10, 30, 40, 60)])),
        policy(),
        Retry,
        {},
        "relaunch, not in place: transient regrouped in place 3 times since the checkpoint of step 25 already",
    ),
    (
        "in-place-again-and-again-on-a-long-run-that-saves-between-faults",
        [],
        failed("node_lost", "node-2", step=900),
        world(
            spares=1, valid=(800,), in_place=InPlace(True, regroups=[("node_lost", s) for s in (100, 300, 500, 700)])
        ),
        policy(),
        Regroup,
        {"joiners": ["node-4"]},
        "regroup in place",
    ),
    (
        "in-place-not-for-rollback",
        [],
        failed("hang", "node-1", step=40),
        world(valid=(20,), in_place=CAN),
        policy(actions={"hang": "rollback"}),
        Rollback,
        {"to_step": 20},
        "relaunch, not in place: recovery action for hang is rollback",
    ),
    (
        "in-place-not-for-oom",
        [],
        failed("oom", "node-1"),
        world(in_place=CAN),
        policy(),
        Retry,
        {"micro_batch": 1},
        "retry with micro-batch 3 -> 1",
    ),
    (
        "in-place-no-world-fails-once",
        [],
        failed("node_lost", "node-1"),
        world(count=2, min_nodes=2, in_place=CAN),
        policy(),
        GiveUp,
        {},
        "cannot scale down",
    ),
    (
        "in-place-survivors-exited-too",  # a failed regroup: the survivors' state died with their processes
        [],
        failed("transient"),
        replace(world(in_place=CAN), running=["node-0", "node-3"]),
        policy(),
        Retry,
        {},
        "relaunch, not in place: node-1, node-2 exited too, so no survivor keeps the state",
    ),
    (
        "in-place-budget-first",
        before("node_lost"),
        failed("node_lost", "node-1"),
        world(in_place=CAN),
        policy(max_attempts=2),
        GiveUp,
        {},
        "attempt budget of 2 exhausted",
    ),
]


# ---- notice (preemption): the node leaves, in place or by a retry on the same nodes; never excluded
CASES += [
    (
        "preempted-in-place",
        [],
        notice("node-1"),
        world(in_place=CAN),
        policy(),
        Regroup,
        {"nodes": ["node-0", "node-2", "node-3"], "joiners": [], "leave_out": ["node-1"], "micro_batch": 2},
        "preempted on node-1 (node-1 given notice (SIGTERM): left at a step boundary after step 40): regroup in"
        " place, 4 -> 3 nodes",
    ),
    (
        "preempted-in-place-a-spare-joins",
        [],
        notice("node-3"),
        world(spares=1, in_place=CAN),
        policy(),
        Regroup,
        {"nodes": ["node-0", "node-1", "node-2", "node-4"], "joiners": ["node-4"], "leave_out": ["node-3"]},
        "spare node-4 joins with the survivors' state, 4 nodes kept",
    ),
    (
        "preempted-relaunch-same-nodes",  # no culprit: the next attempt may use the host again
        [],
        notice("node-1"),
        world(),
        policy(),
        Retry,
        {"micro_batch": None},
        "preempted (node-1 given notice (SIGTERM): left at a step boundary after step 40): retry on the same 4 nodes",
    ),
    (
        "preempted-in-place-off",
        [],
        notice("node-1"),
        world(in_place=CAN),
        policy(in_place=False),
        Retry,
        {},
        "retry on the same 4 nodes",
    ),
    (
        "preempted-in-place-refused",
        [],
        notice("node-1"),
        world(in_place=InPlace(False, "the script does not use trainyard's elastic group")),
        policy(),
        Retry,
        {},
        "relaunch, not in place: the script does not use trainyard's elastic group",
    ),
    (
        "preempted-below-min-nodes-relaunches",
        [],
        notice("node-1"),
        world(count=2, min_nodes=2, in_place=CAN),
        policy(),
        Retry,
        {},
        "relaunch, not in place: preempted on node-1",
    ),
    # ---- a notice to an attempt that trained on is a change of members, not a failure: no attempt spent
    (
        "notice-after-progress-spends-no-attempt",
        before("node_lost", "node_lost"),
        notice("node-1", step=40),
        world(),
        policy(max_attempts=3),
        Retry,
        {"delay_s": 5.0},
        "retry on the same 4 nodes",
    ),
    (
        "notices-that-trained-on-neither-spend-nor-back-off",
        [AttemptRecord(i + 1, "preempted", "retry", NODES) for i in range(6)],
        notice("node-1", step=400),
        world(resumed=300),
        policy(max_attempts=3),
        Retry,
        {"delay_s": 5.0},
        "retry on the same 4 nodes",
    ),
    (
        "notice-before-any-progress-spends",
        before("node_lost", "node_lost"),
        notice("node-1", step=300),
        world(resumed=300),
        policy(max_attempts=3),
        GiveUp,
        {},
        "attempt budget of 3 exhausted: preempted",
    ),
    (
        "notices-that-made-no-progress-run-out",
        [AttemptRecord(i + 1, "preempted", "retry", NODES, progressed=False) for i in range(2)],
        notice("node-1", step=None),
        world(),
        policy(max_attempts=3),
        GiveUp,
        {},
        "attempt budget of 3 exhausted",
    ),
]


@pytest.mark.parametrize("history,failure,situation,spec,kind,fields,reason", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_decide(history, failure, situation, spec, kind, fields, reason) -> None:
    decision = decide(history, failure, situation, spec)
    assert type(decision) is kind, decision
    assert {f: getattr(decision, f) for f in fields} == fields, decision
    assert reason in decision.reason
    assert "\n" not in decision.reason
    assert decision.reason.count("not in place") <= 1


def test_a_scaled_down_world_keeps_the_global_batch() -> None:
    for count, global_batch in ((4, 12), (4, 16), (8, 24), (6, 30), (5, 60)):
        s = world(count, global_batch=global_batch, micro=global_batch // count)
        d = decide([], failed("node_lost", "node-0"), s, policy())
        assert isinstance(d, ScaleDown) and "node-0" not in d.nodes
        ranks = len(d.nodes) * s.procs_per_node
        assert global_batch % (ranks * d.micro_batch) == 0 and d.micro_batch <= s.micro_batch


@pytest.mark.parametrize("global_batch,ranks,at_most,expected", [
    (12, 3, 3, 2), (12, 4, 3, 3), (16, 3, 4, None), (60, 2, 7, 6), (12, 12, 5, 1), (7, 2, 4, None), (12, 0, 1, None),
])  # fmt: skip
def test_fitting_micro_batch(global_batch: int, ranks: int, at_most: int, expected: int | None) -> None:
    assert fitting_micro_batch(global_batch, ranks, at_most) == expected


def test_decisions_name_their_action() -> None:
    decisions = (
        Retry(1, "r"),
        ScaleDown(NODES, 1, "r", 1),
        Rollback(0, 1, "r"),
        GiveUp("r"),
        Regroup(NODES, [], [], 1, "r"),
    )
    assert [d.action for d in decisions] == [
        "retry",
        "scale_down",
        "rollback",
        "fail",
        "regroup",
    ]


# The batch claim: "kept" only where the script applies the settings (its batch_followed event); else unknown
# (trainyard cannot see into the script: never "does not read"), what a script that keeps its own per-rank batch
# trains with, and the fix.
NOT_READ = "global batch unknown: the script has not confirmed it read TRAINYARD_GLOBAL_BATCH/TRAINYARD_MICRO_BATCH"
FIX = "call trainyard.runtime.follow_batch()"


@pytest.mark.parametrize(
    ("failure", "situation", "says", "never"),
    [
        (failed("node_lost", "node-1"), world(2, global_batch=16, micro=4),
         "scale down 2 -> 1 nodes, micro-batch 4 x 4 accumulation, global batch 16 kept", NOT_READ),
        (failed("node_lost", "node-1"), world(2, global_batch=16, micro=4, followed=False),
         f"scale down 2 -> 1 nodes, {NOT_READ} (no batch_followed event); if it keeps its own per-rank batch,"
         " the global batch changes from 16 to 8", "does not read"),
        (failed("node_lost", "node-1"), world(4, global_batch=12, micro=3, followed=False),
         "the global batch changes from 12 to 9", "kept"),
        (failed("oom", "node-0"), world(2, global_batch=16, micro=4, followed=False),
         f"retry with micro-batch 4 -> 2 ({NOT_READ}", "global batch 16 kept"),
    ],
)  # fmt: skip
def test_a_decision_says_the_global_batch_is_kept_only_where_the_script_applies_it(
    failure: Classified, situation: Situation, says: str, never: str
) -> None:
    decision = decide([], failure, situation, policy(in_place=False))
    assert says in decision.reason
    assert never not in decision.reason
    if not situation.batch_followed:
        assert FIX in decision.reason
