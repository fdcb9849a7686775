"""One look at a running attempt, for every driver: ``AttemptView``, ``Reads``, ``look`` and ``seen``.

The blocking watch (``recovery.attempt``), the deferred driver (``recovery.deferred``) and the attempt
trigger (``airflow.triggers``) each read what they can reach (the launcher's status, the heartbeats through
``AttemptView.detect``, the store's word) into ``Reads``; ``look`` (pure) decides what that shows, in one
order for all three; the driver carries it out (``seen`` turns it into the controller's observation, with
its evidence). What is known of the attempt before looking (its nodes, its start, the spec's watch settings)
is the ``AttemptView``, built once. An attempt trigger, whatever its backend, fires with ``report``'s payload,
which the task reads back with ``reported``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from trainyard.backends.base import AttemptStatus, LaunchPlan, status_from_dicts, status_to_dicts
from trainyard.recovery.logwatch import LogSilence
from trainyard.recovery.observations import (
    AttemptFailed,
    AttemptSucceeded,
    Beatless,
    Checkpoints,
    Reported,
    SparesReady,
)
from trainyard.recovery.watch import BEATLESS, CRASH, HANG, STARTUP_GRACE_S, Detection, detect, failed, last_step

SUCCEEDED: Final = "succeeded"
PREEMPTED: Final = "preempted"
FAULT: Final = "fault"
SPARES: Final = "spares"
"""What a look can see besides a ``Detection``'s ``CRASH``, ``HANG`` and ``BEATLESS`` (``Sight.what``)."""
FAILED: Final = "failed"
TIMEOUT: Final = "timeout"
ERROR: Final = "error"
REPORTS = (SUCCEEDED, FAILED, HANG, TIMEOUT, ERROR, FAULT)
"""The statuses an attempt trigger reports (``Reported.status``): what its look saw (a crash is ``FAILED``),
or that it waited its time out, or that the cluster did not answer."""
AS_REPORTED = {SUCCEEDED: SUCCEEDED, CRASH: FAILED, HANG: HANG, FAULT: FAULT}
"""A trigger's sight (``Sight.what``) as the status it reports."""


def report(
    status: str, attempt: int, nodes: AttemptStatus | None, message: str, suspects: Sequence[str] = (), **extra: Any
) -> dict[str, Any]:
    """An attempt trigger's event payload, whatever its backend (``extra``: what else its log should show, which
    the task ignores); ``reported`` reads it back."""
    return {**extra, "status": status, "attempt": attempt, "nodes": status_to_dicts(nodes) if nodes is not None else [],
            "suspects": list(suspects), "message": message}  # fmt: skip


def reported(payload: Mapping[str, Any]) -> Reported:
    """An attempt trigger's event payload, typed for the deferred driver (the one place that reads it)."""
    status = payload.get("status")
    if status not in REPORTS:
        raise ValueError(f"attempt trigger event: status {status!r} is not one of {', '.join(REPORTS)}")
    attempt = payload.get("attempt")
    return Reported(
        status=status,
        message=str(payload.get("message", "")),
        attempt=int(attempt) if attempt else None,  # 0: a trigger not told its attempt
        nodes=status_from_dicts(payload.get("nodes") or []).nodes,
        suspects=[str(n) for n in payload.get("suspects") or []],
    )


@dataclass(frozen=True)
class AttemptView:
    """What is known of an attempt before looking at it: built once, from its plan, the ledger and the spec."""

    attempt: int
    nodes: list[str]
    """The current group's nodes (a regrouped attempt's members)."""
    world_size: int
    heartbeat_dir: Path
    started: float
    """The launch, or the last regroup's time: every rank of the group has a full timeout from then."""
    timeout_s: float
    """``training.heartbeat_timeout_s``."""
    grace_s: float = STARTUP_GRACE_S
    """``training.startup_grace_s``."""
    regrouped: bool = False
    beatless_said: bool = True
    """The run said already that hang detection is off (False: a look may find the attempt ``BEATLESS``)."""
    beats_known: bool = False
    """An earlier attempt of the run beat: an attempt without a beat is stuck, not beatless."""

    @classmethod
    def of(
        cls, plan: LaunchPlan, started: float, timeout_s: float, heartbeat_dir: Path | None = None, **settings: Any
    ) -> AttemptView:
        """The view of ``plan``'s attempt (``heartbeat_dir``: where its beats lie, by default the plan's)."""
        folder = plan.heartbeat_dir if heartbeat_dir is None else heartbeat_dir
        return cls(plan.attempt, list(plan.nodes), plan.world_size, folder, started, timeout_s, **settings)

    def detect(self, status: AttemptStatus) -> Detection | None:
        """The heartbeats' word on the attempt (``watch.detect``), by this view's settings."""
        members = list(self.nodes) if self.regrouped else None
        return detect(status, self.heartbeat_dir, self.world_size, self.started, self.timeout_s, self.grace_s,
                      members, self.beatless_said, self.beats_known)  # fmt: skip


@dataclass(frozen=True)
class Reads:
    """What a driver read for one look; what it cannot reach stays empty."""

    status: AttemptStatus
    """The group's nodes' statuses (spares and nodes left out of the group dropped)."""
    detection: Detection | None = None
    """The heartbeats' word (``AttemptView.detect``), or only the crash where the heartbeats are out of sight."""
    leaving: list[str] = field(default_factory=list)
    """Nodes that reported on the store that they leave on notice (sealed: the drivers' read)."""
    faulted: bool = False
    """The store's fault counter changed (the trigger's read: a wake-up, no proof)."""
    spares: list[str] = field(default_factory=list)
    """Nodes outside the group that wait ready and can grow it (``Driver.spares_ready``)."""
    log: LogSilence | None = None
    """How long the nodes' logs showed no new step, for a script that writes no heartbeats and a spec that set
    ``training.log_silence_s`` (``recovery.logwatch``; None: not timed)."""


@dataclass(frozen=True)
class Sight:
    """What a look saw: ``what`` (``SUCCEEDED``, ``CRASH``, ``HANG``, ``BEATLESS``, ``PREEMPTED``, ``FAULT`` or
    ``SPARES``), why, and the nodes it names (a hang's suspects, the leaving nodes, the ready spares)."""

    what: str
    reason: str = ""
    nodes: list[str] = field(default_factory=list)
    from_log: bool = False
    """A hang the nodes' logs showed (``Reads.log``), not the heartbeats: its reason is the evidence."""


def notice(nodes: list[str]) -> str:
    return f"{', '.join(nodes)} given notice (SIGTERM), leaving at a step boundary"


def look(view: AttemptView, reads: Reads) -> Sight | None:
    """What one look at the attempt sees (None: it runs on, nothing to act on). Pure.

    The order: the end of the group (every node succeeded); a crash, explained by the store's word where a
    rank reported there first (a late look sees only the end); a hang; no beat at all; a log silent past
    ``training.log_silence_s`` (a hang of a script without heartbeats); nodes leaving on
    notice; the store's fault counter; spares ready to grow the group (only once nothing is wrong)."""
    found = reads.detection
    if reads.status.state == "succeeded":
        return Sight(SUCCEEDED)
    if found is not None and found.trigger == CRASH:
        return Sight(FAULT, "a rank reported a fault or a notice to leave on the store") if reads.faulted else (
            Sight(CRASH, found.reason)
        )  # fmt: skip
    if found is not None:
        return Sight(found.trigger, found.reason, list(found.suspects))
    if reads.log is not None and reads.log.quiet_s >= reads.log.limit_s:
        # Often only rank 0 prints, and a node that hangs stalls every rank's collective: the logs cannot say which
        # node hung, so none is blamed (the policy relaunches from the checkpoint rather than guess survivors).
        return Sight(HANG, reads.log.reason(), from_log=True)
    if left := [n for n in reads.leaving if n in view.nodes]:
        return Sight(PREEMPTED, notice(left), left)
    if reads.faulted:
        return Sight(FAULT, "a rank reported a fault or a notice to leave on the store")
    if reads.spares:
        return Sight(SPARES, "", list(reads.spares))
    return None


def seen(
    view: AttemptView, plan: LaunchPlan, sight: Sight, status: AttemptStatus, checkpoints: Checkpoints | None,
    *, at: float,
) -> AttemptSucceeded | AttemptFailed | Beatless | SparesReady:  # fmt: skip
    """A driver's sight as the controller's observation, with its evidence (``checkpoints``: the hot
    checkpoints, scanned once a failure was seen; ``FAULT`` is the trigger's alone)."""
    if sight.what == SUCCEEDED:
        return AttemptSucceeded(plan.attempt, at, last_step(view.heartbeat_dir))
    if sight.what == BEATLESS:
        return Beatless(plan.attempt, at, sight.reason)
    if sight.what == SPARES:
        return SparesReady(plan.attempt, at, list(sight.nodes))
    if sight.what == PREEMPTED:
        return failed(plan, status, view.heartbeat_dir, PREEMPTED, [], sight.reason, checkpoints, at=at,
                      leaving=list(sight.nodes))  # fmt: skip
    assert sight.what in (CRASH, HANG), sight
    return failed(plan, status, view.heartbeat_dir, sight.what, sight.nodes, sight.reason, checkpoints, at=at,
                  silence=sight.reason if sight.from_log else "")  # fmt: skip
