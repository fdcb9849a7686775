"""The burn-in verdict as a table: per node, both rounds' figures and the state; per kind, the references.

For the task log and the ``NodeUnhealthy`` message (``pipeline.burnin``).
"""

from __future__ import annotations

from collections.abc import Mapping

from trainyard.burnin.verdict import Rule, Verdict


def format_table(verdict: Verdict, rules: list[Rule]) -> str:
    """The per-node table for the task log and the NodeUnhealthy message: both rounds, and the references."""
    probes = [r.probe for r in rules if any(f and r.probe in f for f in verdict.figures.values())]
    width = max([10, *(len(n) + 2 for n in verdict.figures)])
    rows = [f"{'node':<{width}} " + " ".join(f"{p:>16}" for p in probes) + "  verdict"]
    for node, f in verdict.figures.items():
        rows.append(f"{node:<{width}} {_cells(f, probes)}  {_state(verdict, node)}")
        if node in verdict.again:
            rows.append(f"{'  again':<{width}} {_cells(verdict.again[node], probes)}")
    for kind, refs in verdict.references.items():
        label = "reference" + (f" ({kind})" if kind else "")
        rows.append(
            f"{label:<{width}} "
            + " ".join(f"{refs[p].value if p in refs else '-':>16.2f}" if p in refs else f"{'-':>16}" for p in probes)
        )
    return "\n".join(rows)


def _cells(f: Mapping[str, float] | None, probes: list[str]) -> str:
    return " ".join(f"{'-' if f is None or p not in f else f'{f[p]:.2f}':>16}" for p in probes)


def _state(verdict: Verdict, node: str) -> str:
    if node in verdict.evicted:
        return "evicted: " + verdict.evicted[node]
    state = verdict.state(node)
    return f"{state} (cleared: {verdict.suspects[node]})" if node in verdict.suspects else state
