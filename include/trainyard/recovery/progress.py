"""Training progress as one line of the ``train`` task's log, every ``training.progress_every_s``.

The line is built from the ranks' heartbeat files alone (``rank-N.json``:
step, time, metrics; ``runtime/core.py``), so the local supervisor and the
Kubernetes trigger print the same thing without reading the ledger. Speed is
the step delta between two looks over the time between them, so it counts
everything a step really costs (data, checkpoints, stragglers), not one
step's compute. ``Progress`` is pure; ``ProgressLog`` paces the looks and does
the few small file reads.

Speed is measured between the times the ranks reported two different steps
(the heartbeats' own ``time``), so a line that falls within one long step
repeats the last measured speed instead of printing 0.

Only numbers are taken from the heartbeats; the checkpoint names, which a pod
chooses (a folder, the ``LATEST`` pointer), are printed through
``text.printable``: a name holding a newline or an escape sequence stays one
visible line and cannot forge another ``progress:`` line in the task log.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainyard.checkpoint import registry
from trainyard.checkpoint.format import list_checkpoints, step_of
from trainyard.protocol.heartbeat import read_heartbeats
from trainyard.recovery.logwatch import LogSteps
from trainyard.text import printable

UNKNOWN = "-"


@dataclass(frozen=True)
class Look:
    """The furthest step any rank had reported, and when that rank reported it."""

    at: float
    step: int


@dataclass(frozen=True)
class Progress:
    attempt: int
    world_size: int
    step: int | None
    target: int
    loss: float | None
    steps_per_s: float | None
    tokens_per_s: float | None
    eta_s: float | None
    checkpoint: str | None
    """Name of the last valid checkpoint, ``none``, or None where it cannot be seen."""
    saved: str | None = None
    """A newer committed checkpoint not judged yet (a deferred task judges them when it wakes)."""
    from_log: bool = False
    """The step and loss are the script's log's (``recovery.logwatch``): it writes no heartbeats."""

    @classmethod
    def from_heartbeats(
        cls,
        beats: dict[str, dict[str, Any]],
        *,
        attempt: int,
        world_size: int,
        target: int,
        now: float,
        before: Look | None,
        tokens_per_step: int | None,
        checkpoint: str | None,
        saved: str | None = None,
        last_rate: float | None = None,
        from_log: bool = False,
    ) -> Progress:
        """Progress from the heartbeats (``rank-N`` -> record) at ``now``; speed since the look ``before``.

        Without a step since ``before``, the speed is ``last_rate`` (the last one measured).

        ``tokens_per_step`` comes from the spec where it knows the sequence
        length; else from what the workload reports (``tokens_per_s`` and
        ``step_ms``, as the reference loop does); else it stays unknown.
        """
        look = furthest(beats, now)
        step = look.step if look else None
        rate = last_rate
        if look and before and look.at > before.at and look.step > before.step:
            rate = (look.step - before.step) / (look.at - before.at)
        per_step = tokens_per_step or _reported_tokens_per_step(_lead(beats))
        eta = None
        if step is not None and step >= target:
            eta = 0.0
        elif step is not None and rate:
            eta = (target - step) / rate
        return cls(
            attempt=attempt,
            world_size=world_size,
            step=step,
            target=target,
            loss=_number(_lead(beats), "loss"),
            steps_per_s=rate,
            tokens_per_s=rate * per_step if rate is not None and per_step else None,
            eta_s=eta,
            checkpoint=checkpoint,
            saved=saved,
            from_log=from_log,
        )

    def line(self) -> str:
        step = f"{UNKNOWN}/{self.target} (no heartbeats)"  # not stuck: the script may write none
        if self.step is not None:
            step = f"{self.step}/{self.target} ({100 * self.step / self.target:.0f}%)"
        if self.step is not None and self.from_log:
            step = f"{self.step}/{self.target} (from the log)"
        return (
            f"progress: attempt {self.attempt}, world size {self.world_size}, step {step},"
            f" loss {_fmt(self.loss, '.4f')}, {_fmt(self.steps_per_s, '.3g')} steps/s,"
            f" {_fmt(self.tokens_per_s, ',.0f')} tokens/s, ETA {duration(self.eta_s)},"
            f" last valid checkpoint {printable(self.checkpoint or UNKNOWN)}"
            + (f", newest saved {printable(self.saved)} (not yet validated)" if self.saved else "")
        )


def furthest(beats: dict[str, dict[str, Any]], now: float) -> Look | None:
    """The furthest step of any rank (ranks of one optimizer step differ by at most one) and its beat's time.

    A beat without a usable time counts as seen ``now``.
    """
    steps = [b for b in beats.values() if _is_step(b.get("step"))]
    if not steps:
        return None
    ahead = max(steps, key=lambda b: b["step"])
    at = ahead.get("time")
    if isinstance(at, (int, float)) and not isinstance(at, bool) and math.isfinite(at):
        return Look(float(at), ahead["step"])
    return Look(now, ahead["step"])


def tokens_per_step(global_batch: int, args: dict[str, Any]) -> int | None:
    """``global_batch`` x the sequence length, where the entrypoint's arguments name it (``seq-len``/``seq_len``)."""
    for key in ("seq-len", "seq_len"):
        value = args.get(key)
        if isinstance(value, bool):
            continue
        try:
            seq = int(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            continue
        if seq > 0:
            return global_batch * seq
    return None


def duration(seconds: float | None) -> str:
    """``42s``, ``6m05s``, ``3h07m``, ``2d04h``; ``-`` when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return UNKNOWN
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _lead(beats: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's metrics (the ones the ledger and the workload's own log show), else the furthest rank's."""
    if "rank-0" in beats:
        return _metrics(beats["rank-0"])
    ahead = max(beats.values(), key=lambda b: b["step"] if _is_step(b.get("step")) else -1, default={})
    return _metrics(ahead)


def _metrics(beat: dict[str, Any]) -> dict[str, Any]:
    metrics = beat.get("metrics")
    return metrics if isinstance(metrics, dict) else {}


def _number(metrics: dict[str, Any], key: str) -> float | None:
    # Heartbeats are written by training code: take numbers only, never text into the log.
    value = metrics.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _reported_tokens_per_step(metrics: dict[str, Any]) -> int | None:
    rate, ms = _number(metrics, "tokens_per_s"), _number(metrics, "step_ms")
    if rate is None or ms is None or not math.isfinite(rate * ms) or rate * ms <= 0:
        return None
    return round(rate * ms / 1000)


def _is_step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _fmt(value: float | None, spec: str) -> str:
    return UNKNOWN if value is None else format(value, spec)


class ProgressLog:
    """When a progress line is due, and what it says: one per ``every_s`` from ``started``.

    Between lines it reads nothing, except until the first heartbeat appears:
    that first look is where the first line's speed starts from. The speed's
    starting point moves on only when the step does.
    """

    def __init__(
        self,
        every_s: float,
        started: float,
        *,
        attempt: int,
        world_size: int,
        target: int,
        tokens_per_step: int | None,
        heartbeat_dir: Path,
        checkpoint_root: Path | None,
        logs: LogSteps | None = None,
    ):
        self.every_s, self.next_at = every_s, started + every_s
        self.attempt, self.world_size, self.target = attempt, world_size, target
        self.tokens_per_step = tokens_per_step
        self.heartbeat_dir, self.checkpoint_root = heartbeat_dir, checkpoint_root
        self.before: Look | None = None
        self.rate: float | None = None
        self.logs = logs
        """The nodes' logs, read while no rank wrote a heartbeat (None: not read, or a rank beat)."""

    def poll(self, now: float) -> str | None:
        """The progress line if one is due at ``now``, else None."""
        # Until the log showed its first step it is read at every poll: that step times the resumption.
        first_logged = self.logs is not None and self.logs.written is None
        if self.before is not None and now < self.next_at and not first_logged:
            return None
        beats = read_heartbeats(self.heartbeat_dir) if self.heartbeat_dir.is_dir() else {}
        if beats:
            self.logs = None  # the heartbeats say more than the log; the runtime writes the step events
        logged = self.logs.look(now) if self.logs is not None else None
        if logged is not None:  # the log's step as a beat of its own, seen now: speeds and ETA as for beats
            beats = {"log": {"step": logged.step, "time": now, "metrics": {"loss": logged.loss}}}
        look = furthest(beats, now)
        if now < self.next_at:
            if self.before is None or (look and look.step > self.before.step):
                self.before = look  # a starting point for the first line's rates
            return None
        # A late poll (a long save, a busy triggerer) skips lines, not the cadence; every_s 0: a line per poll.
        self.next_at = (
            now if self.every_s <= 0 else self.next_at + self.every_s * ((now - self.next_at) // self.every_s + 1)
        )
        valid, saved = self._checkpoints()
        progress = Progress.from_heartbeats(
            beats,
            attempt=self.attempt,
            world_size=self.world_size,
            target=self.target,
            now=now,
            before=self.before,
            tokens_per_step=self.tokens_per_step,
            checkpoint=valid,
            saved=saved,
            last_rate=self.rate,
            from_log=logged is not None,
        )
        self.rate = progress.steps_per_s
        if look and (self.before is None or look.step > self.before.step):
            self.before = look
        return progress.line()

    def last_look(self, now: float) -> None:
        """As the attempt ends: the logs' last steps into the ledger, before any figure reads it."""
        if self.logs is not None:
            self.logs.look(now)

    def _checkpoints(self) -> tuple[str | None, str | None]:
        """The last valid checkpoint's name (``none`` if none yet) and a newer committed one's, if any."""
        if self.checkpoint_root is None or not self.checkpoint_root.is_dir():
            return None, None  # out of sight (a triggerer without the hot tier): unknown, not "none"
        latest = registry.latest(self.checkpoint_root)
        newest = max(list_checkpoints(self.checkpoint_root), key=lambda c: step_of(c) or 0, default=None)
        newer = newest is not None and (step_of(newest) or 0) > ((step_of(latest) or 0) if latest else 0)
        return (latest.name if latest else "none"), (newest.name if newer and newest else None)
