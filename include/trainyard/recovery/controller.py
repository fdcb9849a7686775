"""The training controller: what a train task does next, as a pure function of the ledger and one observation.

Two parts, both pure (no I/O, no clock, no Airflow), the way ``recovery.policy`` is:

- ``TrainState.fold(events)``: the one place that turns the run ledger's train
  events into "which attempt, on which nodes, from which checkpoint, what
  failed and what was decided". A driver keeps the state and folds only the
  events appended since its last look (``Ledger.events_since``).
- ``step(state, observation, ctx) -> list[Command]``: what to do about one
  observation (an attempt succeeded, failed with evidence, a wake-up without
  news, the backoff is over, ...). It calls ``classify`` and ``policy.decide``
  and returns commands for a driver to carry out: record, cancel, roll back,
  exclude nodes, launch; then exactly one of watch, wait until, finish, fail.

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
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from trainyard.backends.base import NodeStatus
from trainyard.checkpoint.format import step_of
from trainyard.recovery.classify import Classified, Failure, NodeFailure, classify
from trainyard.recovery.policy import (
    AttemptRecord,
    Decision,
    InPlace,
    Regroup,
    Rollback,
    ScaleDown,
    Situation,
    decide,
    fitting_micro_batch,
)
from trainyard.recovery.policy import Fail as GiveUp
from trainyard.spec import RecoverySpec
from trainyard.spec.models import Action, FailureKind

STAGE = "train"
REJOIN_KINDS: frozenset[FailureKind] = frozenset({"node_lost", "transient"})
"""Failures of a node's process, not of the node: in place, the node is started again and may rejoin."""
"""The ledger stage of every event the controller records or folds."""

# ---------------------------------------------------------------- state


@dataclass(frozen=True)
class Course:
    """What an attempt runs with; decisions change it."""

    nodes: list[str]
    micro_batch: int
    resume_from: str
    """``latest``, ``none`` or a checkpoint path (a rollback target, or the run's starting point)."""


@dataclass(frozen=True)
class Decided:
    """A recorded decision about a failed attempt (``decision`` event), and whether it was carried out."""

    action: Action
    kind: FailureKind
    at: float
    delay_s: float = 0.0
    reason: str = ""
    micro_batch: int | None = None
    new_nodes: list[str] | None = None
    to_step: int | None = None
    rolled_back_to: str | None = None
    """The path (or ``none``) a rollback restarted the lineage at (``rolled_back`` event); None: not yet done."""


@dataclass(frozen=True)
class Attempt:
    number: int
    course: Course
    started: float
    world_size: int
    state: Literal["running", "succeeded", "failed"] = "running"
    """``running``: no ``attempt_end`` recorded (it runs, or the process watching it died)."""
    seconds: float | None = None
    last_step: int | None = None
    classified: Classified | None = None
    decided: Decided | None = None
    regroups: tuple[tuple[FailureKind, int | None], ...] = ()
    """In-place regroups so far: (kind, the step its failure was seen at); the attempt runs on."""
    regrouped_at: float | None = None
    """When the last regroup (or growth) was decided (its group's ranks start again from then)."""
    grown: int = 0
    """Times the world grew back in place (spares or re-admitted nodes joined at a step boundary)."""

    @property
    def generation(self) -> int:
        """The attempt's group generation on the supervisor's store: 1, then one more per regroup or growth."""
        return 1 + len(self.regroups) + self.grown


@dataclass(frozen=True)
class TrainState:
    """The run's training as its ledger tells it. ``TrainState().fold(events)``; fold later events onto it."""

    resume_from: str | None = None
    """The run's starting checkpoint (``resume_point``): decided once per run; None: not yet."""
    start_step: int | None = None
    attempts: tuple[Attempt, ...] = ()
    history: tuple[AttemptRecord, ...] = ()
    """Every decision so far, for ``policy.decide``."""
    used: frozenset[str] = frozenset()
    """Nodes any attempt ran on or a decision took (a spare used once is no longer spare)."""
    stage_start: float | None = None
    """When the latest train task process began (the last ``stage_start``)."""

    @classmethod
    def of(cls, events: Iterable[Mapping[str, Any]]) -> TrainState:
        return cls().fold(events)

    def fold(self, events: Iterable[Mapping[str, Any]]) -> TrainState:
        """This state with ``events`` (later ledger events, in write order) applied; events of other stages are skipped."""
        state = self
        for event in events:
            if event.get("stage") == STAGE and (apply := _FOLDS.get(str(event.get("event")))) is not None:
                state = apply(state, event)
        return state

    @property
    def last(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    @property
    def unfinished(self) -> bool:
        """The last attempt has no recorded end: still running, or left behind by a task process that died."""
        return self.last is not None and self.last.state == "running"

    @property
    def failures(self) -> list[Classified]:
        return [a.classified for a in self.attempts if a.classified is not None]

    def target_step(self, max_steps: int) -> int | None:
        return None if self.start_step is None else self.start_step + max_steps

    def spares_left(self, spares: Iterable[str]) -> list[str]:
        return [n for n in spares if n not in self.used]

    def _with_last(self, **changes: Any) -> TrainState:
        if self.last is None:
            return self
        return replace(self, attempts=(*self.attempts[:-1], replace(self.last, **changes)))


def _int(value: Any) -> int | None:
    return None if value in (None, "") else int(value)


def _resume_point(s: TrainState, e: Mapping[str, Any]) -> TrainState:
    if s.start_step is not None:  # decided once per run: the first one holds
        return s
    return replace(s, resume_from=str(e["resume_from"]), start_step=int(e["start_step"]))


def _attempt_start(s: TrainState, e: Mapping[str, Any]) -> TrainState:
    nodes = [str(n) for n in e["nodes"]]
    course = Course(nodes, _int(e.get("micro_batch")) or 0, str(e.get("resume_from") or "latest"))
    attempt = Attempt(int(e["attempt"]), course, float(e["ts"]), int(e.get("world_size") or 0))
    return replace(s, attempts=(*s.attempts, attempt), used=s.used | set(nodes))


def _attempt_end(s: TrainState, e: Mapping[str, Any]) -> TrainState:
    if s.last is None or s.last.number != e["attempt"]:
        return s
    seconds = e.get("seconds")
    return s._with_last(
        state="succeeded" if e.get("state") == "succeeded" else "failed",
        seconds=None if seconds is None else float(seconds),
        last_step=_int(e.get("last_step")),
    )


def _classified(s: TrainState, e: Mapping[str, Any]) -> TrainState:
    if s.last is None or s.last.number != e["attempt"]:
        return s
    found = Classified(e["kind"], str(e.get("evidence", "")), list(e.get("culprits", [])), _int(e.get("step")))
    return s._with_last(classified=found)


def _decision(s: TrainState, e: Mapping[str, Any]) -> TrainState:
    record = AttemptRecord(int(e["attempt"]), e["kind"], e["action"], list(e.get("nodes", [])))
    new_nodes = e.get("new_nodes")
    s = replace(s, history=(*s.history, record), used=s.used | set(new_nodes or []))
    if s.last is None or s.last.number != e["attempt"]:
        return s
    if e["action"] == "regroup":  # carried out in place: the attempt runs on with the new group
        last = s.last
        course = replace(last.course, nodes=list(new_nodes or last.course.nodes),
                         micro_batch=_int(e.get("micro_batch")) or last.course.micro_batch)  # fmt: skip
        step = last.classified.step if last.classified else None
        return s._with_last(course=course, regroups=(*last.regroups, (e["kind"], step)), regrouped_at=float(e["ts"]))
    decided = Decided(
        action=e["action"],
        kind=e["kind"],
        at=float(e["ts"]),
        delay_s=float(e.get("delay_s") or 0.0),
        reason=str(e.get("reason", "")),
        micro_batch=_int(e.get("micro_batch")),
        new_nodes=None if new_nodes is None else [str(n) for n in new_nodes],
        to_step=_int(e.get("to_step")),
    )
    return s._with_last(decided=decided)


def _grown(s: TrainState, e: Mapping[str, Any]) -> TrainState:
    last = s.last
    if last is None or last.number != e["attempt"]:
        return s
    course = replace(last.course, nodes=[str(n) for n in e["nodes"]], micro_batch=int(e["micro_batch"]))
    s = replace(s, used=s.used | set(course.nodes))
    return s._with_last(course=course, grown=last.grown + 1, regrouped_at=float(e["ts"]))


def _rolled_back(s: TrainState, e: Mapping[str, Any]) -> TrainState:
    last = s.last
    if last is None or last.decided is None or last.decided.action != "rollback":
        return s
    return s._with_last(decided=replace(last.decided, rolled_back_to=str(e.get("path") or "none")))


def _stage_start(s: TrainState, e: Mapping[str, Any]) -> TrainState:
    return replace(s, stage_start=float(e["ts"]))


_FOLDS = {
    "resume_point": _resume_point,
    "attempt_start": _attempt_start,
    "attempt_end": _attempt_end,
    "failure_classified": _classified,
    "decision": _decision,
    "grown": _grown,
    "rolled_back": _rolled_back,
    "stage_start": _stage_start,
}

# ---------------------------------------------------------------- what the controller is told


@dataclass(frozen=True)
class Context:
    """The run's fixed inputs: the spec's numbers and the nodes burn-in chose."""

    recovery: RecoverySpec
    nodes: list[str]
    """The first attempt's nodes."""
    spares: list[str]
    """Healthy nodes burn-in did not pick, to replace lost ones."""
    micro_batch: int
    global_batch: int
    min_nodes: int
    procs_per_node: int
    reattach: bool
    """The launcher can watch an attempt an earlier task process launched (Kubernetes); local
    attempts die with the process that started them, so the next attempt is launched instead."""
    elastic: bool = False
    """The attempt's ranks form their groups on the supervisor's store and survive a peer's loss
    (the local backend with trainyard's runtime): a failure may be healed in place (``Regroup``)."""


@dataclass(frozen=True)
class Checkpoints:
    """The hot checkpoints when a failure is judged (the driver looks; the policy needs them)."""

    valid_steps: list[int] = field(default_factory=list)
    """Steps of valid checkpoints, ascending."""
    latest_step: int | None = None
    """Step of the lineage's latest checkpoint (``LATEST``), if any."""


@dataclass(frozen=True)
class TaskStarted:
    """A train task process began (first try, a retry, a resumed deferral): carry on from the ledger."""

    at: float


@dataclass(frozen=True)
class AttemptSucceeded:
    attempt: int
    at: float
    last_step: int | None = None
    """The heartbeats' newest step."""


@dataclass(frozen=True)
class AttemptFailed:
    """An attempt ended badly, with what the driver saw (``failure``: classify's input)."""

    attempt: int
    at: float
    failure: Failure
    reason: str
    checkpoints: Checkpoints = field(default_factory=Checkpoints)


@dataclass(frozen=True)
class Hang:
    """A watcher saw ranks without progress; the driver had no closer look (no node evidence)."""

    attempt: int
    at: float
    suspects: list[str]
    reason: str
    checkpoints: Checkpoints = field(default_factory=Checkpoints)


@dataclass(frozen=True)
class Timeout:
    """The watcher woke without news: the attempt runs on."""

    attempt: int
    at: float


@dataclass(frozen=True)
class LostSight:
    """The cluster did not answer; the attempt may well be running (a retried task re-attaches)."""

    attempt: int
    at: float
    message: str


@dataclass(frozen=True)
class SparesReady:
    """Nodes outside the group wait ready on the store (warm spares, re-admitted nodes) while the world is
    smaller than the first attempt's: it can grow back in place."""

    attempt: int
    at: float
    nodes: list[str]


@dataclass(frozen=True)
class BackoffOver:
    at: float


@dataclass(frozen=True)
class LeaseLost:
    """Another run holds the pipeline's checkpoint lineage now: this run must stop writing to it."""

    at: float
    message: str


Observation = (
    TaskStarted | AttemptSucceeded | AttemptFailed | Hang | Timeout | LostSight | BackoffOver | LeaseLost | SparesReady
)


@dataclass(frozen=True)
class Reported:
    """What an attempt's watcher (the Kubernetes trigger) reported, typed: the driver looks again before
    it becomes an ``Observation`` (a fresh poll has the pods' logs as evidence)."""

    status: Literal["succeeded", "failed", "hang", "timeout", "error"]
    message: str
    attempt: int | None = None
    """None: an event of a trigger that did not say (the ledger's last attempt)."""
    nodes: list[NodeStatus] = field(default_factory=list)
    suspects: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- what the controller says


@dataclass(frozen=True)
class AttemptResult:
    attempt: int
    seconds: float
    last_step: int | None


@dataclass(frozen=True)
class Record:
    """Append ``event`` (stage ``train``) to the ledger; ``log`` is a line for the task's log too."""

    event: str
    fields: dict[str, Any]
    log: str = ""


@dataclass(frozen=True)
class Cancel:
    """End every process (or pod) of the attempt; a no-op for one that already ended."""

    attempt: int
    course: Course


@dataclass(frozen=True)
class RollBack:
    """Set the checkpoints after ``to_step`` aside and restart the lineage there (records ``rolled_back``)."""

    to_step: int


@dataclass(frozen=True)
class ExcludeNodes:
    """Keep later attempts off ``nodes`` (the launcher marks them where it can; records ``nodes_marked``)."""

    attempt: int
    nodes: list[str]
    reason: str


@dataclass(frozen=True)
class KillNodes:
    """End these nodes' processes (a hung node holds its sockets open until it dies); the rest run on."""

    attempt: int
    nodes: list[str]


@dataclass(frozen=True)
class Publish:
    """Publish the attempt's next group generation on the supervisor's store: its ranks regroup in place."""

    attempt: int
    generation: int
    nodes: list[str]
    """The new group's nodes, in rank order."""
    micro_batch: int
    joiners: list[str]
    """Nodes that join with nothing in memory: the survivors broadcast them the state."""


@dataclass(frozen=True)
class Launch:
    """Record ``attempt_start`` and launch the attempt's plan (the driver builds it from these)."""

    attempt: int
    course: Course
    warm: list[str] = field(default_factory=list)
    """Spares started with the attempt: they connect, build the model and wait on the store to be listed."""


@dataclass(frozen=True)
class StartNodes:
    """Start these nodes in the running attempt, outside its group: they wait on the store, ready to join
    (a node left out for a dead process, started again: reaching the store ready is its re-test)."""

    attempt: int
    nodes: list[str]
    once_formed: int | None = None
    """Not before every member formed this generation: where nodes share cores (the local backend), a
    start-up beside the survivors' regroup would slow their first step."""


@dataclass(frozen=True)
class Watch:
    """Wait for news of the attempt (poll it, or defer on its trigger)."""

    attempt: int
    course: Course


@dataclass(frozen=True)
class WaitUntil:
    """Wait until ``at`` (epoch seconds; a retry's backoff), then report ``BackoffOver``."""

    at: float


@dataclass(frozen=True)
class Finish:
    result: AttemptResult


@dataclass(frozen=True)
class Fail:
    """End the train task: ``kind`` ``lease_lost`` (another run holds the lineage), ``lost_sight`` (worth a
    task retry) or the failure kind the policy gave up on."""

    reason: str
    kind: str
    evidence: str = ""


Command = (
    Record
    | Cancel
    | KillNodes
    | Publish
    | StartNodes
    | RollBack
    | ExcludeNodes
    | Launch
    | Watch
    | WaitUntil
    | Finish
    | Fail
)
TERMINAL = (Watch, WaitUntil, Finish, Fail)
"""Every command list ends with exactly one of these, and has no other."""

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
        case LostSight(message=message):
            return [Fail(f"lost sight of attempt {current.number}: {message}", "lost_sight")]
        case AttemptSucceeded():
            return _succeeded(current, observation)
        case Hang():
            failure = Failure(current.number, "hang", [], list(observation.suspects))
            seen = AttemptFailed(current.number, observation.at, failure, observation.reason, observation.checkpoints)
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
    started = [Record("spares_warm", {"attempt": attempt, "nodes": warm})] if warm else []
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


def _grow(current: Attempt, ctx: Context, ready: list[str]) -> list[Command]:
    """Grow the running group in place: the ready nodes join at the next step boundary with the state."""
    world = grown_world(current, ctx, ready)
    if world is None:
        return [Watch(current.number, current.course)]
    nodes, micro = world
    joiners = [n for n in nodes if n not in current.course.nodes]
    generation = current.generation + 1
    fields = {"attempt": current.number, "generation": generation, "nodes": nodes, "joiners": joiners,
              "micro_batch": micro, "world_size": len(nodes) * ctx.procs_per_node}  # fmt: skip
    course = replace(current.course, nodes=nodes, micro_batch=micro)
    said = f"attempt {current.number}: {', '.join(joiners)} ready; the world grows in place to {len(nodes)} nodes"
    return [
        Record("grown", fields, f"{said} (generation {generation}), micro-batch {micro}"),
        Publish(current.number, generation, nodes, micro, joiners),
        Watch(current.number, course),
    ]


def succeeded(attempt: int, started: float, seen: AttemptSucceeded) -> tuple[AttemptResult, Record]:
    """The result of a successful attempt and its ``attempt_end``."""
    result = AttemptResult(attempt, round(seen.at - started, 3), seen.last_step)
    end = {"attempt": attempt, "state": "succeeded", "seconds": result.seconds, "last_step": result.last_step}
    return result, Record("attempt_end", end)


def _succeeded(current: Attempt, seen: AttemptSucceeded) -> list[Command]:
    result, end = succeeded(current.number, current.started, seen)
    return [Cancel(current.number, current.course), end, Finish(result)]  # the cancel: a Job's objects go


def ended(seen: AttemptFailed) -> Record:
    """The ``attempt_end`` of a failed attempt (``last_step``: the heartbeats' newest, which the
    rate-bounded step events may not have reached)."""
    failure = seen.failure
    fields = {
        "attempt": seen.attempt,
        "state": "failed",
        "trigger": failure.trigger,
        "reason": seen.reason,
        "last_step": failure.last_step,
    }
    return Record("attempt_end", fields, f"attempt {seen.attempt} failed ({failure.trigger}): {seen.reason}")


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
        in_place=InPlace(True, regroups=list(current.regroups)) if ctx.elastic else None,
        # A hang seen by a trigger has no node statuses: nothing known of who runs
        running=[n.node for n in seen.failure.nodes if n.state == "running"] if seen.failure.nodes else None,
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
        Record(
            "failure_classified",
            {
                "attempt": current.number,
                "kind": found.kind,
                "evidence": found.evidence,
                "culprits": list(found.culprits),
                "step": found.step,
                "detected_at": seen.at,
            },
        ),
        Record(
            "decision",
            {
                "attempt": current.number,
                "kind": found.kind,
                "action": decision.action,
                "nodes": list(current.course.nodes),
                "reason": reason,
                **_changes(decision),
            },
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


def _regroup(
    current: Attempt, seen: AttemptFailed, found: Classified, decision: Regroup, ctx: Context
) -> list[Command]:
    """Heal in place: kill what is left of the culprits, publish the next generation, watch the same attempt.

    No ``attempt_end``: the attempt runs on. Every node that is not in the new group is killed, whether the
    policy named it (a hung node) or it already exited (killing a dead process costs nothing)."""
    generation = current.generation + 1
    gone = [n for n in current.course.nodes if n not in decision.nodes]
    fields = {"attempt": current.number, "kind": found.kind, "evidence": found.evidence,
              "culprits": list(found.culprits), "step": found.step, "detected_at": seen.at}  # fmt: skip
    course = replace(current.course, nodes=list(decision.nodes), micro_batch=decision.micro_batch)
    return [
        Record("failure_classified", fields),
        Record(
            "decision",
            {
                "attempt": current.number,
                "kind": found.kind,
                "action": decision.action,
                "path": "in_place",
                "nodes": list(current.course.nodes),
                "reason": decision.reason,
                "new_nodes": list(decision.nodes),
                "left_out": list(decision.leave_out),
                "micro_batch": decision.micro_batch,
                "joiners": list(decision.joiners),
                "generation": generation,
            },
            f"attempt {current.number}: {found.kind} -> regroup in place (generation {generation}): {decision.reason}",
        ),
        KillNodes(current.number, gone),
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
        Record("rejoining", {"attempt": attempt, "nodes": gone, "reason": why}, f"attempt {attempt}: {why}"),
        StartNodes(attempt, gone, once_formed=generation),
    ]


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
