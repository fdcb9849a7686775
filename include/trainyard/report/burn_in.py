"""The burn-in section of a run's pages: each node's figures against the threshold it had to reach, the
second round of a suspect, the verdict and why, and a chart per probe."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainyard.report.charts import burnin_svg, esc
from trainyard.report.html import badge as _badge
from trainyard.report.html import long as _long
from trainyard.report.html import num as _num
from trainyard.report.html import table as _table


def _probes(summary: Mapping[str, Any]) -> list[str]:
    limits = (summary.get("thresholds") or {}).get("thresholds") or {}
    if limits:
        return list(limits)
    found: dict[str, None] = {}
    for v in summary["node_verdicts"].values():
        for key, value in (v.get("figures") or {}).items():
            if isinstance(value, (int, float)):
                found[key] = None
    return list(found)


def _why(verdict: Mapping[str, Any]) -> str:
    """The reason of an eviction, or what a cleared suspect was suspected of."""
    if verdict.get("reason"):
        return str(verdict["reason"])
    return f"suspect, cleared by the second round: {verdict['suspect']}" if verdict.get("suspect") else ""


def burn_in_section(summary: Mapping[str, Any]) -> str:
    verdicts = summary["node_verdicts"]
    if not verdicts:
        return (
            '<h2>Burn-in</h2><p class="empty">No burn-in verdicts recorded (pressure test skipped or not run yet).</p>'
        )
    limits = summary.get("thresholds") or {}
    thresholds, medians = limits.get("thresholds") or {}, limits.get("references") or {}
    probes = _probes(summary)
    rows = []
    for node, v in verdicts.items():
        rows.append(
            [esc(node)]
            + [_num((v.get("figures") or {}).get(p)) for p in probes]
            + [_badge(v.get("verdict")), _long(_why(v))]
        )
        if v.get("again"):  # a suspect, measured again beside the reference node
            rows.append(["<i>again</i>"] + [_num(v["again"].get(p)) for p in probes] + ["", ""])
    if thresholds:
        rows.append(["<b>threshold</b>"] + [_num(thresholds.get(p)) for p in probes] + ["", ""])
        rows.append(["<i>reference</i>"] + [_num(medians.get(p)) for p in probes] + ["", ""])
    table = _table(["node", *probes, "verdict", "reason"], rows, "verdicts")
    states = {n: str(v.get("verdict")) for n, v in verdicts.items()}
    charts = "".join(
        burnin_svg(
            p,
            {n: (v.get("figures") or {}).get(p) for n, v in verdicts.items()},
            thresholds.get(p),
            medians.get(p),
            states,
            {n: (v.get("again") or {}).get(p) for n, v in verdicts.items() if v.get("again")},
        )
        for p in probes
    )
    note = (
        f"<p>Each node against the threshold it had to reach: the larger of the probe's floor and the straggler"
        f" ratio times its reference (the batch median; with fewer than three nodes, or a batch below its"
        f" history, the fleet history). A node below it was only a suspect: measured again beside the best"
        f" healthy node, it was evicted only when the deficit held"
        f" (pressure test: {_num(limits.get('seconds'), 1)} s).</p>"
        if thresholds
        else ""
    )
    return f'<h2>Burn-in</h2>{table}{note}<div class="charts">{charts}</div>'
