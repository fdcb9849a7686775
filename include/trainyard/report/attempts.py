"""The training attempts section of a run's pages: one row per attempt, then every fault it met (its
failure, its decision and, healed in place, the generation and who joined) and the world path."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from trainyard.report.charts import esc, timeline_svg
from trainyard.report.faults import attempt_lines
from trainyard.report.html import badge as _badge
from trainyard.report.html import long as _long
from trainyard.report.html import num as _num
from trainyard.report.html import table as _table
from trainyard.report.html import when as _when


def _outcome(a: Mapping[str, Any]) -> str:
    text = _badge(a.get("state"))
    detail = " ".join(str(x) for x in (a.get("trigger"), a.get("reason")) if x)
    if a.get("state") == "succeeded" and a.get("last_step") is not None:
        detail = f"last step {a['last_step']}"
    return text + (f" {_long(detail)}" if detail else "")


def _failure(f: Mapping[str, Any] | None) -> str:
    if not f:
        return ""
    culprits = ", ".join(f.get("culprits") or [])
    return (
        f"<b>{esc(f.get('kind'))}</b>" + (f" ({esc(culprits)})" if culprits else "") + f"<br>{_long(f.get('evidence'))}"
    )


def _decision(d: Mapping[str, Any] | None) -> str:
    if not d:
        return ""
    changes = ", ".join(
        f"{k} {v if not isinstance(v, list) else ' '.join(map(str, v))}"
        for k, v in d.items()
        if k in ("new_nodes", "micro_batch", "delay_s", "to_step", "joiners", "generation")
    )
    return (
        f"<b>{esc(d.get('action'))}</b>" + (f" ({esc(changes)})" if changes else "") + f"<br>{_long(d.get('reason'))}"
    )


def attempts_section(summary: Mapping[str, Any]) -> str:
    attempts = summary.get("attempt_details") or []
    if not attempts:
        return '<h2>Training attempts</h2><p class="empty">No training attempt recorded.</p>'
    rows = [
        [
            esc(a["attempt"]),
            esc(", ".join(a.get("nodes") or [])) + f"<br>world size {esc(a.get('world_size') or '-')},"
            f" micro-batch {esc(a.get('micro_batch') or '-')}",
            esc("-" if a.get("resumed_step") is None else a["resumed_step"]),
            _when(a.get("start")),
            _num(a.get("seconds"), 1),
            _outcome(a),
            esc(
                "; ".join(f"{d.get('fault')} on {d.get('node')} at step {d.get('step')}" for d in a.get("drills") or [])
            ),
            "<hr>".join(_failure(f["failure"]) for f in a.get("faults") or [] if f["failure"]),
            "<hr>".join(_decision(f["decision"]) for f in a.get("faults") or [] if f["decision"]),
        ]
        for a in attempts
    ]
    table = _table(
        [
            "attempt",
            "nodes",
            "resumed at step",
            "start",
            "seconds",
            "outcome",
            "drill",
            "failure (classified)",
            "decision",
        ],
        rows,
        "attempts",
    )
    return f"<h2>Training attempts</h2>{timeline_svg(attempts)}{table}{_faults(summary, attempts)}"


def _faults(summary: Mapping[str, Any], attempts: Sequence[Mapping[str, Any]]) -> str:
    """Every fault of every attempt with its decision, and every growth, in order; then the world path."""
    items = [f"<li>attempt {esc(a['attempt'])}: {esc(line)}</li>" for a in attempts for line in attempt_lines(a)]
    faults = f"<h3>Faults and what was done</h3><ol>{''.join(items)}</ol>" if items else ""
    return faults + world_path(summary.get("world_path"))


def world_path(path: str | None) -> str:
    """The world path (``2 -> 1``: the world size at the start, then after each relaunch or regroup), explained;
    it keeps the words ``World path:`` of ``trainyard summary`` and the notice."""
    if not path:
        return ""
    sizes = path.split(" -> ")
    if len(set(sizes)) == 1:
        said = f"the world size, {sizes[0]} ranks throughout: no relaunch or regroup changed it"
    else:
        said = "the world size in ranks at the start, then after each relaunch or regroup that changed it"
    return f"<p>World path: {esc(path)} ({esc(said)}).</p>"
