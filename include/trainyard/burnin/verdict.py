"""The verdict: which candidates may train. Pure: figures in, decision out.

Each probe is judged on its own: below its absolute floor, or below its
straggler ratio of the batch median, fails the node. The best passing nodes
(by the geometric mean of their probes relative to the medians) train; the
rest are spares.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

Figures = Mapping[str, float]


@dataclass(frozen=True)
class Rule:
    probe: str
    floor: float
    ratio: float


@dataclass(frozen=True)
class Verdict:
    figures: dict[str, dict[str, float] | None]
    medians: dict[str, float]
    thresholds: dict[str, float]
    healthy: list[str]
    """Chosen for training, best first; at most the number needed."""
    evicted: dict[str, str] = field(default_factory=dict)
    """Node -> reason, for every candidate that failed a rule or is dead."""
    spare: list[str] = field(default_factory=list)
    """Passed, but not needed this time."""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def decide(
    figures: Mapping[str, Figures | None], need: int, rules: list[Rule], dead: Mapping[str, str] | None = None
) -> Verdict:
    """Judge each candidate (``None`` figures: it reported nothing; ``dead`` says why)."""
    dead = dict(dead or {})
    alive = {n: f for n, f in figures.items() if f is not None and n not in dead}
    medians = {r.probe: statistics.median([f[r.probe] for f in alive.values()]) if alive else 0.0 for r in rules}
    thresholds = {r.probe: max(r.floor, r.ratio * medians[r.probe]) for r in rules}
    evicted: dict[str, str] = {}
    score: dict[str, float] = {}
    for node, f in figures.items():
        if node in dead or f is None:
            evicted[node] = f"dead: {dead.get(node, 'no report within the timeout')}"
            continue
        failed = [_failure(r, f[r.probe], medians[r.probe]) for r in rules if f[r.probe] < thresholds[r.probe]]
        if failed:
            evicted[node] = "; ".join(failed)
        else:
            score[node] = statistics.geometric_mean(
                [f[r.probe] / medians[r.probe] if medians[r.probe] > 0 else 1.0 for r in rules] or [1.0]
            )
    passing = sorted(score, key=lambda n: (-score[n], n))
    return Verdict(
        {n: (dict(f) if f is not None else None) for n, f in figures.items()},
        medians,
        thresholds,
        healthy=passing[:need],
        evicted=evicted,
        spare=passing[need:],
    )


def _failure(rule: Rule, value: float, median: float) -> str:
    if value < rule.floor:
        return f"{rule.probe} {value:.2f} is below the floor of {rule.floor:.2f}"
    return f"straggler: {rule.probe} {value:.2f} < {rule.ratio:.2f} x median {median:.2f}"


def format_table(verdict: Verdict, rules: list[Rule]) -> str:
    """The per-node table for the task log and the NodeUnhealthy message."""
    probes = [r.probe for r in rules]
    rows = [f"{'node':<10} " + " ".join(f"{p:>16}" for p in probes) + "  verdict"]
    for node, f in verdict.figures.items():
        values = " ".join(f"{'-' if f is None else f'{f[p]:.2f}':>16}" for p in probes)
        state = (
            "train"
            if node in verdict.healthy
            else "spare"
            if node in verdict.spare
            else "evicted: " + verdict.evicted[node]
        )
        rows.append(f"{node:<10} {values}  {state}")
    rows.append(f"{'median':<10} " + " ".join(f"{verdict.medians[p]:>16.2f}" for p in probes))
    rows.append(f"{'threshold':<10} " + " ".join(f"{verdict.thresholds[p]:>16.2f}" for p in probes))
    return "\n".join(rows)
