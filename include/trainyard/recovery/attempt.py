"""One attempt, blocking: record and launch it, then poll it until it succeeds, fails or loses its lineage.

``watch_attempt`` is the blocking driver's watch (``recovery.supervisor``):
it polls the launcher and the heartbeats through ``recovery.watch`` and
returns what it saw as the controller's observation. ``run_attempt`` is one
attempt without recovery (the launchers' integration tests), ending every
node of the attempt either way. ``start_attempt`` and ``append_record`` are
the ledger writes both drivers make.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainyard.backends.base import AttemptStatus, Launcher, LaunchPlan
from trainyard.errors import LineageBusy, TrainingFailed
from trainyard.events.ledger import Ledger
from trainyard.events.schema import AttemptStart
from trainyard.protocol.env import FaultDrill
from trainyard.recovery.classify import Failure
from trainyard.recovery.commands import AttemptResult, Record
from trainyard.recovery.controller import ended, succeeded
from trainyard.recovery.drills import announce_waiting
from trainyard.recovery.logwatch import resume_step
from trainyard.recovery.look import PREEMPTED, AttemptView, Reads, look, seen
from trainyard.recovery.observations import AttemptFailed as Failed
from trainyard.recovery.observations import AttemptSucceeded, Beatless, Checkpoints, LeaseLost, SparesReady
from trainyard.recovery.progress import ProgressLog
from trainyard.recovery.state import STAGE
from trainyard.recovery.watch import CRASH, HANG, STARTUP_GRACE_S

log = logging.getLogger(__name__)
POLL_CPU_SHARE = 0.05
"""The share of one core the watch aims to spend: a poll that cost ``c`` s of CPU is followed by a wait of
``c / POLL_CPU_SHARE`` where that is longer than ``poll_s``, up to ``POLL_WAIT_MAX_S``. A poll reads every
rank's beat, so its cost grows with the world size (~55-110 us a rank here, the second with 1,024 ranks'
writers beside it)."""
POLL_WAIT_MAX_S = 1.5
"""The longest wait the cost of a poll buys: an exit is seen within 2 s and a hang within the timeout and 2 s
(``bench/scale.py``); at 1,024 ranks a poll of ~110 ms then costs ~7% of a core, not 18% at 0.5 s."""


class AttemptError(TrainingFailed):
    """An attempt ended badly (``run_attempt``); what the supervisor saw, for ``classify``."""

    def __init__(self, message: str, failure: Failure, detected_at: float):
        self.failure, self.detected_at = failure, detected_at
        super().__init__(message, kind=failure.trigger, evidence="")


def start_attempt(launcher: Launcher, plan: LaunchPlan, ledger: Ledger, warm: list[str] | None = None,
                  outside: list[FaultDrill] | None = None) -> Any:  # fmt: skip
    """Record the attempt and launch it; the heartbeat folder exists before any rank (or watcher) looks.
    ``warm``: spares started outside its group; ``outside``: its drills acted out from outside the processes
    (one whose node is outside the group is refused by its ``drills.Actor``); the script's own drills on such a
    node wait for it (``drill_waiting``)."""
    if plan.train_env.heartbeat_dir is not None:
        plan.train_env.heartbeat_dir.mkdir(parents=True, exist_ok=True)
    env = plan.train_env
    start = AttemptStart(attempt=plan.attempt, nodes=plan.nodes, world_size=plan.world_size,
                         micro_batch=env.micro_batch, resume_from=env.resume_from,
                         resume_step=resume_step(env.resume_from, env.checkpoint_dir))  # fmt: skip
    ledger.append(STAGE, start.event, **start.fields())
    announce_waiting(ledger, plan.attempt, [d for d in env.drills if d not in (outside or [])], plan.nodes, warm or [])
    return launcher.launch(plan)


def watch_attempt(
    launcher: Launcher,
    handle: Any,
    plan: LaunchPlan,
    view: AttemptView,
    poll_s: float = 0.5,
    progress: ProgressLog | None = None,
    keep_alive: Callable[[], None] | None = None,
    checkpoints: Callable[[str], Checkpoints] | None = None,
    ready_spares: Callable[[AttemptStatus], list[str]] | None = None,
    pause: Callable[[float], None] = time.sleep,
    each_poll: Callable[[], None] | None = None,
    leaving: Callable[[], list[str]] | None = None,
) -> AttemptSucceeded | Failed | LeaseLost | SparesReady | Beatless:
    """Poll the attempt until it succeeds, fails or the run loses its lineage: what was seen.

    ``view``: the attempt as known before looking (its group, its start, the spec's watch settings); each poll
    reads, then ``look.look`` decides what it saw (the one rule every driver shares).
    ``progress`` paces the progress lines this loop logs (the train task's log is all a person watching sees).
    ``keep_alive`` is called at every poll (the run's lease on its lineage); ``checkpoints`` describes the
    hot checkpoints for the policy when a failure is seen (given what was seen). ``ready_spares`` (an attempt that
    groups on the store): the nodes outside the group that wait ready to join it, from the launcher's full status;
    any ends the watch. Only the plan's nodes, the current group, are watched for success and failure then.
    ``pause`` waits between polls (at most ``poll_s``; an attempt on the store wakes on a fault report).
    ``each_poll`` acts before each poll (nodes due to start once their generation formed). ``leaving`` (an
    attempt on the store): the group's nodes that reported they leave on notice; any is a ``preempted`` failure
    to regroup without them, seen before their processes end.
    """
    while True:
        cpu = time.thread_time()
        if each_poll is not None:
            each_poll()
        status = launcher.poll(handle)
        spares = ready_spares(status) if ready_spares is not None else []
        if view.regrouped or ready_spares is not None:  # spares, and nodes left out (killed, or exited)
            status = AttemptStatus([n for n in status.nodes if n.slot in plan.nodes])
        detection = view.detect(status) if status.state != "succeeded" else None
        logs = progress.logs if progress is not None else None  # a beatless script's: its silence is a hang
        silence = logs.silence(time.time()) if logs is not None and detection is None else None
        reads = Reads(status, detection, leaving() if leaving is not None and detection is None else [], spares=spares,
                      log=silence)  # fmt: skip
        if (sight := look(view, reads)) is not None:
            at = time.time()
            if progress is not None:
                progress.last_look(at)
            scan = (
                checkpoints(sight.what) if checkpoints is not None and sight.what in (CRASH, HANG, PREEMPTED) else None
            )
            return seen(view, plan, sight, status, scan, at=at)
        if progress is not None and (line := progress.poll(time.time())):
            log.info("%s", line)
        if (lost := kept(keep_alive)) is not None:
            return lost
        pause(max(poll_s, min((time.thread_time() - cpu) / POLL_CPU_SHARE, POLL_WAIT_MAX_S)))


def kept(keep_alive: Callable[[], None] | None) -> LeaseLost | None:
    """Renew the run's lease on its lineage: ``LeaseLost`` when another run holds it now, else None."""
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
    """One attempt, no recovery: launch ``plan`` and block until it succeeds; ``AttemptError`` when it does not,
    ``LineageBusy`` when ``keep_alive`` says the run lost its lineage. Every process ends either way."""
    started = time.time()
    handle = start_attempt(launcher, plan, ledger)
    try:
        view = AttemptView.of(plan, started, heartbeat_timeout_s, heartbeat_dir, grace_s=startup_grace_s)
        seen = watch_attempt(launcher, handle, plan, view, poll_s, progress, keep_alive)
    finally:
        launcher.cancel(handle)  # a no-op after success; ends every survivor after a failure
    if isinstance(seen, LeaseLost):
        raise LineageBusy(seen.message)
    if isinstance(seen, Failed):
        record = ended(seen)
        append_record(ledger, record)
        raise AttemptError(record.log, seen.failure, seen.at)
    assert isinstance(seen, AttemptSucceeded)  # no ``ready_spares``: no spares to report
    result, record = succeeded(plan.attempt, started, seen)
    append_record(ledger, record)
    return result


def append_record(ledger: Ledger, record: Record) -> None:
    """Write a controller ``Record`` to the ledger; its log line, if any, goes to the task log too."""
    ledger.append(STAGE, record.event, **record.fields)
    if record.log:
        log.warning("%s", record.log)
