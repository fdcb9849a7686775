"""The one fold: an attempt healed in place twice keeps both faults, each with its decision, and its growth."""

from __future__ import annotations

from typing import Any

import pytest

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
    assert (
        whole.last is not None
        and whole.last.regroups == (("node_lost", 30), ("hang", 70))
        and len(whole.last.run.growths) == 1
    )


# ---------------------------------------------------------------- the rest of the run: one fold for every reader

WHOLE_RUN = [
    ev(0, "stage_start", stage="burn_in"),
    ev(1, "node_verdict", stage="burn_in", node="node-0", figures={"membw_gbps": 10.0}, verdict="healthy"),
    ev(2, "node_verdict", stage="burn_in", node="node-1", figures={"membw_gbps": 2.0}, verdict="evicted",
       reason="membw_gbps 0.2 x node-0 < 0.90"),
    # A ledger from before the confirmation round names the reference figures "medians".
    ev(3, "thresholds", stage="burn_in", thresholds={"membw_gbps": 9.0}, medians={"membw_gbps": 10.0}, seconds=2.5),
    ev(4, "stage_end", stage="burn_in", seconds=4.0, result={"healthy": ["node-0"]}),
    ev(5, "stage_start"),
    ev(6, "attempt_start", attempt=1, nodes=["node-0"], world_size=1, micro_batch=2, resume_from="none"),
    ev(7, "drills_acted", attempt=1, faults=["kill"]),
    ev(8, "batch_followed", attempt=1, global_batch=8),
    ev(9, "resumed", attempt=1, step=0),
    ev(10, "step", attempt=1, step=1, loss=3.0),
    ev(11, "drill_fired", attempt=1, fault="kill", node="node-0", step=1),
    ev(12, "step", attempt=1, step=2, loss=2.5),
    ev(13, "recovery_figures", detection_s=1.5, ettr=0.5),
    ev(14, "stage_failed", seconds=9.0, error="TrainingFailed", message="attempts spent"),
    ev(15, "stage_start", stage="check_checkpoint"),
    ev(16, "checkpoint_checked", stage="check_checkpoint", path="/ck/step_000002", valid=False, problems=["nan"]),
]  # fmt: skip


def test_the_fold_holds_the_burn_in_with_old_ledgers_read_in_one_place() -> None:
    state = fold(WHOLE_RUN)
    assert state.verdicts["node-1"].verdict == "evicted" and "0.2 x" in str(state.verdicts["node-1"].reason)
    assert state.verdicts["node-0"].figures == {"membw_gbps": 10.0}
    assert state.limits is not None and state.limits.references == {"membw_gbps": 10.0}
    assert state.limits.thresholds == {"membw_gbps": 9.0} and state.limits.seconds == 2.5
    assert state.results["burn_in"] == {"healthy": ["node-0"]}


def test_the_fold_holds_what_the_readers_used_to_filter_from_event_dicts() -> None:
    state = fold(WHOLE_RUN)
    train = state.train
    assert train.drills_acted == {1} and train.batch_followed
    assert [(d.fault, d.step) for d in train.fired] == [("kill", 1)]
    assert [e["step"] for e in train.steps] == [1, 2] and train.resumed_steps == (0,)
    assert train.figures == {"detection_s": 1.5, "ettr": 0.5}  # the figures, not the event's envelope
    assert state.errors["train"].error == "TrainingFailed" and state.errors["train"].message == "attempts spent"
    assert state.gated is not None and state.gated.problems == ("nan",) and not state.gated.valid
    assert (state.started, state.ended) == (0, 16)


def test_the_fold_holds_what_the_benches_used_to_filter_from_event_dicts() -> None:
    """A save's cost and a script's last word are run state: the recovery bench and its peers read them here."""
    state = fold([
        ev(0, "stage_start"),
        ev(1, "checkpoint_saved", path="/c/step_000010", step=10, attempt=1, blocked_s=0.25),
        ev(2, "checkpoint_saved", path="/c/step_000020", step=20, attempt=1),
    ])  # fmt: skip
    assert [(r.step, r.blocked_s) for r in state.checkpoints] == [(10, 0.25), (20, None)]
    assert not state.train.finished
    assert fold([ev(0, "step", step=1), ev(1, "finished", step=1)]).train.finished


def test_the_run_state_is_worked_out_once() -> None:
    state = fold(WHOLE_RUN)
    assert state.state() == "running"  # check_checkpoint is still open
    assert state.state(closing=True) == "failed"  # the report stage ends the run: train failed
    done = fold([ev(0, "stage_start", stage="report"), ev(1, "stage_end", stage="report", seconds=1.0)])
    assert done.state() == "succeeded" and done.state(closing=True) == "succeeded"


def test_a_fired_drill_is_kept_even_when_read_without_its_attempt() -> None:
    """The drill driver reads only ``drill_fired`` events: the fold keeps them without an attempt to hang them on."""
    fired = TrainRun.of(e for e in WHOLE_RUN if e["event"] == "drill_fired").fired
    assert [(d.fault, d.node, d.step) for d in fired] == [("kill", "node-0", 1)]


def test_the_controller_reads_the_folds_records_not_copies() -> None:
    """One class per record: the controller's attempt wraps the fold's, its decision is the fold's own."""
    state = TrainState.of(HEALED_TWICE)
    last, folded = state.last, state.run.last
    assert last is not None and folded is not None and last.run is folded
    assert last.generation == folded.generation == 4  # two regroups and one growth, counted once
    assert state.history[0].kind == "node_lost" and state.history[0].decision == "regroup"


def test_a_failure_kind_the_vocabulary_lacks_is_said_not_decided_on() -> None:
    torn = [*HEALED_TWICE[:4], ev(10, "failure_classified", attempt=1, kind="cosmic_ray", culprits=["node-0"])]
    with pytest.raises(ValueError, match="unknown failure kind 'cosmic_ray'"):
        TrainRun.of(torn)
