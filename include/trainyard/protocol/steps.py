"""Step figures at a bounded rate: what rank 0 writes to the ledger, and how readers use it.

A run of a million steps must not write a million ledger events: every view
visit, validation and report reads the ledger back. Rank 0 therefore folds the
steps into one ``step`` event per ``progress_every_s`` seconds (the spec's
``training.progress_every_s``), carrying the step range it covers and the
min/mean/max of the loss and the step time since the previous one. An event is
also written at once for the first step of a process, for a step the caller
marks (a checkpoint step, the last step) and for a step with a non-finite
metric (which gets an event of its own), so the loss at every checkpoint and
every divergence stays exact.

One ``step`` event (``first_step`` and ``steps`` only when it covers more than
one step, so a one-step event is the per-step event of older ledgers)::

    {"event": "step", "step": 240, "first_step": 181, "steps": 60,
     "loss": 3.1, "lr": 0.01, "step_ms": 98.0,          # the values at ``step``
     "loss_min": 3.0, "loss_mean": 3.2, "loss_max": 3.9, "loss_max_step": 190,
     "step_ms_min": 95.1, "step_ms_mean": 99.0, "step_ms_max": 130.2,
     "samples": {"step": [181, 183, ...], "loss": [...], "step_ms": [...], ...}}

``samples`` holds the ``SAMPLED`` metrics of evenly spaced steps of the stretch (at most ``2 x SAMPLES``,
every step of a short one), so a chart of a short run shows its curve rather than one point per
``progress_every_s`` (a 60-step demo had 4).

The readers below turn those events back into what consumers need: the loss
history of the metric gate, the steps trained, the kept steps' times for ETTR,
and a loss curve bounded in size. Nothing here imports torch.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

SUMMARISED = ("loss", "step_ms")
"""Metrics whose min/mean/max over the covered steps an event carries (others: the last value)."""
NO_STEPS = (
    "the script reports no steps (it writes no heartbeats: trainyard.runtime.heartbeat is never called, and no"
    " line of its log says a step: give training.log_pattern)"
)
"""Why the figures that count steps are unknown for a run without step events (never 0 stated as a fact)."""
SAMPLED = ("loss", "step_ms", "tokens_per_s", "lr")
"""Metrics whose value at evenly spaced steps of a stretch an event carries (``samples``), for the charts."""
SAMPLES = 32
"""A stretch keeps every step's ``SAMPLED`` metrics up to ``2 x SAMPLES`` steps, then every other one, and so on:
between ``SAMPLES`` and ``2 x SAMPLES`` samples an event (a few hundred bytes), whatever the stretch's length."""
CURVE_POINTS = 2000
"""Most points of a loss curve in a summary (a chart needs no more; a 1M-step run would have 1M)."""


class _Stretch:
    """Steps seen since the last event: their range and running figures."""

    def __init__(self, step: int, metrics: Mapping[str, Any]):
        self.first = self.last = step
        self.count = 0
        self.metrics: Mapping[str, Any] = {}
        self.low: dict[str, float] = {}
        self.high: dict[str, float] = {}
        self.sum: dict[str, float] = {}
        self.high_step: dict[str, int] = {}
        self.stride = 1
        self.samples: list[tuple[int, Mapping[str, Any]]] = []
        self.add(step, metrics)

    def add(self, step: int, metrics: Mapping[str, Any]) -> None:
        # Called on every step of rank 0: kept to plain dict operations.
        self.last, self.count, self.metrics = step, self.count + 1, metrics
        if (self.count - 1) % self.stride == 0:
            self.samples.append((step, metrics))
            if len(self.samples) == 2 * SAMPLES:  # thin to every other one: the spacing stays even
                self.samples, self.stride = self.samples[::2], self.stride * 2
        low, high, total = self.low, self.high, self.sum
        for name in SUMMARISED:
            value = metrics.get(name)
            if value.__class__ is not float and value.__class__ is not int:
                continue
            if name in total:
                total[name] += value
                if value < low[name]:
                    low[name] = value
                elif value > high[name]:
                    high[name], self.high_step[name] = value, step
            else:
                low[name] = high[name] = total[name] = value
                self.high_step[name] = step

    def record(self) -> dict[str, Any]:
        out: dict[str, Any] = {**self.metrics, "step": self.last}
        if self.count == 1:
            return out
        out.update(first_step=self.first, steps=self.count)
        for name, total in self.sum.items():
            out.update(
                {f"{name}_min": self.low[name], f"{name}_mean": total / self.count, f"{name}_max": self.high[name]}
            )
        if "loss" in self.high_step:
            out["loss_max_step"] = self.high_step["loss"]
        sampled: dict[str, list[Any]] = {"step": [step for step, _ in self.samples]}
        for name in SAMPLED:
            values = [_sample(metrics.get(name)) for _, metrics in self.samples]
            if any(v is not None for v in values):
                sampled[name] = values
        if len(sampled) > 1:
            out["samples"] = sampled
        return out


def _sample(value: Any) -> float | None:
    """A sampled metric's value as JSON carries it: a finite number (a non-finite step gets its own event)."""
    if value.__class__ is float or value.__class__ is int:
        return value if math.isfinite(value) else None
    return None


def _finite(metrics: Mapping[str, Any]) -> bool:
    for value in metrics.values():
        if value.__class__ is float and not math.isfinite(value):
            return False
    return True


class ProgressDigest:
    """Folds every step's metrics into at most one event per ``every_s`` seconds (0: one per step).

    Pure bookkeeping: ``add`` returns the events to write now and the caller
    writes them, so a test drives it with a fake ``clock``. ``add`` keeps the
    metrics mapping it is given (the last one goes into the event): pass a
    fresh one per step.
    """

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic):
        self.every_s = every_s
        self.clock = clock
        self._pending: _Stretch | None = None
        self._written_at: float | None = None

    def add(self, step: int, metrics: Mapping[str, Any], *, force: bool = False) -> list[dict[str, Any]]:
        """Take ``step``; return the events due now. ``force``: this step must be exact (a checkpoint)."""
        if not _finite(metrics):
            # A divergence is evidence: its step gets an event of its own, after the steps before it.
            return [r for r in (self.flush(), _Stretch(step, metrics).record()) if r is not None]
        if self._pending is not None and step <= self._pending.last:
            pending = self.flush()  # steps trained again (a rollback): an event never spans both
            return [pending, *self.add(step, metrics, force=force)]  # type: ignore[list-item]
        if self._pending is None:
            self._pending = _Stretch(step, metrics)
        else:
            self._pending.add(step, metrics)
        now = self.clock()
        if force or self._written_at is None or now - self._written_at >= self.every_s:
            return [self.flush()]  # type: ignore[list-item]
        return []

    def write_next(self) -> None:
        """Write the next step's event at once (the first step after a regroup times the resumption)."""
        self._written_at = None

    def flush(self) -> dict[str, Any] | None:
        """The event of the steps not yet written, if any (at a save, at the end, at exit)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        self._written_at = self.clock()
        return pending.record()


# --- readers: step events (new or older per-step ones) back into what consumers need ---


def first_step(e: Mapping[str, Any]) -> int:
    """The first step a step event covers (its own where it covers one)."""
    return min(int(e.get("first_step", e["step"])), int(e["step"]))


def loss_points(events: Iterable[Mapping[str, Any]]) -> list[tuple[int, float]]:
    """(step, loss) pairs in step order: the end of every event and the peak inside it.

    Every pair is a loss actually seen at that step: exact at checkpoint steps
    and at a divergence (each is the end of an event), and a spike inside a
    summarised stretch still shows as its peak. A step trained again after a
    recovery replaces the earlier value.
    """
    points: dict[int, float] = {}
    events = list(events)
    cover = _Cover(events)
    for e in reversed(events):  # newest first: a later event's range hides older points in it
        if "loss" in e:
            seen = [*sampled(e, "loss"), (e["step"], e["loss"])]
            if e.get("loss_max_step") not in (None, e["step"]) and "loss_max" in e:
                seen.append((e["loss_max_step"], e["loss_max"]))
            points.update((int(s), v) for s, v in seen if not cover.covers(int(s)))
        cover.take(first_step(e), int(e["step"]))
    return sorted(points.items())


def sampled(e: Mapping[str, Any], name: str) -> list[tuple[int, float]]:
    """(step, value) of ``name`` at the steps an event sampled (``samples``; none in older ledgers, or where the
    samples are malformed: a rank writes them)."""
    samples = e.get("samples")
    if not isinstance(samples, dict):
        return []
    steps, values = samples.get("step"), samples.get(name)
    if not isinstance(steps, list) or not isinstance(values, list) or len(steps) != len(values):
        return []
    return [
        (s, float(v))
        for s, v in zip(steps, values, strict=True)
        if isinstance(s, int) and not isinstance(s, bool) and isinstance(v, (int, float)) and not isinstance(v, bool)
    ]


class _Cover:
    """The steps of the events taken so far (newest first): whether a step is covered, and how many of an
    event's steps were not yet.

    The events' first and last steps cut the steps into stretches, known up front; ``take`` marks each stretch
    of its range not marked before, jumping over marked runs (``_next``, halved as it is walked), so each
    stretch is marked once and n events cost O(n log n) in any order. (Kept as a sorted list of ranges, each
    event of a per-step ledger was one insertion at the front: quadratic, 20 s for 200,000 steps.)
    """

    def __init__(self, events: Iterable[Mapping[str, Any]]):
        self.bounds = sorted({b for e in events for b in (first_step(e), int(e["step"]) + 1)})
        # Stretch i is [bounds[i], bounds[i + 1]); _next[i] == i: not marked. The last index never is.
        self._next = list(range(len(self.bounds)))

    def _unmarked(self, i: int) -> int:
        """The first stretch at or after ``i`` not marked yet."""
        nxt = self._next
        while nxt[i] != i:
            nxt[i] = nxt[nxt[i]]
            i = nxt[i]
        return i

    def covers(self, step: int) -> bool:
        i = bisect.bisect_right(self.bounds, step) - 1
        return 0 <= i < len(self.bounds) - 1 and self._unmarked(i) != i

    def take(self, first: int, last: int) -> int:
        """Mark the steps ``first..last`` (an event's range); how many of them were not marked before."""
        end, new = bisect.bisect_left(self.bounds, last + 1), 0
        i = self._unmarked(bisect.bisect_left(self.bounds, first))
        while i < end:
            new += self.bounds[i + 1] - self.bounds[i]
            self._next[i] = i + 1
            i = self._unmarked(i + 1)
        return new


def kept_stretches(events: Sequence[Mapping[str, Any]]) -> list[tuple[int, float | None]]:
    """(steps that count, mean step time in ms) per step event; a step trained again counts once, at its
    latest time (the earlier event loses the steps a later one covers)."""
    cover, kept = _Cover(events), []
    for e in reversed(events):
        count = cover.take(first_step(e), int(e["step"]))
        if count > 0:
            kept.append((count, e.get("step_ms_mean", e.get("step_ms"))))
    kept.reverse()
    return kept


def steps_trained(events: Sequence[Mapping[str, Any]]) -> int:
    """Distinct steps the step events cover."""
    return sum(count for count, _ in kept_stretches(events))


def weighted_median(pairs: Iterable[tuple[int, float]]) -> float | None:
    """The median of values each standing for ``weight`` steps."""
    ordered = sorted((value, weight) for weight, value in pairs if weight > 0)
    total = sum(w for _, w in ordered)
    seen = 0
    for value, weight in ordered:
        seen += weight
        if seen * 2 >= total:
            return value
    return None


def downsample(points: Sequence[tuple[int, float]], most: int = CURVE_POINTS) -> list[tuple[int, float]]:
    """At most about ``most`` points for a chart: per bucket of steps its lowest and highest loss
    (so a spike survives), every non-finite loss, and the first and last points."""
    if len(points) <= most:
        return list(points)
    size = math.ceil(len(points) / max(1, most // 2))
    keep = {0, len(points) - 1}
    for start in range(0, len(points), size):
        bucket = [i for i in range(start, min(start + size, len(points))) if math.isfinite(points[i][1])]
        if bucket:
            keep.add(min(bucket, key=lambda i: points[i][1]))
            keep.add(max(bucket, key=lambda i: points[i][1]))
    keep.update(i for i, (_, loss) in enumerate(points) if not math.isfinite(loss))
    return [points[i] for i in sorted(keep)]
