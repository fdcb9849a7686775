"""The supervisor: run training attempts until one succeeds or the policy says stop.

One attempt: launch, then watch exits and heartbeats. A node whose agent
exits non-zero has crashed; a rank whose heartbeat is older than the timeout
(or that never beat within it) is hung. On any failure every node of the
attempt is ended at once -- survivors of a dead collective would otherwise
wait out gloo's timeout -- and the failure is classified, a decision taken
(``recovery.policy``, pure) and carried out: retry, scale down, roll back or
fail. Every step is a ledger event, so a retried Airflow task carries on
from the ledger instead of starting over.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainyard.atomic import open_regular
from trainyard.errors import TrainingFailed
from trainyard.launch.base import AttemptStatus, Launcher, LaunchPlan
from trainyard.ledger import Ledger
from trainyard.recovery.classify import Classified, Failure, NodeFailure, classify
from trainyard.recovery.policy import AttemptRecord, Fail, Rollback, ScaleDown, Situation, decide
from trainyard.spec import RecoverySpec

if TYPE_CHECKING:  # progress reads heartbeats with this module's reader
    from trainyard.recovery.progress import ProgressLog

log = logging.getLogger(__name__)
TAIL_LINES = 50


@dataclass(frozen=True)
class AttemptResult:
    attempt: int
    seconds: float
    last_step: int | None


class AttemptFailed(TrainingFailed):
    """An attempt ended badly; what the supervisor saw, for ``classify``."""

    def __init__(self, message: str, failure: Failure, detected_at: float):
        self.failure, self.detected_at = failure, detected_at
        super().__init__(message, kind=failure.trigger, evidence="")


def read_heartbeats(directory: Path) -> dict[str, dict[str, Any]]:
    beats = {}
    for path in sorted(directory.glob("rank-*.json")):
        try:
            beats[path.stem] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # replaced between glob and read; the next poll sees it
    return beats


STARTUP_GRACE_S = 120.0  # interpreter, torch import, rendezvous and data before a rank's first step


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
    if len(beats) < expected and now - started > max(timeout_s, grace_s):
        stale += [f"rank-{r}" for r in range(expected) if f"rank-{r}" not in beats]
    return stale


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
    if "TRAINYARD_HEARTBEAT_DIR" in plan.env:
        Path(plan.env["TRAINYARD_HEARTBEAT_DIR"]).mkdir(parents=True, exist_ok=True)
    ledger.append(
        "train",
        "attempt_start",
        attempt=plan.attempt,
        nodes=plan.nodes,
        world_size=plan.world_size,
        micro_batch=plan.env.get("TRAINYARD_MICRO_BATCH"),
        resume_from=plan.env.get("TRAINYARD_RESUME_FROM"),
    )
    return launcher.launch(plan)


def detect(
    status: AttemptStatus,
    heartbeat_dir: Path,
    world_size: int,
    started: float,
    timeout_s: float,
    grace_s: float = STARTUP_GRACE_S,
) -> tuple[str, list[str], str] | None:
    """What is wrong with a running attempt, if anything: ``(trigger, suspect nodes, reason)``.

    A failed node is a crash. A rank without progress past the timeout is a
    hang; of those, ranks whose liveness pulse stopped are the suspects --
    ranks stuck behind a hung peer still pulse.
    """
    if status.state == "failed":
        return "crash", [], _crash_reason(status)
    beats = read_heartbeats(heartbeat_dir)
    now = time.time()
    stale = stale_ranks(beats, world_size, started, now, timeout_s, grace_s)
    if not stale:
        return None
    silent = silent_ranks(heartbeat_dir, stale, now)
    nodes = sorted({beats[r]["node"] for r in silent if r in beats and beats[r].get("node")})
    return (
        "hang",
        nodes,
        (f"no progress for {timeout_s:.0f} s from {', '.join(stale)}; no pulse from {', '.join(silent) or 'none'}"),
    )


def attempt_failed(
    plan: LaunchPlan,
    status: AttemptStatus,
    ledger: Ledger,
    heartbeat_dir: Path,
    trigger: str,
    suspects: list[str],
    reason: str,
) -> AttemptFailed:
    """Record the end of a failed attempt; the returned error carries what ``classify`` needs."""
    detected_at = time.time()
    steps = [b.get("step", 0) for b in read_heartbeats(heartbeat_dir).values()]
    failure = Failure(
        attempt=plan.attempt,
        trigger=trigger,
        stale_nodes=suspects,
        last_step=max(steps, default=None),
        nodes=[NodeFailure(n.where, n.state, n.exit_code, n.reason, tail(n.log)) for n in status.nodes],  # hosts
    )
    # last_step: the heartbeats' latest step, which the rate-bounded step events may not have reached.
    ledger.append(
        "train",
        "attempt_end",
        attempt=plan.attempt,
        state="failed",
        trigger=trigger,
        reason=reason,
        last_step=failure.last_step,
    )
    log.error("attempt %d failed (%s): %s", plan.attempt, trigger, reason)
    return AttemptFailed(f"attempt {plan.attempt} failed ({trigger}): {reason}", failure, detected_at)


def attempt_succeeded(plan: LaunchPlan, started: float, heartbeat_dir: Path, ledger: Ledger) -> AttemptResult:
    beats = read_heartbeats(heartbeat_dir)
    last = max((b.get("step", 0) for b in beats.values()), default=None)
    result = AttemptResult(plan.attempt, round(time.time() - started, 3), last)
    ledger.append(
        "train", "attempt_end", attempt=plan.attempt, state="succeeded", seconds=result.seconds, last_step=last
    )
    return result


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
    """Launch ``plan`` and block until it succeeds; raise ``AttemptFailed`` when it does not.

    ``progress`` paces the progress lines this loop logs (the train task's log is all a person watching sees).
    ``keep_alive`` is called at every poll (the run's lease on its lineage); whatever it raises ends the attempt.
    """
    started = time.time()
    handle = start_attempt(launcher, plan, ledger)
    try:
        while True:
            status = launcher.poll(handle)
            if status.state == "succeeded":
                break
            problem = detect(status, heartbeat_dir, plan.world_size, started, heartbeat_timeout_s, startup_grace_s)
            if problem:
                raise attempt_failed(plan, status, ledger, heartbeat_dir, *problem)
            if progress is not None and (line := progress.poll(time.time())):
                log.info("%s", line)
            if keep_alive is not None:
                keep_alive()
            time.sleep(poll_s)
    finally:
        launcher.cancel(handle)  # a no-op after success; ends every survivor after a failure
    return attempt_succeeded(plan, started, heartbeat_dir, ledger)


def _crash_reason(status: AttemptStatus) -> str:
    return "; ".join(
        f"{n.where} exited {n.exit_code}" + (f" ({n.reason})" if n.reason else "") for n in status.failed()
    )


@dataclass
class Course:
    """What the next attempt runs with; decisions change it."""

    nodes: list[str]
    micro_batch: int
    resume_from: str
    """``latest`` or a checkpoint path (a rollback target, or the run's starting point)."""


def history(ledger: Ledger) -> list[AttemptRecord]:
    """The decisions taken so far, from the ledger: a resumed or retried task sees them all."""
    return [AttemptRecord(e["attempt"], e["kind"], e["action"], e["nodes"]) for e in ledger.events("train", "decision")]


def recover(
    launcher: Launcher,
    failed: AttemptFailed,
    course: Course,
    spares: list[str],
    situation: Callable[[Course, list[str]], Situation],
    recovery: RecoverySpec,
    ledger: Ledger,
    rollback_to: Callable[[int], str],
) -> tuple[Course, float]:
    """Classify the failure, decide, record both, and carry the decision out.

    Returns the next attempt's course and how long to wait before it; raises
    ``TrainingFailed`` (with the kind and the evidence) when the policy says fail.
    ``spares`` loses the spares a scale-down takes; the nodes it leaves out are
    marked through the launcher, so no later attempt lands on them.
    """
    attempt = failed.failure.attempt
    found = classify(failed.failure)
    ledger.append(
        "train",
        "failure_classified",
        attempt=attempt,
        kind=found.kind,
        evidence=found.evidence,
        culprits=list(found.culprits),
        detected_at=failed.detected_at,
    )
    decision = decide(history(ledger), found, situation(course, spares), recovery)
    ledger.append(
        "train",
        "decision",
        attempt=attempt,
        kind=found.kind,
        action=decision.action,
        nodes=course.nodes,
        reason=getattr(decision, "reason", ""),
        **_changes(decision),
    )
    log.warning("attempt %d: %s -> %s: %s", attempt, found.kind, decision.action, getattr(decision, "reason", ""))
    if isinstance(decision, Fail):
        evidence = _evidence(found, failed)
        log.error("training failed: %s\n%s", decision.reason, evidence)  # the traceback, in the task log
        raise TrainingFailed(decision.reason, kind=found.kind, evidence=evidence) from None
    after = _apply(decision, course, spares, rollback_to)
    dropped = [node for node in course.nodes if node not in after.nodes]
    if dropped and (marked := launcher.exclude(dropped)):
        ledger.append("train", "nodes_marked", attempt=attempt, nodes=marked, reason=found.kind)
    return after, getattr(decision, "delay_s", 0.0)


def supervise(
    launcher: Launcher,
    plan_for: Callable[[int, Course], LaunchPlan],
    course: Course,
    spares: list[str],
    situation: Callable[[Course, list[str]], Situation],
    recovery: RecoverySpec,
    ledger: Ledger,
    heartbeat_timeout_s: float,
    rollback_to: Callable[[int], str],
    first_attempt: int = 1,
    poll_s: float = 0.5,
    progress_for: Callable[[LaunchPlan], ProgressLog] | None = None,
    keep_alive: Callable[[], None] | None = None,
) -> AttemptResult:
    """Attempts until success; ``TrainingFailed`` (with the kind) once the policy says fail.

    ``plan_for(attempt, course)`` builds each attempt's plan; ``situation``
    describes the world for the policy; ``rollback_to(step)`` prepares a
    rollback and returns the checkpoint path to resume from; ``progress_for(plan)``
    paces each attempt's progress lines (None: none logged); ``keep_alive`` is
    called at every poll and pause (see ``run_attempt``).
    """
    attempt = first_attempt
    while True:
        plan = plan_for(attempt, course)
        try:
            return run_attempt(
                launcher,
                plan,
                Path(plan.env["TRAINYARD_HEARTBEAT_DIR"]),
                heartbeat_timeout_s,
                ledger,
                poll_s,
                progress=progress_for(plan) if progress_for else None,
                keep_alive=keep_alive,
            )
        except AttemptFailed as failed:
            course, delay = recover(launcher, failed, course, spares, situation, recovery, ledger, rollback_to)
            pause(delay, keep_alive)
            attempt += 1


def pause(seconds: float, keep_alive: Callable[[], None] | None = None, slice_s: float = 5.0) -> None:
    """Sleep ``seconds`` (a retry's backoff, up to an hour), calling ``keep_alive`` every ``slice_s``."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        if keep_alive is not None:
            keep_alive()
        time.sleep(min(left, slice_s))


def _changes(decision: Any) -> dict[str, Any]:
    fields = ("delay_s", "micro_batch", "to_step")
    out = {f: getattr(decision, f) for f in fields if getattr(decision, f, None) is not None}
    if isinstance(decision, ScaleDown):
        out["new_nodes"] = list(decision.nodes)
    return out


def _apply(decision: Any, course: Course, spares: list[str], rollback_to: Callable[[int], str]) -> Course:
    if isinstance(decision, ScaleDown):
        for node in decision.nodes:
            if node in spares:
                spares.remove(node)  # a spare that joins is no longer spare
        return replace(course, nodes=list(decision.nodes), micro_batch=decision.micro_batch, resume_from="latest")
    if isinstance(decision, Rollback):
        return replace(course, resume_from=rollback_to(decision.to_step))
    return replace(course, micro_batch=decision.micro_batch or course.micro_batch, resume_from="latest")


def _evidence(found: Classified, failed: AttemptFailed) -> str:
    tails = "\n".join(f"--- {n.node}\n{n.log_tail}" for n in failed.failure.nodes if n.log_tail)
    return f"{found.evidence}\n{tails}"
