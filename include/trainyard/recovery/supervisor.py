"""The blocking driver: run training attempts until one succeeds or the policy says stop.

The controller (``recovery.controller``, pure) decides; this module watches
and carries its commands out, blocking: the local backend and the tests.
One attempt: launch, then watch exits and heartbeats. A node whose agent
exits non-zero has crashed; a rank whose heartbeat is older than the timeout
(or that never beat within it) is hung. Either becomes an observation with
its evidence (node statuses, log tails, the hot checkpoints) for ``step``,
which ends every node of the attempt at once -- survivors of a dead
collective would otherwise wait out gloo's timeout --, classifies, decides
and records. Every decision is a ledger event, so a retried Airflow task
carries on from the ledger instead of starting over.

``Driver`` carries out the commands both drivers share (record, cancel, roll
back, exclude, launch); the deferred driver (``recovery.deferred``) waits its
own way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from trainyard.atomic import open_regular
from trainyard.backends.base import AttemptStatus, Launcher, LaunchPlan, RegroupingLauncher
from trainyard.errors import LineageBusy, TrainingFailed, TransientError
from trainyard.events.ledger import Ledger
from trainyard.events.schema import AttemptStart
from trainyard.protocol.coordstore import Coordinator, Generation
from trainyard.protocol.heartbeat import read_heartbeats
from trainyard.protocol.records import FailureRecord, failure_records
from trainyard.recovery.classify import Failure
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
from trainyard.recovery.controller import ended, grown_world, node_failures, step, succeeded
from trainyard.recovery.observations import AttemptFailed as Failed
from trainyard.recovery.observations import (
    AttemptSucceeded,
    BackoffOver,
    Checkpoints,
    Context,
    LeaseLost,
    Observation,
    SparesReady,
    TaskStarted,
)
from trainyard.recovery.progress import ProgressLog
from trainyard.recovery.state import STAGE, Course, TrainState

__all__ = ["AttemptResult", "Course", "supervise"]  # AttemptResult and Course moved to the controller
log = logging.getLogger(__name__)
TAIL_LINES = 50
T = TypeVar("T")


class AttemptFailed(TrainingFailed):
    """An attempt ended badly (``run_attempt``); what the supervisor saw, for ``classify``."""

    def __init__(self, message: str, failure: Failure, detected_at: float):
        self.failure, self.detected_at = failure, detected_at
        super().__init__(message, kind=failure.trigger, evidence="")


STARTUP_GRACE_S = 120.0  # interpreter, torch import, rendezvous and data before a rank's first step


def group_beats(beats: dict[str, dict[str, Any]], members: list[str]) -> dict[str, dict[str, Any]]:
    """The beats of a regrouped attempt's current group: rank ``k`` is ``members[k]``'s, or not yet there.

    A regroup renumbers the ranks: a file left by the node that held a rank before (a dead node's last
    beat, a survivor's beat under its old number) says nothing about the group that runs now."""
    return {
        rank: beat
        for rank, beat in beats.items()
        if (k := _rank_number(rank)) is not None and k < len(members) and beat.get("node") == members[k]
    }


def _rank_number(name: str) -> int | None:
    number = name.removeprefix("rank-")
    return int(number) if number.isdigit() else None


def stale_ranks(
    beats: dict[str, dict[str, Any]],
    expected: int,
    started: float,
    now: float,
    timeout_s: float,
    grace_s: float = STARTUP_GRACE_S,
) -> list[str]:
    """Ranks without progress for longer than ``timeout_s``; a rank that never beat gets ``grace_s`` to start."""
    stale = [rank for rank, b in beats.items() if b.get("status") != "finished" and now - b["time"] > timeout_s]
    if len(beats) < expected and now - started > first_beat_s(timeout_s, grace_s):
        stale += [f"rank-{r}" for r in range(expected) if f"rank-{r}" not in beats]
    return stale


def first_beat_s(timeout_s: float, grace_s: float) -> float:
    """How long after the start a rank may be without its first heartbeat: the start-up grace, or the
    timeout where that is longer (a rank that started is never held to less than one that beat)."""
    return max(timeout_s, grace_s)


def silent_ranks(directory: Path, ranks: list[str], now: float, after_s: float = 3.0) -> list[str]:
    """Of ``ranks``, those whose liveness pulse (``rank-N.alive``, touched every second) stopped."""
    silent = []
    for rank in ranks:
        try:
            if now - (directory / f"{rank}.alive").stat().st_mtime > after_s:
                silent.append(rank)
        except FileNotFoundError:
            silent.append(rank)
    return silent


def tail(path: str, lines: int = TAIL_LINES) -> str:
    try:  # a node log training code replaced with a link to a secret is not quoted into the ledger
        with open_regular(Path(path)) as fh:
            return "\n".join(fh.read().decode(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def start_attempt(launcher: Launcher, plan: LaunchPlan, ledger: Ledger) -> Any:
    """Record the attempt and launch it; the heartbeat folder exists before any rank (or watcher) looks."""
    if plan.train_env.heartbeat_dir is not None:
        plan.train_env.heartbeat_dir.mkdir(parents=True, exist_ok=True)
    env = plan.train_env
    start = AttemptStart(attempt=plan.attempt, nodes=plan.nodes, world_size=plan.world_size,
                         micro_batch=env.micro_batch, resume_from=env.resume_from)  # fmt: skip
    ledger.append(STAGE, start.event, **start.fields())
    return launcher.launch(plan)


def detect(
    status: AttemptStatus,
    heartbeat_dir: Path,
    world_size: int,
    started: float,
    timeout_s: float,
    grace_s: float = STARTUP_GRACE_S,
    members: list[str] | None = None,
) -> tuple[str, list[str], str] | None:
    """What is wrong with a running attempt, if anything: ``(trigger, suspect nodes, reason)``.

    A failed node is a crash. A rank without progress past the timeout is a
    hang; of those, ranks whose liveness pulse stopped are the suspects --
    ranks stuck behind a hung peer still pulse.
    """
    if status.state == "failed":
        return "crash", [], _crash_reason(status)
    beats = read_heartbeats(heartbeat_dir)
    if members is not None:  # regrouped at ``started``: every rank of the group has a full timeout from then
        beats = {r: {**b, "time": max(b["time"], started)} for r, b in group_beats(beats, members).items()}
    now = time.time()
    stale = stale_ranks(beats, world_size, started, now, timeout_s, grace_s)
    if not stale:
        return None
    # Every rank still at work is a suspect, not only those past the timeout: the ranks waiting on a hung
    # peer went quiet at the same step, and the first poll past the timeout may see only one of them stale.
    # The pulse tells them apart (waiting ranks pulse; a stopped or frozen one does not).
    working = sorted({*stale, *(r for r, b in beats.items() if b.get("status") != "finished")})
    silent = silent_ranks(heartbeat_dir, working, now)
    # Hosts, as everywhere recovery names nodes (a beat without one: a runtime older than the host field).
    nodes = sorted(
        {str(beats[r].get("host") or beats[r]["node"]) for r in silent if r in beats and beats[r].get("node")}
    )
    # A rank that never beat is not one that stopped: say which it is (pods that never started look so).
    stopped, never = [r for r in stale if r in beats], [r for r in stale if r not in beats]
    said = [f"no progress for {timeout_s:.0f} s from {', '.join(stopped)}"] if stopped else []
    if never:
        said.append(
            f"no first heartbeat {first_beat_s(timeout_s, grace_s):.0f} s after the start from {', '.join(never)}"
        )
    return "hang", nodes, f"{'; '.join(said)}; no pulse from {', '.join(silent) or 'none'}"


def host_records(heartbeat_dir: Path, status: AttemptStatus) -> list[FailureRecord]:
    """The ranks' failure records, each renamed to the host its slot ran on (what recovery blames).

    A record names its node as the process saw it (``TRAINYARD_NODE``: the slot of a local node, the host
    of a pod); where a slot really ran is the launcher's word, not the record's (training code is untrusted)."""
    hosts = {n.slot: n.where for n in status.nodes} | {n.where: n.where for n in status.nodes}
    return [replace(r, node=hosts[r.node]) for r in failure_records(heartbeat_dir, list(hosts))]


def last_step(heartbeat_dir: Path) -> int | None:
    """The heartbeats' newest step (the rate-bounded step events may not have reached it)."""
    return max((b.get("step", 0) for b in read_heartbeats(heartbeat_dir).values()), default=None)


def failed(
    plan: LaunchPlan,
    status: AttemptStatus,
    heartbeat_dir: Path,
    trigger: str,
    suspects: list[str],
    reason: str,
    checkpoints: Checkpoints | None = None,
    *,
    at: float,
) -> Failed:
    """The observation of a failed attempt, with its evidence: node statuses, their log tails, the last step.

    ``at``: when the failure was seen, before any evidence was gathered."""
    tails = {n.where: tail(n.log) for n in status.nodes}
    failure = Failure(
        attempt=plan.attempt,
        trigger=trigger,
        stale_nodes=list(suspects),
        last_step=last_step(heartbeat_dir),
        nodes=node_failures(status.nodes, tails),
        records=host_records(heartbeat_dir, status),
    )
    return Failed(plan.attempt, at, failure, reason, checkpoints or Checkpoints())


def watch_attempt(
    launcher: Launcher,
    handle: Any,
    plan: LaunchPlan,
    started: float,
    heartbeat_dir: Path,
    heartbeat_timeout_s: float,
    poll_s: float = 0.5,
    startup_grace_s: float = STARTUP_GRACE_S,
    progress: ProgressLog | None = None,
    keep_alive: Callable[[], None] | None = None,
    checkpoints: Callable[[], Checkpoints] | None = None,
    regrouped: bool = False,
    ready_spares: Callable[[AttemptStatus], list[str]] | None = None,
    pause: Callable[[float], None] = time.sleep,
    each_poll: Callable[[], None] | None = None,
) -> AttemptSucceeded | Failed | LeaseLost | SparesReady:
    """Poll the attempt until it succeeds, fails or the run loses its lineage: what was seen.

    ``progress`` paces the progress lines this loop logs (the train task's log is all a person watching sees).
    ``keep_alive`` is called at every poll (the run's lease on its lineage); ``checkpoints`` describes the
    hot checkpoints for the policy when a failure is seen. ``regrouped``: the attempt regrouped in place
    (``started`` is then the regroup's time). ``ready_spares`` (an attempt that groups on the store): the
    nodes outside the group that wait ready to join it, from the launcher's full status; any ends the
    watch. Only the plan's nodes, the current group, are watched for success and failure then.
    ``pause`` waits between polls (at most ``poll_s``; an attempt on the store wakes on a fault report).
    ``each_poll`` acts before each poll (nodes due to start once their generation formed).
    """
    members = list(plan.nodes) if regrouped else None
    while True:
        if each_poll is not None:
            each_poll()
        status = launcher.poll(handle)
        if ready_spares is not None and (ready := ready_spares(status)):
            return SparesReady(plan.attempt, time.time(), ready)
        if members is not None or ready_spares is not None:  # spares, and nodes left out (killed, or exited)
            status = AttemptStatus([n for n in status.nodes if n.slot in plan.nodes])
        if status.state == "succeeded":
            return AttemptSucceeded(plan.attempt, time.time(), last_step(heartbeat_dir))
        problem = detect(status, heartbeat_dir, plan.world_size, started, heartbeat_timeout_s, startup_grace_s, members)
        if problem:
            at = time.time()
            return failed(plan, status, heartbeat_dir, *problem, checkpoints() if checkpoints else None, at=at)
        if progress is not None and (line := progress.poll(time.time())):
            log.info("%s", line)
        if (lost := _kept(keep_alive)) is not None:
            return lost
        pause(poll_s)


def _kept(keep_alive: Callable[[], None] | None) -> LeaseLost | None:
    if keep_alive is None:
        return None
    try:
        keep_alive()
    except LineageBusy as exc:
        return LeaseLost(time.time(), str(exc))
    return None


def run_attempt(
    launcher: Launcher,
    plan: LaunchPlan,
    heartbeat_dir: Path,
    heartbeat_timeout_s: float,
    ledger: Ledger,
    poll_s: float = 0.5,
    startup_grace_s: float = STARTUP_GRACE_S,
    progress: ProgressLog | None = None,
    keep_alive: Callable[[], None] | None = None,
) -> AttemptResult:
    """One attempt, no recovery: launch ``plan`` and block until it succeeds; ``AttemptFailed`` when it does not,
    ``LineageBusy`` when ``keep_alive`` says the run lost its lineage. Every process ends either way."""
    started = time.time()
    handle = start_attempt(launcher, plan, ledger)
    try:
        seen = watch_attempt(
            launcher,
            handle,
            plan,
            started,
            heartbeat_dir,
            heartbeat_timeout_s,
            poll_s,
            startup_grace_s,
            progress,
            keep_alive,
        )
    finally:
        launcher.cancel(handle)  # a no-op after success; ends every survivor after a failure
    if isinstance(seen, LeaseLost):
        raise LineageBusy(seen.message)
    if isinstance(seen, Failed):
        record = ended(seen)
        _append(ledger, record)
        raise AttemptFailed(record.log, seen.failure, seen.at)
    assert isinstance(seen, AttemptSucceeded)  # no ``ready_spares``: no spares to report
    result, record = succeeded(plan.attempt, started, seen)
    _append(ledger, record)
    return result


def _append(ledger: Ledger, record: Record) -> None:
    ledger.append(STAGE, record.event, **record.fields)
    if record.log:
        log.warning("%s", record.log)


def _crash_reason(status: AttemptStatus) -> str:
    return "; ".join(
        f"{n.where} exited {n.exit_code}" + (f" ({n.reason})" if n.reason else "") for n in status.failed()
    )


# ---------------------------------------------------------------- drivers


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
    coordinator_for: Callable[[int], Coordinator] | None = None
    """An attempt's side of the coordination store its ranks group on (None: the attempt cannot regroup)."""


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
                _append(self.ledger, command)
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
                self.handles[attempt] = start_attempt(self.launcher, plan, self.ledger)
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

    def commands(self, observation: Observation) -> list[Command]:
        """Step, and carry out every command but the last (the terminal one, returned alone)."""
        *steps, last = step(self.reader.now(), observation, self.ctx)
        for command in steps:
            self.execute(command)
        return [last]


def failure_error(fail: Fail) -> Exception:
    """The error a ``Fail`` ends the train task with: named by what to do about it (DESIGN rule 9)."""
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
    ) -> None:
        super().__init__(launcher, reader, ctx, hooks)
        self.heartbeat_timeout_s, self.poll_s, self.keep_alive = heartbeat_timeout_s, poll_s, keep_alive

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
        return watch_attempt(
            self.launcher,
            handle,
            plan,
            last.regrouped_at or last.started,
            plan.heartbeat_dir,
            self.heartbeat_timeout_s,
            self.poll_s,
            progress=progress,
            keep_alive=self.keep_alive,
            checkpoints=lambda: self.end_then_scan(attempt, handle),
            regrouped=last.generation > 1,
            ready_spares=self._ready_spares(attempt, course) if on_store else None,
            pause=self._pause(attempt, last.generation) if on_store else time.sleep,
            each_poll=(lambda: self._start_due(attempt)) if on_store else None,
        )

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
        assert self.hooks.coordinator_for is not None
        coordinator = self.hooks.coordinator_for(attempt)
        current = self.reader.now().last
        assert current is not None

        def ready(status: AttemptStatus) -> list[str]:
            # Not before the group formed: a member that read the older generation would form it alone
            if len(course.nodes) >= len(self.ctx.nodes) or not coordinator.formed(current.generation):
                return []
            waiting = [n.slot for n in status.nodes if n.state == "running" and n.slot not in course.nodes]
            spares = coordinator.spares_ready(waiting) if waiting else []
            return spares if spares and grown_world(current, self.ctx, spares) is not None else []

        return ready

    def end_then_scan(self, attempt: int, handle: Any) -> Checkpoints:
        """A failure was seen: end the survivors first (they would wait out the dead collective's timeout,
        spinning on the cores the scan needs), then describe the checkpoints for the policy.

        Survivors that can regroup are kept: they wait on the coordination store, idle, for the decision."""
        if self.hooks.coordinator_for is None:
            self.launcher.cancel(handle)
            self.ended.add(attempt)
        return self.hooks.checkpoints()

    def wait(self, at: float, slice_s: float = 5.0) -> Observation:
        """Sleep until ``at`` (a retry's backoff, up to an hour), renewing the lease every ``slice_s``."""
        while (left := at - time.time()) > 0:
            if (lost := _kept(self.keep_alive)) is not None:
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
) -> AttemptResult:
    """Attempts until success; ``TrainingFailed`` (with the kind) once the policy says fail.

    Carries on from the ledger (a retried task): see ``controller.carry_on``.
    ``keep_alive`` is called at every poll and backoff slice; ``LineageBusy``
    from it ends the attempt and the task.
    """
    return Supervisor(launcher, StateReader(ledger), ctx, hooks, heartbeat_timeout_s, poll_s, keep_alive).run()
