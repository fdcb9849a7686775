"""The training controller: what a train task does next, as a pure function of the ledger and one observation.

Two parts, both pure (no I/O, no clock, no Airflow), the way ``recovery.policy`` is:

- ``TrainState.fold(events)`` (``recovery.state``): the ledger's one fold
  (``trainyard.events.fold``) in the controller's terms: "which attempt, on
  which nodes, from which checkpoint, what failed and what was decided". A
  driver keeps the state and folds only the events appended since its last
  look (``Ledger.events_since``).
- ``step(state, observation, ctx) -> list[Command]``: what to do about one
  observation (an attempt succeeded, failed with evidence, a wake-up without
  news, the backoff is over, ...). It calls ``classify`` and ``policy.decide``
  and returns commands for a driver to carry out: record, cancel, roll back,
  exclude nodes, launch; then exactly one of watch, wait until, finish, fail.
  What it is told is in ``recovery.observations``, what it says in ``recovery.commands``.

Two drivers execute the commands: the blocking one (``recovery.supervisor``:
the local backend and tests; it polls and sleeps) and the deferred one
(``recovery.deferred``: the operator defers on the attempt's trigger and on a
time trigger for a backoff). Neither decides anything.

Everything a step needs from earlier steps is in the ledger: a recorded
decision is folded back into the state before the next step, so a retried
task (a new process) carries on exactly where the last one stopped: an
unfinished attempt is watched again where the launcher can re-attach it, a
pending backoff is waited out from the decision's time, a rollback that was
decided but not carried out is carried out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from trainyard.backends.base import NodeStatus
from trainyard.checkpoint.format import step_of
from trainyard.events.schema import (
    AttemptEnd,
    DecisionMade,
    FailureClassified,
    Grown,
    HangDetectionOff,
    RecoveryPath,
    Rejoining,
    SparesWarm,
)
from trainyard.kinds import REJOIN_KINDS as REJOIN_KINDS
from trainyard.protocol.heartbeat import HOW_TO_BEAT
from trainyard.recovery.classify import Classified, Failure, NodeFailure, classify
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
from trainyard.recovery.observations import (
    AttemptFailed,
    AttemptSucceeded,
    BackoffOver,
    Beatless,
    Context,
    Hang,
    LeaseLost,
    LostSight,
    Observation,
    SparesReady,
    TaskStarted,
    Timeout,
)
from trainyard.recovery.policy import (
    Decision,
    GiveUp,
    InPlace,
    Regroup,
    Rollback,
    ScaleDown,
    Situation,
    decide,
    fitting_micro_batch,
)
from trainyard.recovery.state import Attempt, Course, TrainState

# ``REJOIN_KINDS`` (``trainyard.kinds``, the ``rejoins`` trait): failures of a node's process, not of the node.

# ---------------------------------------------------------------- the step


def step(state: TrainState, observation: Observation, ctx: Context) -> list[Command]:
    """What to do about ``observation``, given the ledger's ``state`` (with every earlier command's records)."""
    match observation:
        case TaskStarted(at=now) | BackoffOver(at=now):
            return carry_on(state, ctx, now)
        case LeaseLost(message=message):
            # Its pods would run on without a task process, writing to a lineage another run owns now.
            end: list[Command] = (
                [Cancel(state.last.number, state.last.course)] if state.last and state.unfinished else []
            )
            return [*end, Fail(message, "lease_lost")]
    current = state.last if state.unfinished else None
    if current is None or observation.attempt != current.number:
        return carry_on(state, ctx, observation.at)  # news of an attempt that is over: the ledger says what comes next
    match observation:
        case Timeout():
            return [Watch(current.number, current.course)]
        case Beatless(reason=reason):
            return [*_hang_detection_off(state, current.number, reason), Watch(current.number, current.course)]
        case LostSight(message=message):
            return [Fail(f"lost sight of attempt {current.number}: {message}", "lost_sight")]
        case AttemptSucceeded():
            return _succeeded(current, observation)
        case Hang():
            failure = Failure(current.number, "hang", [], list(observation.suspects))
            seen = AttemptFailed(current.number, observation.at, failure, observation.reason, observation.checkpoints,
                                 observation.ungrouped, observation.batch_followed)  # fmt: skip
            return _failed(state, current, seen, ctx)
        case AttemptFailed():
            return _failed(state, current, observation, ctx)
        case SparesReady(nodes=ready):
            return _grow(current, ctx, ready)
    raise AssertionError(f"unhandled observation {observation!r}")  # pragma: no cover


def carry_on(state: TrainState, ctx: Context, now: float) -> list[Command]:
    """From the ledger alone: the first attempt, the unfinished one, the backoff still due, the next attempt
    or the end. ``now``: the observation's time, against the backoff's deadline (decision time + delay)."""
    last = state.last
    if last is None:
        return _launch(1, Course(list(ctx.nodes), ctx.micro_batch, state.resume_from or "none"), state, ctx)
    if last.state == "running":
        if ctx.reattach:
            return [Watch(last.number, last.course)]
        # A local attempt died with the task process that watched it; the next one resumes from its checkpoints.
        return _launch(last.number + 1, replace(last.course, resume_from="latest"), state, ctx)
    if last.state == "succeeded":
        return [Finish(AttemptResult(last.number, last.seconds or 0.0, last.last_step))]
    decided = last.decided
    if decided is None or decided.action == "fail":
        # No decision recorded (the task died before it) or a run given up on that a person retried:
        # one more attempt on the same course, which the budget counts.
        return _launch(last.number + 1, replace(last.course, resume_from="latest"), state, ctx)
    if decided.action == "rollback" and decided.rolled_back_to is None:
        return [RollBack(decided.to_step or 0), WaitUntil(decided.at + decided.delay_s)]  # decided, then the task died
    if now < decided.at + decided.delay_s:
        return [WaitUntil(decided.at + decided.delay_s)]
    return _launch(last.number + 1, next_course(last), state, ctx)


def next_course(last: Attempt) -> Course:
    """The course after ``last`` by its decision: new nodes and micro-batch, or the rollback's checkpoint."""
    decided = last.decided
    if decided is None:
        return replace(last.course, resume_from="latest")
    resume = decided.rolled_back_to if decided.action == "rollback" and decided.rolled_back_to else "latest"
    return Course(
        list(decided.new_nodes if decided.new_nodes is not None else last.course.nodes),
        decided.micro_batch or last.course.micro_batch,
        resume,
    )


def _launch(attempt: int, course: Course, state: TrainState, ctx: Context) -> list[Command]:
    """Launch and watch; an attempt that regroups in place starts the unused spares with it, warm."""
    warm = [n for n in state.spares_left(ctx.spares) if n not in course.nodes] if ctx.elastic else []
    started = [Record.of(SparesWarm(attempt=attempt, nodes=warm))] if warm else []
    return [Launch(attempt, course, warm), *started, Watch(attempt, course)]


def grown_world(current: Attempt, ctx: Context, ready: Iterable[str]) -> tuple[list[str], int] | None:
    """The group grown by ``ready`` nodes, up to the first attempt's size, the global batch kept: its
    nodes (the members first, in their ranks) and micro-batch; None when no larger world fits."""
    nodes = list(current.course.nodes)
    fresh = [n for n in ready if n not in nodes]
    for world in range(min(len(ctx.nodes), len(nodes) + len(fresh)), len(nodes), -1):
        micro = fitting_micro_batch(ctx.global_batch, world * ctx.procs_per_node, ctx.micro_batch)
        if micro is not None:
            return nodes + fresh[: world - len(nodes)], micro
    return None


def _hang_detection_off(state: TrainState, attempt: int, seen: str) -> list[Command]:
    """Say once a run that the script writes no heartbeats, so nothing is called hung, and how to change that."""
    if state.run.hang_detection_off is not None:
        return []
    off = HangDetectionOff(
        attempt=attempt, reason=f"the training script writes no heartbeats ({seen})", fix=HOW_TO_BEAT
    )
    said = (f"attempt {attempt}: hang detection is off: {off.reason}; a stuck rank is noticed only when a process"
            f" exits. To turn it on, {HOW_TO_BEAT}")  # fmt: skip
    return [Record.of(off, said)]


def _grow(current: Attempt, ctx: Context, ready: list[str]) -> list[Command]:
    """Grow the running group in place: the ready nodes join at the next step boundary with the state."""
    world = grown_world(current, ctx, ready)
    if world is None:
        return [Watch(current.number, current.course)]
    nodes, micro = world
    joiners = [n for n in nodes if n not in current.course.nodes]
    generation = current.generation + 1
    record = Grown(attempt=current.number, generation=generation, nodes=nodes, joiners=joiners, micro_batch=micro,
                   world_size=len(nodes) * ctx.procs_per_node)  # fmt: skip
    course = replace(current.course, nodes=nodes, micro_batch=micro)
    said = f"attempt {current.number}: {', '.join(joiners)} ready; the world grows in place to {len(nodes)} nodes"
    return [
        Record.of(record, f"{said} (generation {generation}), micro-batch {micro}"),
        Publish(current.number, generation, nodes, micro, joiners),
        Watch(current.number, course),
    ]


def succeeded(attempt: int, started: float, seen: AttemptSucceeded) -> tuple[AttemptResult, Record]:
    """The result of a successful attempt and its ``attempt_end``."""
    result = AttemptResult(attempt, round(seen.at - started, 3), seen.last_step)
    end = AttemptEnd(attempt=attempt, state="succeeded", seconds=result.seconds, last_step=result.last_step)
    return result, Record.of(end)


def _succeeded(current: Attempt, seen: AttemptSucceeded) -> list[Command]:
    result, end = succeeded(current.number, current.started, seen)
    return [Cancel(current.number, current.course), end, Finish(result)]  # the cancel: a Job's objects go


def ended(seen: AttemptFailed) -> Record:
    """The ``attempt_end`` of a failed attempt (``last_step``: the heartbeats' newest, which the
    rate-bounded step events may not have reached)."""
    failure = seen.failure
    end = AttemptEnd(attempt=seen.attempt, state="failed", trigger=failure.trigger, reason=seen.reason,
                     last_step=failure.last_step)  # fmt: skip
    return Record.of(end, f"attempt {seen.attempt} failed ({failure.trigger}): {seen.reason}")


def situation(state: TrainState, current: Attempt, ctx: Context, seen: AttemptFailed) -> Situation:
    course, checkpoints = current.course, seen.checkpoints
    resumed = step_of(course.resume_from) if course.resume_from not in ("latest", "none") else checkpoints.latest_step
    return Situation(
        nodes=list(course.nodes),
        spares=state.spares_left(ctx.spares),
        min_nodes=ctx.min_nodes,
        procs_per_node=ctx.procs_per_node,
        global_batch=ctx.global_batch,
        micro_batch=course.micro_batch,
        valid_steps=list(checkpoints.valid_steps),
        resumed_from=resumed,
        in_place=InPlace(not seen.ungrouped, seen.ungrouped, list(current.regroups)) if ctx.elastic else None,
        # A hang seen by a trigger has no node statuses: nothing known of who runs
        running=[n.node for n in seen.failure.nodes if n.state == "running"] if seen.failure.nodes else None,
        batch_followed=seen.batch_followed,
    )


def _failed(state: TrainState, current: Attempt, seen: AttemptFailed, ctx: Context) -> list[Command]:
    found = classify(seen.failure)
    decision = decide(list(state.history), found, situation(state, current, ctx, seen), ctx.recovery)
    if isinstance(decision, Regroup):
        return _regroup(current, seen, found, decision, ctx)
    reason = getattr(decision, "reason", "")
    commands: list[Command] = [
        Cancel(current.number, current.course),  # survivors of a dead collective would wait out its timeout
        ended(seen),
        *_not_in_place(current.number, seen, ctx),
        Record.of(classified(current.number, found, seen)),
        Record.of(
            DecisionMade(
                attempt=current.number,
                kind=found.kind,
                action=decision.action,
                nodes=list(current.course.nodes),
                reason=reason,
                **_changes(decision),
            ),
            f"attempt {current.number}: {found.kind} -> {decision.action}: {reason}",
        ),
    ]
    if isinstance(decision, GiveUp):
        return [*commands, Fail(decision.reason, found.kind, evidence(found, seen.failure))]
    if isinstance(decision, Rollback):
        commands.append(RollBack(decision.to_step))
    if isinstance(decision, ScaleDown) and (dropped := [n for n in current.course.nodes if n not in decision.nodes]):
        commands.append(ExcludeNodes(current.number, dropped, found.kind))
    return [*commands, WaitUntil(seen.at + decision.delay_s)]


def _not_in_place(attempt: int, seen: AttemptFailed, ctx: Context) -> list[Command]:
    """The run's ``recovery_path`` once the attempt showed it cannot regroup in place (the stage's start could
    not know: whether a script uses the elastic group shows only when its ranks run)."""
    if not (ctx.elastic and seen.ungrouped):
        return []
    return [Record.of(RecoveryPath(in_place=False, why_not=seen.ungrouped), f"attempt {attempt}: {seen.ungrouped}")]


def _regroup(
    current: Attempt, seen: AttemptFailed, found: Classified, decision: Regroup, ctx: Context
) -> list[Command]:
    """Heal in place: kill what is left of the culprits, publish the next generation, watch the same attempt.

    No ``attempt_end``: the attempt runs on. Every node that is not in the new group is killed, whether the
    policy named it (a hung node) or it already exited (killing a dead process costs nothing)."""
    generation = current.generation + 1
    gone = [n for n in current.course.nodes if n not in decision.nodes]
    course = replace(current.course, nodes=list(decision.nodes), micro_batch=decision.micro_batch)
    return [
        Record.of(classified(current.number, found, seen)),
        Record.of(
            DecisionMade(
                attempt=current.number,
                kind=found.kind,
                action=decision.action,
                path="in_place",
                nodes=list(current.course.nodes),
                reason=decision.reason,
                new_nodes=list(decision.nodes),
                left_out=list(decision.leave_out),
                micro_batch=decision.micro_batch,
                joiners=list(decision.joiners),
                generation=generation,
            ),
            f"attempt {current.number}: {found.kind} -> regroup in place (generation {generation}): {decision.reason}",
        ),
        KillNodes(current.number, [n for n in gone if n not in found.leaving]),  # notice: it leaves on its own
        Publish(current.number, generation, list(decision.nodes), decision.micro_batch, list(decision.joiners)),
        *_rejoin(current.number, gone, found, ctx, generation),
        Watch(current.number, course),
    ]


def _rejoin(attempt: int, gone: list[str], found: Classified, ctx: Context, generation: int) -> list[Command]:
    """Start again the nodes a dead process left out (not a hung or slow one: that takes the pressure test)."""
    if not gone or not ctx.recovery.rejoin or found.kind not in REJOIN_KINDS:
        return []
    why = (
        f"{found.kind}: starting {', '.join(gone)} again (its process died, no test failed); it waits outside the group"
    )
    return [
        Record.of(Rejoining(attempt=attempt, nodes=gone, reason=why), f"attempt {attempt}: {why}"),
        StartNodes(attempt, gone, once_formed=generation),
    ]


def classified(attempt: int, found: Classified, seen: AttemptFailed) -> FailureClassified:
    """The ``failure_classified`` of a failure (healed in place or not): one constructor for both paths."""
    return FailureClassified(attempt=attempt, kind=found.kind, evidence=found.evidence, culprits=list(found.culprits),
                             step=found.step, detected_at=seen.at)  # fmt: skip


def _changes(decision: Decision) -> dict[str, Any]:
    fields = ("delay_s", "micro_batch", "to_step")
    out = {f: getattr(decision, f) for f in fields if getattr(decision, f, None) is not None}
    if isinstance(decision, ScaleDown):
        out["new_nodes"] = list(decision.nodes)
    return out


def evidence(found: Classified, failure: Failure) -> str:
    """The classification's line and every node's log tail: what a person reads in the task log."""
    tails = "\n".join(f"--- {n.node}\n{n.log_tail}" for n in failure.nodes if n.log_tail)
    return f"{found.evidence}\n{tails}"


def node_failures(nodes: Iterable[NodeStatus], tails: Mapping[str, str] | None = None) -> list[NodeFailure]:
    """classify's view of node statuses; ``tails``: each node's log tail, read by the driver."""
    tails = tails or {}
    return [NodeFailure(n.where, n.state, n.exit_code, n.reason, tails.get(n.where, "")) for n in nodes]  # hosts
