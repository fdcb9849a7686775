"""The deferred driver: the controller's commands cut at every wait, so no process holds a worker slot.

The train task (``airflow.operators.TrainOperator``) runs one wake-up at a
time in a new process: ``begin`` when the task starts, ``resume`` with each
thing it deferred on -- the attempt trigger's report, or the end of a backoff.
Each returns what to wait for next: an ``AttemptWatch`` (what the attempt
trigger needs), a ``Backoff`` (a time to wait until, on a time trigger), or
``Done`` with the result. Everything else a wake-up needs is in the ledger,
which the controller folds; a retried task carries on the same way.

Before the controller hears of a trigger's report, the driver looks again
itself: a fresh poll saves the finished pods' logs (the evidence ``classify``
reads), and heartbeats show a hang the triggerer could not see.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from trainyard.backends.base import AttemptStatus, DefersAttempts, Launcher
from trainyard.protocol.coordinator import Coordinator
from trainyard.protocol.coordstore import Generation, faulted_key, peek
from trainyard.recovery.commands import AttemptResult, Command, Fail, Finish, StartNodes, WaitUntil, Watch
from trainyard.recovery.look import ERROR, FAILED, PREEMPTED, SPARES, SUCCEEDED, AttemptView, Reads, look, seen
from trainyard.recovery.observations import (
    AttemptSucceeded,
    BackoffOver,
    Context,
    LeaseLost,
    LostSight,
    Observation,
    Reported,
    TaskStarted,
    Timeout,
)
from trainyard.recovery.progress import ProgressLog
from trainyard.recovery.state import STAGE, Course
from trainyard.recovery.supervisor import Driver, Hooks, StateReader, failure_error
from trainyard.recovery.watch import CRASH, HANG, STARTUP_GRACE_S, failed, last_step

log = logging.getLogger(__name__)

GROW_WAKE_S = 15.0
"""How soon a task whose group is below its size wakes to look for nodes waiting ready to join (no trigger
sees them: a ready node writes no counter)."""


@dataclass(frozen=True)
class Pace:
    """How a deferred task's waits are paced, beside the attempt: the backend's ``wake_every_s`` and the spec's
    progress lines (the train stage's, from the spec)."""

    wake_every_s: float = 300.0
    progress_every_s: float | None = None
    tokens_per_step: int | None = None
    checkpoint_dir: str = ""


@dataclass(frozen=True)
class AttemptWatch:
    """Everything an attempt trigger needs to watch one attempt, and all it serializes: JSON-safe (it travels
    through the metadata DB). Only ``handle`` is the backend's; the rest every backend's trigger reads alike."""

    attempt: int
    started: float
    handle: dict[str, Any]
    """The backend's attempt handle as plain JSON (``DefersAttempts.describe``): only its trigger reads it."""
    nodes: list[str]
    world_size: int
    heartbeat_dir: str
    target_step: int
    in_place: bool = False
    """The attempt's nodes are bare pods that regroup on its store (a missing pod has failed)."""
    regrouped: bool = False
    """It regrouped since its launch (``started`` is then the regroup's time): only ``nodes``' beats count."""
    store: str = ""
    """In place: where the trigger reads the store's fault counter of ``generation`` ("": no store to read)."""
    generation: int = 0
    faults_seen: str = ""
    """That counter's value when the task last looked (it wakes for a change only: a counter is no proof)."""
    wake_s: float = 300.0
    """Wake the task within this long even with no news (``Pace.wake_every_s``, shorter while the group is
    smaller than it may grow back to: a node started again may be waiting ready by then)."""
    heartbeat_timeout_s: float = 300.0
    """``training.heartbeat_timeout_s``: a rank without progress for this long is hung."""
    startup_grace_s: float = STARTUP_GRACE_S
    """``training.startup_grace_s``: how long a rank may take to beat for the first time."""
    progress_every_s: float | None = None
    """Seconds between the trigger's progress lines (``training.progress_every_s``); None: none logged."""
    tokens_per_step: int | None = None
    """Tokens of one optimizer step, where the spec knows them (for the progress lines)."""
    checkpoint_dir: str = ""
    """The pipeline's hot checkpoint root, for the progress lines' last valid checkpoint ("": unknown)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def view(self) -> AttemptView:
        """The attempt as the task saw it when it deferred: the one view every driver's look takes."""
        return AttemptView(self.attempt, list(self.nodes), self.world_size, Path(self.heartbeat_dir), self.started,
                           self.heartbeat_timeout_s, self.startup_grace_s, self.regrouped)  # fmt: skip

    def progress_log(self, now: float) -> ProgressLog | None:
        """Paces a trigger's progress lines from ``now`` (each wake-up starts a new trigger); None: none logged."""
        if not self.progress_every_s or not self.heartbeat_dir:
            return None
        checkpoints = Path(self.checkpoint_dir) if self.checkpoint_dir else None
        return ProgressLog(self.progress_every_s, now, attempt=self.attempt, world_size=self.world_size,
                           target=self.target_step, tokens_per_step=self.tokens_per_step,
                           heartbeat_dir=Path(self.heartbeat_dir), checkpoint_root=checkpoints)  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AttemptWatch:
        return cls(**{**data, "nodes": list(data["nodes"]), "handle": dict(data["handle"])})


@dataclass(frozen=True)
class Backoff:
    """Wait until ``until`` (epoch seconds), then ``resume(BackoffOver(...))``."""

    until: float


@dataclass(frozen=True)
class Done:
    result: AttemptResult


Deferral = AttemptWatch | Backoff
"""What a deferred train task waits on next: the attempt's trigger, or the end of a backoff."""
Outcome = Deferral | Done


class Deferred(Driver):
    """One wake-up of the deferred train task."""

    def __init__(
        self,
        launcher: Launcher,
        reader: StateReader,
        ctx: Context,
        hooks: Hooks,
        heartbeat_timeout_s: float,
        target_step: int,
        on_wake: Callable[[], None] | None = None,
        startup_grace_s: float = STARTUP_GRACE_S,
        pace: Pace | None = None,
    ) -> None:
        super().__init__(launcher, reader, ctx, hooks)
        self.heartbeat_timeout_s, self.target_step, self.on_wake = heartbeat_timeout_s, target_step, on_wake
        self.startup_grace_s, self.pace = startup_grace_s, pace or Pace()
        if hooks.coordinator_for is not None:
            self.hooks = replace(hooks, coordinator_for=self._recalling(hooks.coordinator_for))

    def _recalling(self, coordinator_for: Callable[[int], Coordinator]) -> Callable[[int], Coordinator]:
        """Coordinators that know the generation the attempt runs in: a ``Coordinator`` remembers what it
        published only in memory, and this process is new at every wake; the ledger says which (its nodes
        and micro-batch are the attempt's course: every regroup and growth is an event)."""

        def coordinator(attempt: int) -> Coordinator:
            found = coordinator_for(attempt)
            last = self.reader.state.last
            if found.generation is None and last is not None and last.number == attempt and last.state == "running":
                found.generation = Generation(last.generation, list(last.course.nodes), last.course.micro_batch)
            return found

        return coordinator

    def execute(self, command: Command) -> None:
        """As ``Driver.execute``, but nodes to start again start now: no process of this task stays to start
        them once their generation formed, and on Kubernetes each is a host of its own (its start-up slows no
        survivor, which is what ``StartNodes.once_formed`` spares the local backend's shared cores)."""
        if isinstance(command, StartNodes) and command.nodes and command.attempt in self.handles:
            assert self.hooks.coordinator_for is not None
            self.hooks.coordinator_for(command.attempt).forget(command.nodes)  # ready once the new pod says so
            self._regrouping().add_nodes(self.handles[command.attempt], command.nodes)
            return
        super().execute(command)

    def begin(self) -> Outcome:
        return self.run(TaskStarted(time.time()))

    def resume(self, news: Reported | BackoffOver) -> Outcome:
        return self.run(news if isinstance(news, BackoffOver) else self.look(news))

    def lost_lease(self, message: str) -> Outcome:
        """Another run holds the lineage now: end this run's attempt (its pods would run on) and fail."""
        return self.run(LeaseLost(time.time(), message))

    def run(self, observation: Observation) -> Outcome:
        while True:
            [last] = self.commands(observation)
            match last:
                case Watch(attempt=attempt, course=course):
                    return self.watch(attempt, course)
                case WaitUntil(at=at):
                    if at > time.time():
                        return Backoff(at)
                    observation = BackoffOver(time.time())  # already due: a deferral would only add latency
                case Finish(result=result):
                    return Done(result)
                case Fail():
                    raise failure_error(last)

    def watch(self, attempt: int, course: Course) -> AttemptWatch:
        plan = self.hooks.plan_for(attempt, course)
        handle = self.handle(attempt, course)
        last, pace = self.reader.now().last, self.pace
        assert handle is not None and last is not None and last.number == attempt, (attempt, last)
        return AttemptWatch(
            attempt=attempt,
            started=last.regrouped_at or last.started,
            handle=self.launcher.describe(handle) if isinstance(self.launcher, DefersAttempts) else {},
            nodes=list(plan.nodes),
            world_size=plan.world_size,
            heartbeat_dir=str(plan.heartbeat_dir),
            target_step=self.target_step,
            in_place=self.hooks.coordinator_for is not None,
            regrouped=last.generation > 1,
            wake_s=min(GROW_WAKE_S, pace.wake_every_s)
            if self.hooks.coordinator_for is not None and len(course.nodes) < len(self.ctx.nodes)
            else pace.wake_every_s,
            heartbeat_timeout_s=self.heartbeat_timeout_s,
            startup_grace_s=self.startup_grace_s,
            progress_every_s=pace.progress_every_s,
            tokens_per_step=pace.tokens_per_step,
            checkpoint_dir=pace.checkpoint_dir,
            **self._fault_counter(attempt, last.generation),
        )

    def _fault_counter(self, attempt: int, generation: int) -> dict[str, Any]:
        """What the trigger needs to wake on a report of generation ``generation`` (a rank's fault, a node's
        notice to leave): the store's address, and the counter's value now (the task already looked at it)."""
        if self.hooks.store_address is None or self.hooks.coordinator_for is None:
            return {}
        address = self.hooks.store_address(attempt)
        if not address:
            return {}
        seen = peek(self.hooks.coordinator_for(attempt).store, faulted_key(generation))
        return {"store": address, "generation": generation, "faults_seen": (seen or b"").decode(errors="replace")}

    def look(self, news: Reported) -> Observation:
        """The trigger's report, checked with a fresh look of our own, as an observation for the controller."""
        seen = self._look(news)
        state = self.reader.state
        if self.hooks.coordinator_for is not None and state.last is not None and state.unfinished:
            return self._ungrouped(state.last.number, seen)
        return seen

    def _look(self, news: Reported) -> Observation:
        now = time.time()
        state = self.reader.now()
        current = state.last if state.unfinished else None
        if current is None or news.attempt not in (None, current.number):
            return TaskStarted(now)  # news of an attempt that is over: the ledger says what comes next
        attempt = current.number
        self.ledger.append(STAGE, "attempt_event", attempt=attempt, status=news.status, message=news.message)
        plan = self.hooks.plan_for(attempt, current.course)
        beats = plan.heartbeat_dir
        handle = self.handle(attempt, current.course)
        # Look first, then judge the checkpoints: an attempt seen finished has its last one on disk.
        status = self.launcher.poll(handle) if news.status not in (SUCCEEDED, ERROR) else None
        if self.on_wake is not None:
            self.on_wake()
        if news.status == ERROR:  # the cluster did not answer; the attempt may well be running
            return LostSight(attempt, now, news.message)
        if status is None:  # the trigger saw every pod succeed
            return AttemptSucceeded(attempt, time.time(), last_step(beats))
        if news.status == HANG:
            return failed(plan, status, beats, HANG, news.suspects, news.message, self.hooks.checkpoints(), at=now)
        view = self.view(plan, current)
        coordinator = self.hooks.coordinator_for(attempt) if self.hooks.coordinator_for is not None else None
        detection = view.detect(status) if status.state != "succeeded" else None
        leaving = coordinator.leaving(current.generation) if coordinator is not None and detection is None else []
        spares = self.spares_ready(attempt, [*self.ctx.nodes, *self.ctx.spares])
        sight = look(view, Reads(status, detection, leaving, spares=spares))
        if news.status == FAILED and (sight is None or sight.what in (SUCCEEDED, SPARES)):
            # the pods went before this look: the trigger's record is the evidence
            evidence = AttemptStatus(list(news.nodes))
            return failed(plan, evidence, beats, CRASH, [], news.message, self.hooks.checkpoints(), at=now)
        if sight is not None and sight.what != SPARES:
            scan = self.hooks.checkpoints() if sight.what in (CRASH, HANG, PREEMPTED) else None
            return seen(view, plan, sight, status, scan, at=now)
        # A wake-up with nothing wrong. The task's own log gets a progress line per wake, since the
        # triggerer starts a new log file for each trigger and the earlier lines leave the UI's view.
        if self.hooks.progress_for is not None and (line := self.hooks.progress_for(plan).poll(time.time())):
            log.info("%s", line)
        if sight is not None:
            return seen(view, plan, sight, status, None, at=now)
        return Timeout(attempt, now)
