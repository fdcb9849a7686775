"""The one fold: an attempt healed in place twice keeps both faults, each with its decision, and its growth."""

from __future__ import annotations

from typing import Any

from trainyard.events.fold import TrainRun, fold
from trainyard.recovery.state import TrainState
from trainyard.report.faults import attempt_lines
from trainyard.report.summary import attempt_table

NODES = ["node-0", "node-1", "node-2"]


def ev(ts: float, event: str, stage: str = "train", **fields: Any) -> dict[str, Any]:
    return {"ts": ts, "stage": stage, "event": event, **fields}


HEALED_TWICE = [
    ev(0, "stage_start"),
    ev(1, "resume_point", resume_from="none", start_step=0),
    ev(2, "attempt_start", attempt=1, nodes=NODES, world_size=3, micro_batch=2, resume_from="none"),
    ev(3, "spares_warm", attempt=1, nodes=["node-3"]),
    ev(10, "failure_classified", attempt=1, kind="node_lost", culprits=["node-0"], step=30, detected_at=9.5),
    ev(10.1, "decision", attempt=1, kind="node_lost", action="regroup", path="in_place", nodes=NODES,
       new_nodes=["node-1", "node-2", "node-3"], joiners=["node-3"], left_out=["node-0"], micro_batch=2, generation=2),
    ev(10.2, "rejoining", attempt=1, nodes=["node-0"]),
    ev(11, "regrouped", attempt=1, world_size=3, generation=2, from_step=30, joiners=["node-3"]),
    ev(20, "failure_classified", attempt=1, kind="hang", culprits=["node-1"], step=70, detected_at=19),
    ev(20.1, "decision", attempt=1, kind="hang", action="regroup", path="in_place", nodes=["node-1", "node-2", "node-3"],
       new_nodes=["node-2", "node-3"], joiners=[], left_out=["node-1"], micro_batch=2, generation=3),
    ev(21, "regrouped", attempt=1, world_size=2, generation=3, from_step=70, joiners=[]),
    ev(25, "grown", attempt=1, generation=4, nodes=["node-2", "node-3", "node-0"], joiners=["node-0"], micro_batch=2,
       world_size=3),
    ev(26, "regrouped", attempt=1, world_size=3, generation=4, from_step=75, joiners=["node-0"]),
    ev(40, "attempt_end", attempt=1, state="succeeded", seconds=38.0, last_step=100),
    ev(41, "stage_end", seconds=41.0),
]  # fmt: skip


def test_every_fault_and_decision_of_an_attempt_is_kept() -> None:
    train = fold(HEALED_TWICE).train
    [attempt] = train.attempts
    assert [
        (f.failure.kind, f.decision.generation, f.decision.joiners) for f in attempt.faults if f.failure and f.decision
    ] == [
        ("node_lost", 2, ("node-3",)),
        ("hang", 3, ()),
    ]
    assert attempt.generation == 4 and attempt.nodes == ("node-2", "node-3", "node-0") and attempt.decided is None
    assert train.world_path == "3 -> 3 -> 2 -> 3" and train.joined == ("node-3", "node-0") and train.waiting == ()


def test_the_report_rows_say_every_fault_in_order() -> None:
    [row] = attempt_table(fold(HEALED_TWICE).train)
    assert attempt_lines(row) == [
        "node_lost on node-0 -> regroup in place, generation 2, joined by node-3",
        "hang on node-1 -> regroup in place, generation 3",
        "grown in place, generation 4, joined by node-0 (3 nodes)",
    ]
    assert row["failure"]["kind"] == "hang" and row["decision"]["generation"] == 3  # the last, for the chart


def test_the_controller_state_is_the_same_fold_folded_in_pieces() -> None:
    whole = TrainState.of(HEALED_TWICE)
    for cut in range(len(HEALED_TWICE)):
        assert TrainState.of(HEALED_TWICE[:cut]).fold(HEALED_TWICE[cut:]) == whole
    assert whole.run == TrainRun.of(HEALED_TWICE)
    assert whole.last is not None and whole.last.regroups == (("node_lost", 30), ("hang", 70)) and whole.last.grown == 1
