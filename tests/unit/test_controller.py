"""The training controller as tables: the ledger folded into a state, and every transition of a train task.

Each row is (ledger so far, observation) -> commands, the way ``test_policy`` tests decisions. The
ledger rows are the events the drivers record; the controller sees nothing else, so a row is also
what a retried task (a new process) would see.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from trainyard.events.ledger import Ledger
from trainyard.recovery.classify import Failure, NodeFailure
from trainyard.recovery.commands import (
    AttemptResult,
    Cancel,
    Command,
    ExcludeNodes,
    Fail,
    Finish,
    KillNodes,
    Launch,
    Publish,
    Record,
    RollBack,
    StartNodes,
    WaitUntil,
    Watch,
)
from trainyard.recovery.controller import step
from trainyard.recovery.observations import (
    AttemptFailed,
    AttemptSucceeded,
    BackoffOver,
    Beatless,
    Checkpoints,
    Context,
    Hang,
    LeaseLost,
    LostSight,
    SparesReady,
    TaskStarted,
    Timeout,
)
from trainyard.recovery.state import Course, TrainState
from trainyard.spec import RecoverySpec

NODES = ["n0", "n1", "n2"]
T0 = 1000.0


def ev(event: str, ts: float = T0, stage: str = "train", **fields: Any) -> dict[str, Any]:
    return {"ts": ts, "stage": stage, "event": event, **fields}


def start(attempt: int, nodes: list[str] = NODES, micro: int = 2, resume: str = "none", ts: float = T0) -> dict:
    return ev("attempt_start", ts, attempt=attempt, nodes=nodes, world_size=len(nodes), micro_batch=str(micro),
              resume_from=resume)  # fmt: skip


def end(attempt: int, state: str = "failed", ts: float = T0 + 50, **fields: Any) -> dict:
    return ev("attempt_end", ts, attempt=attempt, state=state, **fields)


def decision(attempt: int, action: str, kind: str, ts: float = T0 + 51, **fields: Any) -> dict:
    return ev("decision", ts, attempt=attempt, kind=kind, action=action, nodes=NODES, reason="r", **fields)


RESUME = ev("resume_point", T0 - 10, resume_from="none", start_step=0)


def ctx(spares: list[str] = (), max_attempts: int = 3, backoff_s: float = 5.0, reattach: bool = True,
        elastic: bool = False, rejoin: bool = True) -> Context:  # fmt: skip
    return Context(
        recovery=RecoverySpec(max_attempts=max_attempts, backoff_s=backoff_s, in_place=elastic, rejoin=rejoin),
        nodes=list(NODES),
        spares=list(spares),
        micro_batch=2,
        global_batch=12,
        min_nodes=2,
        procs_per_node=1,
        reattach=reattach,
        elastic=elastic,
    )


def node(name: str, exit_code: int | None = 1, log: str = "", reason: str = "", state: str = "failed") -> NodeFailure:
    return NodeFailure(name, state, exit_code, reason, log)


def ok(name: str) -> NodeFailure:
    return NodeFailure(name, "running", None, "", "")


def rank_raised(rank: int, *lines: str) -> str:
    body = ["Traceback (most recent call last):", '  File "/opt/train.py", line 4, in <module>', *lines]
    return "\n".join(f"[rank{rank}]: {line}" for line in body)


CONNECTION = rank_raised(1, "RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection reset by peer")
NAN = rank_raised(1, "trainyard.errors.TrainingFailed: loss is nan at step 13")
USER = rank_raised(0, "RuntimeError: drill: exception in user code at step 12")


def failed(nodes: list[NodeFailure], trigger: str = "crash", stale: list[str] = (), last_step: int = 12,
           valid: list[int] = (5, 10), at: float = T0 + 50, reason: str = "n1 exited 1") -> AttemptFailed:  # fmt: skip
    failure = Failure(1, trigger, nodes, list(stale), last_step)
    return AttemptFailed(1, at, failure, reason, Checkpoints(list(valid), max(valid, default=None)))


COURSE = Course(NODES, 2, "none")


def records(commands: list[Command]) -> dict[str, dict[str, Any]]:
    return {c.event: c.fields for c in commands if isinstance(c, Record)}


def others(commands: list[Command]) -> list[Command]:
    return [c for c in commands if not isinstance(c, Record)]


# ---------------------------------------------------------------- fold


def test_fold_reads_the_attempts_decisions_and_spares_from_the_ledger() -> None:
    events = [
        ev("stage_start", T0 - 20, stage="train"),
        ev("stage_start", T0 - 30, stage="burn_in"),  # other stages are not the train task's
        RESUME,
        ev("resume_point", T0, resume_from="/elsewhere", start_step=99),  # decided once: the first holds
        start(1),
        ev("step", T0 + 1, step=3, loss=2.0),  # the workload's events pass by
        end(1, last_step=12, trigger="crash"),
        ev("failure_classified", T0 + 50, attempt=1, kind="node_lost", evidence="e", culprits=["n1"], step=12),
        decision(1, "scale_down", "node_lost", delay_s=5.0, micro_batch=2, new_nodes=["n0", "n2", "s0"]),
    ]
    state = TrainState.of(events)
    assert (state.resume_from, state.start_step, state.target_step(20)) == ("none", 0, 20)
    assert state.stage_start == T0 - 20
    [attempt] = state.attempts
    assert attempt.course == Course(NODES, 2, "none") and attempt.started == T0 and attempt.state == "failed"
    assert attempt.last_step == 12 and attempt.classified is not None and attempt.classified.culprits == ["n1"]
    assert attempt.decided is not None and attempt.decided.new_nodes == ("n0", "n2", "s0")
    assert [(h.attempt, h.kind, h.decision) for h in state.history] == [(1, "node_lost", "scale_down")]
    assert not state.unfinished and state.spares_left(["s0", "s1"]) == ["s1"]  # s0 was taken by the decision
    assert [f.kind for f in state.failures] == ["node_lost"]


def test_folding_later_events_onto_a_state_equals_folding_them_all() -> None:
    events = [RESUME, start(1), end(1), decision(1, "retry", "transient", delay_s=5.0), start(2, ts=T0 + 60)]
    for cut in range(len(events) + 1):
        assert TrainState.of(events[:cut]).fold(events[cut:]) == TrainState.of(events)


def test_the_ledger_hands_out_only_the_events_after_a_position(tmp_path) -> None:
    ledger = Ledger.in_dir(tmp_path)
    ledger.append("train", "resume_point", resume_from="none", start_step=0)
    first, pos = ledger.events_since(0)
    ledger.append("train", "attempt_start", attempt=1, nodes=NODES, micro_batch=2, resume_from="none")
    later, pos2 = ledger.events_since(pos)
    assert [e["event"] for e in first] == ["resume_point"] and pos == 1
    assert [e["event"] for e in later] == ["attempt_start"] and pos2 == 2
    assert ledger.events_since(pos2) == ([], 2)
    assert TrainState.of(first).fold(later) == TrainState.of(ledger.events())


# ---------------------------------------------------------------- one attempt's news


def test_the_first_wake_launches_attempt_one_from_the_runs_resume_point() -> None:
    state = TrainState.of([RESUME])
    assert step(state, TaskStarted(T0), ctx()) == [Launch(1, COURSE), Watch(1, COURSE)]


def test_success_ends_the_attempt_and_finishes() -> None:
    state = TrainState.of([RESUME, start(1)])
    commands = step(state, AttemptSucceeded(1, T0 + 30, last_step=20), ctx())
    assert others(commands) == [Cancel(1, COURSE), Finish(AttemptResult(1, 30.0, 20))]
    assert records(commands)["attempt_end"] == {"attempt": 1, "state": "succeeded", "seconds": 30.0, "last_step": 20}


def test_a_wake_without_news_watches_on_and_a_lost_cluster_is_a_transient_error() -> None:
    state = TrainState.of([RESUME, start(1)])
    assert step(state, Timeout(1, T0 + 5), ctx()) == [Watch(1, COURSE)]
    [fail] = step(state, LostSight(1, T0 + 5, "Kubernetes API: 503"), ctx())
    assert isinstance(fail, Fail) and fail.kind == "lost_sight" and "503" in fail.reason


# Every failure the two loops handled: (id, observation, ctx, action, some of the decision's fields,
# what else the step does besides recording).
FAILURES = [
    (
        "crash, connection reset: retry on the same nodes after the backoff",
        failed([node("n1", log=CONNECTION), ok("n0"), ok("n2")]),
        ctx(),
        "retry",
        {"delay_s": 5.0},
        [WaitUntil(T0 + 55)],
    ),
    (
        "hang with a silent node: scale down without it, and mark it",
        failed([ok("n0"), ok("n1"), ok("n2")], trigger="hang", stale=["n2"], reason="no progress"),
        ctx(),
        "scale_down",
        {"new_nodes": ["n0", "n1"]},
        [ExcludeNodes(1, ["n2"], "hang"), WaitUntil(T0 + 55)],
    ),
    (
        "hang seen by a trigger without node evidence, no silent node: retry",
        Hang(1, T0 + 50, [], "no progress for 6 s", Checkpoints([5, 10], 10)),
        ctx(),
        "retry",
        {"delay_s": 5.0},
        [WaitUntil(T0 + 55)],
    ),
    (
        "OOM: retry with half the micro-batch",
        failed([node("n1", exit_code=137, reason="OOMKilled"), ok("n0"), ok("n2")]),
        ctx(),
        "retry",
        {"micro_batch": 1},
        [WaitUntil(T0 + 55)],
    ),
    (
        "node lost: scale down to two, mark it",
        failed([node("n1", exit_code=-9), ok("n0"), ok("n2")]),
        ctx(),
        "scale_down",
        {"new_nodes": ["n0", "n2"]},
        [ExcludeNodes(1, ["n1"], "node_lost"), WaitUntil(T0 + 55)],
    ),
    (
        "node lost with a spare: the spare replaces it",
        failed([node("n1", exit_code=-9), ok("n0"), ok("n2")]),
        ctx(spares=["s0"]),
        "scale_down",
        {"new_nodes": ["n0", "n2", "s0"]},
        [ExcludeNodes(1, ["n1"], "node_lost"), WaitUntil(T0 + 55)],
    ),
    (
        "divergence: roll back to the newest valid checkpoint below it",
        failed([node("n1", log=NAN), ok("n0"), ok("n2")], valid=[5, 10, 15]),
        ctx(),
        "rollback",
        {"to_step": 10},
        [RollBack(10), WaitUntil(T0 + 55)],
    ),
    (
        "no backoff: the wait is already over",
        failed([node("n1", log=CONNECTION), ok("n0"), ok("n2")]),
        ctx(backoff_s=0),
        "retry",
        {"delay_s": 0.0},
        [WaitUntil(T0 + 50)],
    ),
]


@pytest.mark.parametrize("seen,context,action,fields,then", [f[1:] for f in FAILURES], ids=[f[0] for f in FAILURES])
def test_a_failure_ends_the_attempt_records_and_carries_the_decision_out(
    seen: AttemptFailed | Hang, context: Context, action: str, fields: dict[str, Any], then: list[Command]
) -> None:
    state = TrainState.of([RESUME, start(1)])
    commands = step(state, seen, context)
    assert commands[0] == Cancel(1, COURSE)  # survivors end before anything else happens
    assert [c.event for c in commands if isinstance(c, Record)] == ["attempt_end", "failure_classified", "decision"]
    decided = records(commands)["decision"]
    assert decided["action"] == action and {k: decided.get(k) for k in fields} == fields
    assert others(commands)[1:] == then


def test_the_next_attempt_runs_with_what_was_decided() -> None:
    """The recorded decision, folded back, is the next attempt's course: the controller keeps nothing else."""
    cases = [
        (decision(1, "retry", "oom", delay_s=5.0, micro_batch=1), [], Course(NODES, 1, "latest")),
        (decision(1, "scale_down", "node_lost", delay_s=5.0, micro_batch=2, new_nodes=["n0", "n2"]), [],
         Course(["n0", "n2"], 2, "latest")),
        (decision(1, "rollback", "diverged", delay_s=5.0, to_step=10), [ev("rolled_back", T0 + 52, to_step=10,
         path="/ckpt/step_000010")], Course(NODES, 2, "/ckpt/step_000010")),
        (decision(1, "rollback", "diverged", delay_s=5.0, to_step=0), [ev("rolled_back", T0 + 52, to_step=0,
         path=None)], Course(NODES, 2, "none")),
    ]  # fmt: skip
    for decided, after, course in cases:
        state = TrainState.of([RESUME, start(1), end(1), decided, *after])
        assert step(state, BackoffOver(T0 + 51 + 4.9), ctx()) == [WaitUntil(T0 + 56)]  # not yet
        assert step(state, BackoffOver(T0 + 56), ctx()) == [Launch(2, course), Watch(2, course)]


def test_a_failed_decision_recorded_is_folded_into_the_policy_history() -> None:
    """The attempt budget counts the decisions in the ledger: the third failure of three attempts fails."""
    state = TrainState.of(
        [RESUME, start(1), end(1), decision(1, "retry", "transient", delay_s=5), start(2), end(2),
         decision(2, "retry", "transient", delay_s=10), start(3, ts=T0 + 100)]
    )  # fmt: skip
    seen = failed([node("n1", log=CONNECTION), ok("n0"), ok("n2")])
    seen = AttemptFailed(3, T0 + 150, seen.failure, seen.reason, seen.checkpoints)
    commands = step(state, seen, ctx(max_attempts=3))
    assert records(commands)["decision"]["action"] == "fail"
    fail = commands[-1]
    assert isinstance(fail, Fail) and "budget of 3 exhausted" in fail.reason and fail.kind == "transient"


def test_user_error_fails_fast_with_the_log_as_evidence() -> None:
    state = TrainState.of([RESUME, start(1)])
    commands = step(state, failed([node("n0", log=USER), ok("n1"), ok("n2")]), ctx())
    fail = commands[-1]
    assert isinstance(fail, Fail) and fail.kind == "user_error"
    assert "drill: exception in user code at step 12" in fail.evidence and "--- n0" in fail.evidence
    assert not any(isinstance(c, (WaitUntil, Launch, RollBack, ExcludeNodes)) for c in commands)


# ---------------------------------------------------------------- a new task process (retry, resumed deferral)


RETRIED = [
    ("nothing yet: attempt one", [RESUME], True, T0, [Launch(1, COURSE), Watch(1, COURSE)]),
    ("an unfinished attempt is watched again", [RESUME, start(1)], True, T0, [Watch(1, COURSE)]),
    (
        "an unfinished local attempt died with its task: the next one resumes from its checkpoints",
        [RESUME, start(1)],
        False,
        T0,
        [Launch(2, Course(NODES, 2, "latest")), Watch(2, Course(NODES, 2, "latest"))],
    ),
    (
        "a finished attempt: the run is done",
        [RESUME, start(1), end(1, "succeeded", seconds=40.0, last_step=20)],
        True,
        T0 + 60,
        [Finish(AttemptResult(1, 40.0, 20))],
    ),
    (
        "a backoff still due is waited out from the decision's time",
        [RESUME, start(1), end(1), decision(1, "retry", "transient", delay_s=30.0)],
        True,
        T0 + 60,
        [WaitUntil(T0 + 81)],
    ),
    (
        "a backoff over: the next attempt",
        [RESUME, start(1), end(1), decision(1, "retry", "transient", delay_s=5.0)],
        True,
        T0 + 60,
        [Launch(2, Course(NODES, 2, "latest")), Watch(2, Course(NODES, 2, "latest"))],
    ),
    (
        "a rollback decided but not carried out is carried out",
        [RESUME, start(1), end(1), decision(1, "rollback", "diverged", delay_s=5.0, to_step=10)],
        True,
        T0 + 60,
        [RollBack(10), WaitUntil(T0 + 56)],
    ),
    (
        "the task died before deciding: one more attempt on the same course",
        [RESUME, start(1), end(1)],
        True,
        T0 + 60,
        [Launch(2, Course(NODES, 2, "latest")), Watch(2, Course(NODES, 2, "latest"))],
    ),
]


@pytest.mark.parametrize("events,reattach,now,expected", [r[1:] for r in RETRIED], ids=[r[0] for r in RETRIED])
def test_a_new_task_process_carries_on_from_the_ledger(
    events: list[dict], reattach: bool, now: float, expected: list[Command]
) -> None:
    assert step(TrainState.of(events), TaskStarted(now), ctx(reattach=reattach)) == expected


def test_news_of_an_attempt_that_is_over_is_answered_from_the_ledger() -> None:
    state = TrainState.of([RESUME, start(1), end(1), decision(1, "retry", "transient", delay_s=1.0), start(2)])
    course = Course(NODES, 2, "none")
    assert step(state, AttemptSucceeded(1, T0 + 70), ctx()) == [Watch(2, course)]
    assert step(state, Timeout(1, T0 + 70), ctx()) == [Watch(2, course)]


@pytest.mark.parametrize(
    "events,expected",
    [
        ([RESUME, start(1)], [Cancel(1, COURSE), Fail("another run holds it", "lease_lost")]),
        ([RESUME, start(1), end(1, "succeeded")], [Fail("another run holds it", "lease_lost")]),
        ([], [Fail("another run holds it", "lease_lost")]),
    ],
    ids=["its running attempt ends", "nothing running", "before any attempt"],
)
def test_a_lost_lease_ends_the_attempt_and_the_task(events: list[dict], expected: list[Command]) -> None:
    assert step(TrainState.of(events), LeaseLost(T0 + 5, "another run holds it"), ctx()) == expected


# ---------------------------------------------------------------- in place


def test_an_elastic_attempt_regroups_in_place_and_runs_on() -> None:
    """No cancel and no attempt_end: the dead node is killed, generation 2 published, the same attempt watched."""
    state = TrainState.of([RESUME, start(1)])
    seen = failed([node("n1", exit_code=-9), ok("n0"), ok("n2")])
    commands = step(state, seen, ctx(elastic=True))
    assert [c.event for c in commands if isinstance(c, Record)] == ["failure_classified", "decision", "rejoining"]
    decided = records(commands)["decision"]
    assert decided["action"] == "regroup" and decided["path"] == "in_place" and decided["generation"] == 2
    assert decided["new_nodes"] == ["n0", "n2"] and decided["left_out"] == ["n1"]
    course = Course(["n0", "n2"], 2, "none")
    # The dead process's node is started again outside the group: it may rejoin once it waits ready.
    assert others(commands) == [
        KillNodes(1, ["n1"]), Publish(1, 2, ["n0", "n2"], 2, []), StartNodes(1, ["n1"], 2), Watch(1, course)
    ]  # fmt: skip
    # Folded back, the ledger says the attempt runs on, with the new group.
    after = state.fold([ev(c.event, T0 + 51, **c.fields) for c in commands if isinstance(c, Record)])
    assert after.unfinished and after.last.course == course and after.last.generation == 2
    assert after.last.regroups == (("node_lost", 12),)


def test_an_attempt_whose_ranks_never_grouped_relaunches_and_says_why() -> None:
    """A script that does not train through the elastic group runs on the store's launch as a fixed world:
    its failure is relaunched, with the reason in the decision and in the run's recovery_path."""
    state = TrainState.of([RESUME, start(1)])
    seen = replace(failed([node("n1", exit_code=-9), ok("n0"), ok("n2")]), ungrouped="its ranks never formed a group")
    commands = step(state, seen, ctx(elastic=True))
    decided = records(commands)["decision"]
    assert decided["action"] == "scale_down" and "path" not in decided  # as without the store: n1 is dead
    assert decided["reason"].endswith("; relaunch, not in place: its ranks never formed a group")
    assert records(commands)["recovery_path"] == {"in_place": False, "why_not": "its ranks never formed a group"}
    assert commands[0] == Cancel(1, COURSE) and not [c for c in commands if isinstance(c, Publish | KillNodes)]
    # Not elastic at all: nothing to say beyond what the stage said at its start.
    assert "recovery_path" not in records(step(state, seen, ctx()))


def test_a_spare_joins_the_group_in_place() -> None:
    state = TrainState.of([RESUME, start(1)])
    commands = step(state, failed([node("n1", exit_code=-9), ok("n0"), ok("n2")]), ctx(spares=["s0"], elastic=True))
    assert others(commands)[1] == Publish(1, 2, ["n0", "n2", "s0"], 2, ["s0"])


def test_no_progress_since_the_regroup_relaunches_and_regroups_are_not_attempts() -> None:
    """The same kind again at the regroup's step is not healed in place; a regroup spends no attempt."""
    state = TrainState.of(
        [RESUME, start(1), ev("failure_classified", T0 + 20, attempt=1, kind="node_lost", step=12),
         decision(1, "regroup", "node_lost", ts=T0 + 21, new_nodes=["n0", "n2"], micro_batch=2)]
    )  # fmt: skip
    again = step(state, failed([node("n2", exit_code=-9), ok("n0")]), ctx(elastic=True, max_attempts=2))
    decided = records(again)["decision"]
    assert decided["action"] == "fail" and "cannot scale down" in decided["reason"]  # one node < nodes.min 2
    assert again[0] == Cancel(1, Course(["n0", "n2"], 2, "none"))
    # A flaky collective both survived (their processes run): in place again, not "budget of 2 exhausted"
    flaky = [node("n2", exit_code=None, log=CONNECTION, state="running"), ok("n0")]
    later = step(state, failed(flaky, last_step=30), ctx(elastic=True, max_attempts=2))
    assert records(later)["decision"]["action"] == "regroup"
    assert others(later)[1] == Publish(1, 3, ["n0", "n2"], 2, [])


def test_a_node_left_out_is_started_again_only_for_a_dead_process_and_when_the_spec_allows() -> None:
    state = TrainState.of([RESUME, start(1)])
    off = step(state, failed([node("n1", exit_code=-9), ok("n0"), ok("n2")]), ctx(elastic=True, rejoin=False))
    assert not [c for c in off if isinstance(c, StartNodes)] and "rejoining" not in records(off)
    hung = failed([ok("n0"), ok("n1"), ok("n2")], trigger="hang", stale=["n2"], reason="no progress")
    commands = step(state, hung, ctx(elastic=True))
    assert records(commands)["decision"]["action"] == "regroup"
    assert not [c for c in commands if isinstance(c, StartNodes)]  # a hung node waits for the pressure test


def test_an_elastic_attempt_starts_the_unused_spares_warm() -> None:
    commands = step(TrainState.of([RESUME]), TaskStarted(T0), ctx(spares=["s0", "s1"], elastic=True))
    assert commands[0] == Launch(1, Course(NODES, 2, "none"), ["s0", "s1"])
    assert records(commands)["spares_warm"] == {"attempt": 1, "nodes": ["s0", "s1"]}
    assert step(TrainState.of([RESUME]), TaskStarted(T0), ctx(spares=["s0"]))[0] == Launch(1, Course(NODES, 2, "none"))


def test_ready_nodes_grow_the_world_back_in_place_with_the_global_batch_kept() -> None:
    """3 -> 2 in place, then the restarted n1 waits ready: generation 3 has the three nodes, micro-batch 2 again."""
    regrouped = [RESUME, start(1), ev("failure_classified", T0 + 20, attempt=1, kind="node_lost", step=12),
                 decision(1, "regroup", "node_lost", ts=T0 + 21, new_nodes=["n0", "n2"], micro_batch=3)]  # fmt: skip
    state = TrainState.of(regrouped)
    assert state.last.course == Course(["n0", "n2"], 3, "none") and state.last.generation == 2
    commands = step(state, SparesReady(1, T0 + 40, ["n1"]), ctx(elastic=True))
    grown = records(commands)["grown"]
    assert grown == {"attempt": 1, "generation": 3, "nodes": ["n0", "n2", "n1"], "joiners": ["n1"],
                     "micro_batch": 2, "world_size": 3}  # fmt: skip
    course = Course(["n0", "n2", "n1"], 2, "none")
    assert others(commands) == [Publish(1, 3, ["n0", "n2", "n1"], 2, ["n1"]), Watch(1, course)]
    after = state.fold([ev(c.event, T0 + 41, **c.fields) for c in commands if isinstance(c, Record)])
    assert after.last.course == course and after.last.generation == 3 and after.last.regrouped_at == T0 + 41
    assert after.history == state.history  # growing is no decision about a failure: no attempt spent
    # At the first attempt's size already: nothing to grow, the attempt is watched on.
    assert step(after, SparesReady(1, T0 + 50, ["s0"]), ctx(elastic=True)) == [Watch(1, course)]


# ---------------------------------------------------------------- a script that writes no heartbeats

QUIET = Beatless(1, T0 + 130, "no heartbeat from any rank 120 s after the start")


@pytest.mark.parametrize(
    ("ledger", "said"),
    [
        ([RESUME, start(1)], True),  # first time in the run: said, with the fix
        ([RESUME, start(1), ev("hang_detection_off", T0 + 130, attempt=1, reason="r")], False),  # said already
        (
            [
                RESUME,
                start(1),
                end(1),
                decision(1, "retry", "node_lost"),
                start(2),
                ev("hang_detection_off", T0 + 2, attempt=1, reason="r"),
            ],
            False,
        ),  # once a run, not once an attempt
    ],
)
def test_a_script_without_heartbeats_is_not_hung_and_the_run_says_so_once(ledger: list[dict], said: bool) -> None:
    state = TrainState.of(ledger)
    seen = replace(QUIET, attempt=state.last.number)
    commands = step(state, seen, ctx())
    assert others(commands) == [Watch(state.last.number, state.last.course)]  # it runs on: no failure, no cancel
    off = records(commands).get("hang_detection_off")
    assert (off is not None) is said
    if off:
        assert "writes no heartbeats" in off["reason"] and "trainyard.runtime.heartbeat(step, metrics)" in off["fix"]
        assert "trainyard.runtime.hf.TrainyardCallback" in off["fix"]
        assert "trainyard.runtime.lightning.TrainyardCallback" in off["fix"]
        [line] = [c.log for c in commands if isinstance(c, Record)]
        assert "hang detection is off" in line and "trainyard.runtime.heartbeat(step, metrics)" in line
    assert TrainState.of([*ledger, *[{"ts": T0, "stage": "train", "event": c.event, **c.fields}
                                     for c in commands if isinstance(c, Record)]]).run.hang_detection_off  # fmt: skip


def test_the_scale_down_says_the_global_batch_is_kept_only_where_the_script_said_it_follows_it() -> None:
    lost = failed([node("n1", exit_code=-9), ok("n0"), ok("n2")])
    state = TrainState.of([RESUME, start(1)])
    bare = records(step(state, lost, ctx()))["decision"]
    assert bare["action"] == "scale_down" and "global batch changes from 12 to 8" in bare["reason"]
    assert "trainyard.runtime.follow_batch()" in bare["reason"]
    said = records(step(state, replace(lost, batch_followed=True), ctx()))["decision"]
    assert "global batch 12 kept" in said["reason"] and "follow_batch" not in said["reason"]
