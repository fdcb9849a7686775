"""The verdict: which candidates may train. Pure: figures in, decision out."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Verdict:
    figures: dict[str, float | None]
    median: float
    threshold: float
    healthy: list[str]
    """Chosen for training, best first; at most the number needed."""
    evicted: dict[str, str] = field(default_factory=dict)
    """Node -> reason, for every candidate that failed a rule."""
    spare: list[str] = field(default_factory=list)
    """Passed, but not needed this time."""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def decide(figures: dict[str, float | None], need: int, min_gflops: float, straggler_ratio: float) -> Verdict:
    """Judge each candidate's compute figure (None: the node reported nothing, so it is dead).

    A node fails if it is dead, below the absolute floor, or below
    ``straggler_ratio`` of the median of the nodes that reported. The best
    ``need`` passing nodes train; the rest of the passing ones are spares.
    """
    alive = [v for v in figures.values() if v is not None]
    median = statistics.median(alive) if alive else 0.0
    threshold = max(min_gflops, straggler_ratio * median)
    evicted: dict[str, str] = {}
    passing: list[str] = []
    for node, value in figures.items():
        if value is None:
            evicted[node] = "dead: no report within the timeout"
        elif value < min_gflops:
            evicted[node] = f"{value:.2f} GFLOP/s is below the floor of {min_gflops:.2f}"
        elif value < straggler_ratio * median:
            evicted[node] = f"straggler: {value:.2f} GFLOP/s < {straggler_ratio:.2f} x median {median:.2f}"
        else:
            passing.append(node)
    passing.sort(key=lambda n: (-(figures[n] or 0.0), n))
    return Verdict(figures, median, threshold, healthy=passing[:need], evicted=evicted, spare=passing[need:])


def format_table(verdict: Verdict) -> str:
    """The per-node table for the task log and the NodeUnhealthy message."""
    rows = [f"{'node':<12} {'GFLOP/s':>9}  verdict"]
    for node, value in verdict.figures.items():
        shown = "-" if value is None else f"{value:.2f}"
        state = "train" if node in verdict.healthy else "spare" if node in verdict.spare else "evicted: " + verdict.evicted[node]
        rows.append(f"{node:<12} {shown:>9}  {state}")
    rows.append(f"median {verdict.median:.2f} GFLOP/s, threshold {verdict.threshold:.2f} GFLOP/s")
    return "\n".join(rows)
