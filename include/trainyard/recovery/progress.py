"""Training progress as one line of the ``train`` task's log, every ``training.progress_every_s``.

The line is built from the ranks' heartbeat files alone (``rank-N.json``:
step, time, metrics; ``train/runtime.py``), so the local supervisor and the
Kubernetes trigger print the same thing without reading the ledger. Speed is
the step delta between two looks over the time between them, so it counts
everything a step really costs (data, checkpoints, stragglers), not one
step's compute. ``Progress`` is pure; ``ProgressLog`` paces the looks and does
the few small file reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainyard.checkpoint import registry
from trainyard.recovery.supervisor import read_heartbeats

UNKNOWN = "-"


@dataclass(frozen=True)
class Look:
    """The furthest step any rank had reported at observer time ``at``."""

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

    @classmethod
    def from_heartbeats(
        cls, beats: dict[str, dict[str, Any]], *, attempt: int, world_size: int, target: int, now: float,
        before: Look | None, tokens_per_step: int | None, checkpoint: str | None,
    ) -> Progress:
        """Progress at ``now`` from the heartbeats (``rank-N`` -> record); rates since the look ``before``.

        ``tokens_per_step`` comes from the spec where it knows the sequence
        length; else from what the workload reports (``tokens_per_s`` and
        ``step_ms``, as the reference loop does); else it stays unknown.
        """
        look = furthest(beats, now)
        step = look.step if look else None
        rate = None
        if look and before and look.at > before.at and look.step >= before.step:
            rate = (look.step - before.step) / (look.at - before.at)
        per_step = tokens_per_step or _reported_tokens_per_step(_lead(beats))
        eta = None
        if step is not None and step >= target:
            eta = 0.0
        elif step is not None and rate:
            eta = (target - step) / rate
        return cls(
            attempt=attempt, world_size=world_size, step=step, target=target, loss=_number(_lead(beats), "loss"),
            steps_per_s=rate, tokens_per_s=rate * per_step if rate is not None and per_step else None,
            eta_s=eta, checkpoint=checkpoint,
        )

    def line(self) -> str:
        step = f"{UNKNOWN}/{self.target}"
        if self.step is not None:
            step = f"{self.step}/{self.target} ({100 * self.step / self.target:.0f}%)"
        return (
            f"progress: attempt {self.attempt}, world size {self.world_size}, step {step},"
            f" loss {_fmt(self.loss, '.4f')}, {_fmt(self.steps_per_s, '.3g')} steps/s,"
            f" {_fmt(self.tokens_per_s, ',.0f')} tokens/s, ETA {duration(self.eta_s)},"
            f" last valid checkpoint {self.checkpoint or UNKNOWN}"
        )


def furthest(beats: dict[str, dict[str, Any]], now: float) -> Look | None:
    """The furthest step of any rank (ranks of one optimizer step differ by at most one), seen at ``now``."""
    steps = [b["step"] for b in beats.values() if _is_step(b.get("step"))]
    return Look(now, max(steps)) if steps else None


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
    that first look is where the first line's rates start from.
    """

    def __init__(self, every_s: float, started: float, *, attempt: int, world_size: int, target: int,
                 tokens_per_step: int | None, heartbeat_dir: Path, checkpoint_root: Path | None):
        self.every_s, self.next_at = every_s, started + every_s
        self.attempt, self.world_size, self.target = attempt, world_size, target
        self.tokens_per_step = tokens_per_step
        self.heartbeat_dir, self.checkpoint_root = heartbeat_dir, checkpoint_root
        self.before: Look | None = None

    def poll(self, now: float) -> str | None:
        """The progress line if one is due at ``now``, else None."""
        if self.before is not None and now < self.next_at:
            return None
        beats = read_heartbeats(self.heartbeat_dir) if self.heartbeat_dir.is_dir() else {}
        look = furthest(beats, now)
        if now < self.next_at:
            self.before = look  # a starting point for the first line's rates
            return None
        while self.next_at <= now:  # a late poll (a long save, a busy triggerer) skips lines, not the cadence
            self.next_at += self.every_s
        progress = Progress.from_heartbeats(
            beats, attempt=self.attempt, world_size=self.world_size, target=self.target, now=now, before=self.before,
            tokens_per_step=self.tokens_per_step, checkpoint=self._checkpoint(),
        )
        self.before = look or self.before
        return progress.line()

    def _checkpoint(self) -> str | None:
        if self.checkpoint_root is None or not self.checkpoint_root.is_dir():
            return None  # out of sight (a triggerer without the hot tier): unknown, not "none"
        latest = registry.latest(self.checkpoint_root)
        return latest.name if latest else "none"
