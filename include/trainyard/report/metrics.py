"""The run's training metrics over steps, from its step events: loss, throughput, step time, learning rate,
the world size and the faults, all on one step axis (the report's metrics charts read only this).

Every step event gives a point (its value at its last step) and its ``samples`` (the values at evenly spaced
steps of the stretch it sums up, ``protocol.steps.SAMPLED``) and, where it sums up several steps
(``progress_every_s``), the band of what those steps saw (min to max): a spike inside a stretch stays
visible though no event was written at it. A step trained again after a recovery keeps its latest
value. Past ``CURVE_POINTS`` a series is downsampled the way the loss curve is (``protocol.steps``):
each bucket's lowest and highest value survive, so a spike does too.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import Any

from trainyard.protocol import steps as progress

METRICS = (
    ("loss", "loss"),
    ("tokens_per_s", "throughput (tokens/s)"),
    ("step_ms", "step time (ms)"),
    ("lr", "learning rate"),
)
"""Each plotted metric: its name in a step event and its chart's title (the one list the report uses)."""


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _points(events: Sequence[Mapping[str, Any]], name: str) -> list[tuple[int, float]]:
    """(step, value) of every event carrying ``name``; a later event's value replaces an earlier one at a step."""
    if name == "loss":
        return progress.loss_points(events)  # the gate's and the summary's reading: one reader of the loss
    seen: dict[int, float] = {}
    for e in events:
        seen.update(progress.sampled(e, name))  # the stretch's evenly spaced steps, then its last step's value
        value = _number(e.get(name))
        if value is not None:
            seen[int(e["step"])] = value
    return sorted(seen.items())


def _bands(events: Sequence[Mapping[str, Any]], name: str) -> list[tuple[int, int, float, float]]:
    """(first step, last step, min, max) of each event that sums up more than one step."""
    bands = []
    for e in events:
        low, high = _number(e.get(f"{name}_min")), _number(e.get(f"{name}_max"))
        if low is not None and high is not None and e.get("first_step") is not None:
            bands.append((int(e["first_step"]), int(e["step"]), low, high))
    return bands


def _widest(bands: list[tuple[int, int, float, float]], most: int) -> list[tuple[int, int, float, float]]:
    """At most ``most`` bands: the widest ranges (where the spikes are), in step order."""
    if len(bands) <= most:
        return bands
    return sorted(sorted(bands, key=lambda b: b[3] - b[2], reverse=True)[:most])


def _step_at(events: Sequence[Mapping[str, Any]], ts: float | None) -> int | None:
    """The first step trained at or after ``ts`` (the last step seen where nothing came after)."""
    if ts is None or not events:
        return None
    times = [float(e.get("ts") or 0.0) for e in events]
    i = bisect.bisect_left(times, ts)
    return int(events[min(i, len(events) - 1)]["step"])


def _faults(attempts: Sequence[Mapping[str, Any]], events: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each failure with the step it happened at (its own, else the step trained when it was seen)."""
    out = []
    for a in attempts:
        for f in a.get("faults") or []:
            failure = f.get("failure") or {}
            if not failure:
                continue
            step = failure.get("step")
            step = step if isinstance(step, int) else _step_at(events, failure.get("ts"))
            culprits = ", ".join(failure.get("culprits") or [])
            label = f"{failure.get('kind')}" + (f" on {culprits}" if culprits else "")
            action = (f.get("decision") or {}).get("action")
            out.append({"step": step, "label": label + (f" -> {action}" if action else "")})
    return out


def _worlds(worlds: Sequence[Sequence[float]], events: Sequence[Mapping[str, Any]]) -> list[tuple[int, float]]:
    """(step, world size) from each change of the world: the first step trained with it."""
    out: list[tuple[int, float]] = []
    for ts, size in worlds:
        step = _step_at(events, ts)
        if step is not None:
            out.append((step, float(size)))
    return out


def series(
    events: Sequence[Mapping[str, Any]],
    worlds: Sequence[Sequence[float]] = (),
    attempts: Sequence[Mapping[str, Any]] = (),
    most: int = progress.CURVE_POINTS,
    loss: Sequence[tuple[int, float]] | None = None,
) -> dict[str, Any]:
    """The metrics charts' data: ``{metric: {"points", "bands"}}`` for each of ``METRICS`` the run reported,
    ``world_size`` ((step, size) per change) and ``faults`` (step and label), JSON-ready. ``loss``: the events'
    ``progress.loss_points`` where the caller has them already (the summary reads them for its own figures)."""
    events = sorted(events, key=lambda e: float(e.get("ts") or 0.0))
    out: dict[str, Any] = {}
    for name, _ in METRICS:
        points = list(loss) if name == "loss" and loss is not None else _points(events, name)
        if points:
            out[name] = {
                "points": [list(p) for p in progress.downsample(points, most)],
                "bands": [list(b) for b in _widest(_bands(events, name), most // 2)],
            }
    out["world_size"] = [list(p) for p in _worlds(worlds, events)]
    out["faults"] = _faults(attempts, events)
    return out
