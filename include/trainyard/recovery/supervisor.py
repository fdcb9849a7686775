"""The drivers: the commands both carry out (``Driver``), and the blocking one (``Supervisor``, ``supervise``).

The controller (``recovery.controller``, pure) decides; a driver carries
its commands out. ``Driver`` does what both drivers share (record, cancel,
roll back, exclude, launch, grow or shrink a group in place) and folds the
ledger as it grows (``StateReader``); ``Hooks`` is what it needs from the
run around it. The blocking driver runs in the task (the local backend and
the tests): it watches each attempt (``recovery.attempt.watch_attempt``),
which on a failure ends every node of the attempt at once -- survivors of a
dead collective would otherwise wait out gloo's timeout -- unless they can
regroup, and sleeps out backoffs renewing the lease. Every decision is a
ledger event, so a retried Airflow task carries on from the ledger instead
of starting over. The deferred driver (``recovery.deferred``) waits its own way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from trainyard.backends.base import (
    AttemptStatus,
    Launcher,
    LaunchPlan,
    RegroupingLauncher,
    SignalsNodes,
    WakesOnExit,
)
from trainyard.errors import LineageBusy, TrainingFailed, TransientError
from trainyard.events.fold import TrainRun
from trainyard.events.ledger import Ledger
from trainyard.protocol.coordinator import Coordinator
from trainyard.protocol.coordstore import Generation
from trainyard.protocol.env import FaultDrill
from trainyard.recovery.attempt import append_record, kept, start_attempt, watch_attempt
from trainyard.recovery.commands import (
    AttemptResult,
    Cancel,
    Command,
    ExcludeNodes,
    Fail,
    Finish,
    KillNodes,
    Publish,
    Record,
    RollBack,
    StartNodes,
    WaitUntil,
    Watch,
)
from trainyard.recovery.commands import Launch as LaunchCommand
from trainyard.recovery.controller import grown_world, step
from trainyard.recovery.drills import Actor
from trainyard.recovery.look import PREEMPTED, AttemptView
from trainyard.recovery.observations import (
    AttemptFailed,
    AttemptSucceeded,
    BackoffOver,
    Checkpoints,
    Context,
    Hang,
    Observation,
    TaskStarted,
)
from trainyard.recovery.progress import ProgressLog
from trainyard.recovery.state import STAGE, Attempt, Course, TrainState
from trainyard.recovery.watch import STARTUP_GRACE_S

log = logging.getLogger(__name__)
BROKEN_GRACE_S = 0.5
"""How long the survivors of a crash or a hang get between SIGTERM and SIGKILL on the relaunch path: long enough
for their last words (a survivor's failure record came 0.25 s after a peer's death here); the launcher's full
grace (5 s locally) held the relaunch 1.5-1.9 s while they wound down a group that can do nothing more."""


@dataclass(frozen=True)
class Hooks:
    """What a driver needs from the run around it (``stages`` builds them from the spec)."""

    plan_for: Callable[[int, Course], LaunchPlan]
    """The attempt's plan (pure: the same inputs give the same plan, so a new process rebuilds it)."""
    rollback_to: Callable[[int], str]
    """Set later checkpoints aside and restart the lineage at a step; returns the path (or ``none``)."""
    checkpoints: Callable[[], Checkpoints]
    """The hot checkpoints, for the policy."""
    progress_for: Callable[[LaunchPlan], ProgressLog] | None = None
    """Paces an attempt's progress lines in the task log (None: none logged)."""
    store_address: Callable[[int], str | None] | None = None
    """Where this side reaches an attempt's store from any process (a trigger reads its fault counter
    there: a deferred task); None: only from this process."""
    coordinator_for: Callable[[int], Coordinator] | None = None
    """An attempt's side of the coordination store its ranks group on (None: the attempt cannot regroup); the
    same object at every call for one attempt: it remembers the generation it published, never reads it back."""
    drills_for: Callable[[int], list[FaultDrill]] | None = None
    """The drills of an attempt the blocking driver acts out from outside its processes (``recovery.drills``);
    None: none (the script acts out its own, or the launcher cannot signal nodes)."""


UNGROUPED = ("its ranks never formed a group on the coordination store: the training script does not train through"
             " trainyard.runtime.elastic_group (or failed before its first group formed), so no survivor holds the"
             " state")  # fmt: skip


class StateReader:
    """The ledger's ``TrainState``, folding only the events appended since the last look."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger, self.position, self.state = ledger, 0, TrainState()

    def now(self) -> TrainState:
        events, self.position = self.ledger.events_since(self.position)
        self.state = self.state.fold(events)
        return self.state


class Driver:
    """Carries out the commands both drivers share; ``_terminal`` (each driver's own) waits, finishes or fails."""

    heartbeat_timeout_s: float
    startup_grace_s: float = STARTUP_GRACE_S
    """The spec's watch settings (``training``), for every look (``view``)."""
    grouped = False  # this process said the ranks formed a group on the store

    def __init__(self, launcher: Launcher, reader: StateReader, ctx: Context, hooks: Hooks) -> None:
        self.launcher, self.reader, self.ctx, self.hooks = launcher, reader, ctx, hooks
        self.ledger = reader.ledger
        self.handles: dict[int, Any] = {}
        """Attempts this process launched or attached, by number."""
        self.ended: set[int] = set()
        """Attempts this process already cancelled (a second cancel would only repeat the calls)."""
        self.starts: list[StartNodes] = []
        """Nodes to start once their generation formed (``StartNodes.once_formed``)."""

    def _start_due(self, attempt: int) -> None:
        """Start the nodes whose generation every member formed (the watch's ``each_poll``)."""
        assert self.hooks.coordinator_for is not None
        coordinator = self.hooks.coordinator_for(attempt)
        if not self.grouped and coordinator.ready(1):  # in place is real once the ranks grouped (``recovery path``)
            self.grouped = True
            self.ledger.append(STAGE, "group_formed", attempt=attempt)
        for command in [c for c in self.starts if c.attempt == attempt]:
            if command.once_formed is not None and not coordinator.formed(command.once_formed):
                continue
            self.starts.remove(command)
            coordinator.forget(command.nodes)  # ready only once the new process says so
            self._regrouping().add_nodes(self.handles[attempt], command.nodes)

    def handle(self, attempt: int, course: Course) -> Any | None:
        """The attempt's handle; one an earlier process launched is attached where the launcher can."""
        if attempt not in self.handles and self.launcher.reattaches:
            self.handles[attempt] = self.launcher.attach(self.hooks.plan_for(attempt, course))
        return self.handles.get(attempt)

    def execute(self, command: Command) -> None:
        match command:
            case Record():
                append_record(self.ledger, command)
            case Cancel(attempt=attempt, course=course):
                if attempt in self.ended:
                    self.handles.pop(attempt, None)
                elif (
                    handle := self.handle(attempt, course)
                ) is not None:  # a local attempt of a dead task died with it
                    self.launcher.cancel(handle)
                    self.handles.pop(attempt, None)
            case RollBack(to_step=to_step):
                self.hooks.rollback_to(to_step)
            case ExcludeNodes(attempt=attempt, nodes=nodes, reason=reason):
                if marked := self.launcher.exclude(nodes):
                    self.ledger.append(STAGE, "nodes_marked", attempt=attempt, nodes=marked, reason=reason)
            case LaunchCommand(attempt=attempt, course=course):
                plan = self.hooks.plan_for(attempt, course)
                if self.hooks.coordinator_for is not None:  # the first group, before any rank looks for it
                    self._publish(Publish(attempt, 1, list(course.nodes), course.micro_batch, []))
                outside = self.hooks.drills_for(attempt) if self.hooks.drills_for else []
                self.handles[attempt] = start_attempt(self.launcher, plan, self.ledger, command.warm, outside)
                if command.warm:  # outside the group: they wait on the store to be listed
                    self._regrouping().add_nodes(self.handles[attempt], command.warm)
            case KillNodes(attempt=attempt, nodes=nodes):
                if nodes and (handle := self.handles.get(attempt)) is not None:
                    self._regrouping().kill_nodes(handle, nodes)
            case StartNodes(attempt=attempt, nodes=nodes):
                if nodes and attempt in self.handles:
                    self.starts.append(command)
                    self._start_due(attempt)
            case Publish(attempt=attempt, joiners=joiners):
                if joiners:
                    self._regrouping().add_nodes(self.handles[attempt], joiners)
                self._publish(command)
            case _:
                raise AssertionError(f"{command!r} ends a command list; it is the driver's own")

    def _regrouping(self) -> RegroupingLauncher:
        if not isinstance(self.launcher, RegroupingLauncher):
            raise AssertionError(f"{type(self.launcher).__name__} cannot regroup an attempt in place")
        return self.launcher

    def _publish(self, command: Publish) -> None:
        assert self.hooks.coordinator_for is not None
        generation = Generation(command.generation, command.nodes, command.micro_batch, command.joiners)
        self.hooks.coordinator_for(command.attempt).publish(generation)

    def _ungrouped(self, attempt: int, seen: Observation) -> Observation:
        """A failure of an attempt whose ranks never formed its first group on the store: nothing to regroup
        (a script that does not use the elastic group trains in the launch's fixed world)."""
        assert self.hooks.coordinator_for is not None
        if isinstance(seen, AttemptFailed) and not self.hooks.coordinator_for(attempt).ready(1):
            return replace(seen, ungrouped=UNGROUPED)
        return seen

    def view(self, plan: LaunchPlan, last: Attempt) -> AttemptView:
        """The attempt as known before a look: its group and start (the last regroup's), the spec's watch
        settings, and what the run said of its heartbeats."""
        run = self.reader.now().run
        return AttemptView.of(
            plan, last.regrouped_at or last.started, self.heartbeat_timeout_s, grace_s=self.startup_grace_s,
            regrouped=last.generation > 1, beatless_said=run.hang_detection_off is not None,
            beats_known=any(a.last_step is not None for a in run.attempts),
        )  # fmt: skip

    def spares_ready(self, attempt: int, candidates: list[str]) -> list[str]:
        """Of ``candidates``, the nodes outside the current group that wait ready on the store, when they can
        grow it: never past the first attempt's size, and not before the group formed (a member that read
        the older generation would form it alone)."""
        current = self.reader.now().last
        if self.hooks.coordinator_for is None or current is None or current.number != attempt:
            return []
        coordinator = self.hooks.coordinator_for(attempt)
        if len(current.course.nodes) >= len(self.ctx.nodes) or not coordinator.formed(current.generation):
            return []
        outside = [n for n in dict.fromkeys(candidates) if n not in current.course.nodes]
        ready = coordinator.spares_ready(outside) if outside else []
        return ready if ready and grown_world(current, self.ctx, ready) is not None else []

    def followed(self, observation: Observation) -> Observation:
        """A failure with whether the script said it applies the batch settings: its rank 0's ``batch_followed``,
        in the writers' files (what the policy's decision may claim about the global batch)."""
        if isinstance(observation, (AttemptFailed, Hang)) and not observation.batch_followed:
            said = TrainRun.of(self.ledger.events(STAGE, "batch_followed")).batch_followed
            return replace(observation, batch_followed=said) if said else observation
        return observation

    def commands(self, observation: Observation) -> list[Command]:
        """Step, and carry out every command but the last (the terminal one, returned alone)."""
        *steps, last = step(self.reader.now(), self.followed(observation), self.ctx)
        for command in steps:
            self.execute(command)
        return [last]


def failure_error(fail: Fail) -> Exception:
    """The error a ``Fail`` ends the train task with: named by what to do about it (docs/architecture.md, errors)."""
    if fail.kind == "lease_lost":
        return LineageBusy(fail.reason)
    if fail.kind == "lost_sight":
        return TransientError(fail.reason)  # a task retry re-attaches to the attempt
    log.error("training failed: %s\n%s", fail.reason, fail.evidence)  # the traceback, in the task log
    return TrainingFailed(fail.reason, kind=fail.kind, evidence=fail.evidence)


class Supervisor(Driver):
    """The blocking driver: polls the attempt, sleeps out backoffs (renewing the lease), returns the result."""

    def __init__(
        self,
        launcher: Launcher,
        reader: StateReader,
        ctx: Context,
        hooks: Hooks,
        heartbeat_timeout_s: float,
        poll_s: float = 0.5,
        keep_alive: Callable[[], None] | None = None,
        startup_grace_s: float = STARTUP_GRACE_S,
    ) -> None:
        super().__init__(launcher, reader, ctx, hooks)
        self.startup_grace_s = startup_grace_s
        self.heartbeat_timeout_s, self.poll_s, self.keep_alive = heartbeat_timeout_s, poll_s, keep_alive
        self.actors: dict[int, Actor] = {}
        """Each attempt's outside drills (kept across watches of one attempt: a drill strikes once)."""

    def run(self) -> AttemptResult:
        observation: Observation = TaskStarted(time.time())
        try:
            while True:
                [last] = self.commands(observation)
                match last:
                    case Watch(attempt=attempt, course=course):
                        observation = self.watch(attempt, course)
                    case WaitUntil(at=at):
                        observation = self.wait(at)
                    case Finish(result=result):
                        return result
                    case Fail():
                        raise failure_error(last)
        finally:
            for handle in self.handles.values():  # whatever ended the task (a kill, an error) ends its attempt
                self.launcher.cancel(handle)

    def watch(self, attempt: int, course: Course) -> Observation:
        plan = self.hooks.plan_for(attempt, course)
        handle = self.handle(attempt, course)
        last = self.reader.now().last
        assert handle is not None and last is not None and last.number == attempt, (attempt, last)
        progress = self.hooks.progress_for(plan) if self.hooks.progress_for else None
        on_store = self.hooks.coordinator_for is not None  # the attempt groups on the supervisor's store
        actor = self._actor(attempt, plan, last.started)
        if actor is not None and progress is not None:  # a beatless script's drills strike at its log's step
            actor.logged = progress.logs.read if progress.logs is not None else None

        def each_poll() -> None:
            if on_store:
                self._start_due(attempt)
            if actor is not None:
                actor(handle)

        seen = watch_attempt(
            self.launcher,
            handle,
            plan,
            self.view(plan, last),
            self.poll_s,
            progress=progress,
            keep_alive=self.keep_alive,
            checkpoints=lambda what: self.end_then_scan(attempt, handle, what),
            ready_spares=self._ready_spares(attempt, course) if on_store else None,
            pause=self._pause(attempt, last.generation) if on_store else self._exit_pause(handle),
            each_poll=each_poll if on_store or actor is not None else None,
            leaving=self._leaving(attempt, last.generation) if on_store else None,
        )
        if actor is not None and isinstance(seen, (AttemptSucceeded, AttemptFailed)):
            actor.ended(failed=isinstance(seen, AttemptFailed))
        return self._ungrouped(attempt, seen) if on_store else seen

    def _actor(self, attempt: int, plan: LaunchPlan, started: float) -> Actor | None:
        """The attempt's outside drills (None: none, or a launcher that cannot act them out)."""
        if attempt not in self.actors:
            drills = self.hooks.drills_for(attempt) if self.hooks.drills_for else []
            if not drills or not isinstance(self.launcher, SignalsNodes):
                return None
            self.actors[attempt] = Actor(drills, plan, self.launcher, self.ledger, started, self.heartbeat_timeout_s,
                                         self.startup_grace_s)  # fmt: skip
        return self.actors[attempt]

    def _leaving(self, attempt: int, generation: int) -> Callable[[], list[str]]:
        """The nodes that reported they leave generation ``generation`` on notice (SIGTERM)."""
        assert self.hooks.coordinator_for is not None
        coordinator = self.hooks.coordinator_for(attempt)
        return lambda: coordinator.leaving(generation)

    def _exit_pause(self, handle: Any) -> Callable[[float], None]:
        """Wait between polls of an attempt that relaunches: woken by a process's end where the launcher can see
        it (``WakesOnExit``: a node's death is seen at once, not up to a poll later), else a plain sleep."""
        if not isinstance(self.launcher, WakesOnExit):
            return time.sleep
        launcher = self.launcher

        def pause(seconds: float) -> None:
            launcher.wait_exit(handle, seconds)

        return pause

    def _pause(self, attempt: int, generation: int) -> Callable[[float], None]:
        """Wait between polls on generation ``generation``'s fault report: a survivor's report wakes the watch
        at once (a dead node's exit is seen by then), not up to a poll later. Once one came, plain sleeps."""
        assert self.hooks.coordinator_for is not None
        coordinator = self.hooks.coordinator_for(attempt)
        woken = False

        def pause(seconds: float) -> None:
            nonlocal woken
            if woken:
                time.sleep(seconds)
            else:
                woken = coordinator.wait_fault(generation, seconds)

        return pause

    def _ready_spares(self, attempt: int, course: Course) -> Callable[[AttemptStatus], list[str]]:
        """The nodes outside ``course``'s group that run and wait ready, when they can grow it (else none)."""

        def ready(status: AttemptStatus) -> list[str]:
            return self.spares_ready(attempt, [n.slot for n in status.nodes if n.state == "running"])

        return ready

    def end_then_scan(self, attempt: int, handle: Any, what: str) -> Checkpoints:
        """A failure was seen (``what``: ``look``'s word): end the survivors first (they would wait out the dead
        collective's timeout, spinning on the cores the scan needs), then describe the checkpoints for the policy.
        After a crash or a hang their group is broken: they can neither train nor save with it, and a hung one
        never runs its SIGTERM handler, so they get ``BROKEN_GRACE_S``; a preempted node's peers may be finishing
        the save its notice asked for, and get the launcher's full grace.

        Survivors that can regroup are kept: they wait on the coordination store, idle, for the decision."""
        if self.hooks.coordinator_for is None:
            self.launcher.cancel(handle, grace_s=None if what == PREEMPTED else BROKEN_GRACE_S)
            self.ended.add(attempt)
        return self.hooks.checkpoints()

    def wait(self, at: float, slice_s: float = 5.0) -> Observation:
        """Sleep until ``at`` (a retry's backoff, up to an hour), renewing the lease every ``slice_s``."""
        while (left := at - time.time()) > 0:
            if (lost := kept(self.keep_alive)) is not None:
                return lost
            time.sleep(min(left, slice_s))
        return BackoffOver(time.time())


def supervise(
    launcher: Launcher,
    ledger: Ledger,
    ctx: Context,
    hooks: Hooks,
    heartbeat_timeout_s: float,
    poll_s: float = 0.5,
    keep_alive: Callable[[], None] | None = None,
    startup_grace_s: float = STARTUP_GRACE_S,
) -> AttemptResult:
    """Attempts until success; ``TrainingFailed`` (with the kind) once the policy says fail. Carries on from the
    ledger (a retried task): see ``controller.carry_on``. ``keep_alive`` is called at every poll and backoff
    slice; ``LineageBusy`` from it ends the attempt and the task."""
    supervisor = Supervisor(launcher, StateReader(ledger), ctx, hooks, heartbeat_timeout_s, poll_s, keep_alive,
                            startup_grace_s)  # fmt: skip
    return supervisor.run()
