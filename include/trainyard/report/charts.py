"""Inline SVG charts of a run summary: loss curve, burn-in figures, attempts timeline.

Plain SVG strings, no plotting library and no script, so a report is one
self-contained file and the Airflow view can serve the same markup. Every
text that comes from the ledger is escaped here.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from typing import Any

RED, GREEN, BLUE, ORANGE, GREY, LIGHT = "#d62728", "#2ca02c", "#1f77b4", "#ff7f0e", "#7f7f7f", "#bbbbbb"
STATE_COLORS = {"succeeded": GREEN, "failed": RED, "running": BLUE}


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _text(x: float, y: float, text: Any, size: int = 11, anchor: str = "start", fill: str = "#333") -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" fill="{fill}">{esc(text)}</text>'


def _svg(width: int, height: int, label: str, body: str) -> str:
    return (
        f'<svg class="chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img"'
        f' aria-label="{esc(label)}" xmlns="http://www.w3.org/2000/svg">{body}</svg>'
    )


def loss_svg(
    points: Sequence[Sequence[float]],
    boundaries: Sequence[int | tuple[int, str]] = (),
    width: int = 640,
    height: int = 260,
    bands: Sequence[Sequence[float]] = (),
) -> str:
    """Loss versus step; a dashed line where a later attempt resumed (the steps after it were trained again);
    a light band over the steps one step event summed up, from their lowest to their highest loss.

    ``boundaries`` are steps, or ``(step, label)`` pairs. Non-finite losses (a
    diverged step) are not plotted but marked along the top edge.
    """
    finite = [(x, y) for x, y in points if isinstance(y, (int, float)) and math.isfinite(y)]
    if len(finite) < 2:
        return '<p class="empty">No loss curve recorded.</p>'
    left, right, top, bottom = 55, 15, 22, 30
    xs, ys = [p[0] for p in finite], [p[1] for p in finite] + [v for b in bands for v in b[2:4] if math.isfinite(v)]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    sx = (width - left - right) / max(1, x1 - x0)
    sy = (height - top - bottom) / max(1e-9, y1 - y0)

    def px(step: float) -> float:
        return left + (step - x0) * sx

    def py(loss: float) -> float:
        return height - bottom - (loss - y0) * sy

    parts = [
        f'<line x1="{left}" x2="{left}" y1="{top}" y2="{height - bottom}" stroke="#999"/>',
        f'<line x1="{left}" x2="{width - right}" y1="{height - bottom}" y2="{height - bottom}" stroke="#999"/>',
    ]
    for value in (y0, (y0 + y1) / 2, y1):
        parts.append(_text(left - 4, py(value) + 4, f"{value:.3f}", anchor="end"))
    parts += [
        _text(left, height - 10, f"step {x0}"),
        _text(width - right, height - 10, f"step {x1}", anchor="end"),
        _text(left + (width - left - right) / 2, height - 10, "step", anchor="middle", fill=GREY),
    ]
    for first, last, low, high in bands:
        if math.isfinite(low) and math.isfinite(high):
            parts.append(
                f'<rect class="band" x="{px(max(first, x0)):.1f}" y="{py(high):.1f}" width="{max(1.0, px(last) - px(first)):.1f}"'
                f' height="{max(1.0, py(low) - py(high)):.1f}" fill="{LIGHT}" opacity="0.5"><title>steps {first:g}-{last:g}:'
                f" loss {low:.4f} to {high:.4f}</title></rect>"
            )
    for b in boundaries:
        at, label = (b, f"resumed at step {b}") if isinstance(b, (int, float)) else b
        x = px(min(max(at, x0), x1))
        parts.append(
            f'<line class="boundary" x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{height - bottom}" stroke="{RED}"'
            f' stroke-dasharray="4"><title>{esc(label)}</title></line>'
        )
        parts.append(_text(x + 3, top - 6, label, size=10, fill=RED))
    for step, loss in points:
        if not (isinstance(loss, (int, float)) and math.isfinite(loss)):
            parts.append(
                f'<circle cx="{px(step):.1f}" cy="{top}" r="4" fill="{RED}"><title>loss {esc(loss)} at step'
                f" {esc(step)}</title></circle>"
            )
    path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in finite)
    parts.append(f'<polyline class="loss" fill="none" stroke="{BLUE}" stroke-width="2" points="{path}"/>')
    return _svg(width, height, "loss versus step", "".join(parts))


def burnin_svg(
    probe: str,
    figures: Mapping[str, float | None],
    threshold: float | None,
    median: float | None,
    verdicts: Mapping[str, str],
    again: Mapping[str, float | None] | None = None,
    width: int = 460,
) -> str:
    """One probe: a bar per node, the threshold it had to reach (dashed) and the batch median (grey).

    ``again``: a suspect's figure measured in the second round; its bar is drawn under the first one's, and
    a first round below the threshold that the second cleared is orange, not red: the node passed."""
    again = again or {}
    row, label_w, value_w = 22, 70, 70
    height = 28 + row * len(figures) + 8
    known = [v for v in (*figures.values(), *again.values()) if isinstance(v, (int, float))]
    top = max([*known, threshold or 0, median or 0]) * 1.05 or 1.0
    plot = width - label_w - value_w

    def px(value: float) -> float:
        return label_w + plot * value / top

    parts = [_text(0, 12, probe, size=12)]
    for i, (node, value) in enumerate(figures.items()):
        y = 22 + i * row
        parts.append(_text(label_w - 6, y + 13, node, anchor="end"))
        if not isinstance(value, (int, float)):
            parts.append(_text(label_w + 4, y + 13, f"no figure ({verdicts.get(node, '-')})", fill=RED))
            continue
        # Red: below this probe's threshold. Grey: passed this probe, evicted for another one.
        # Orange: below it in the first round only, cleared by the second (the thin bar under it).
        below = threshold is not None and value < threshold
        evicted = verdicts.get(node) == "evicted"
        color = (RED if evicted else ORANGE) if below else LIGHT if evicted else GREEN
        said = "first round, cleared by the second" if below and not evicted else verdicts.get(node, "-")
        parts.append(
            f'<rect class="bar" x="{label_w}" y="{y + 2}" width="{max(1.0, px(value) - label_w):.1f}" height="{row - 10}"'
            f' fill="{color}"><title>{esc(node)}: {value:.2f} ({esc(said)})</title></rect>'
        )
        second = again.get(node)
        if isinstance(second, (int, float)):
            fill = RED if evicted else GREEN
            parts.append(
                f'<rect class="again" x="{label_w}" y="{y + row - 8}" width="{max(1.0, px(second) - label_w):.1f}"'
                f' height="4" fill="{fill}"><title>{esc(node)} again: {second:.2f}</title></rect>'
            )
        parts.append(_text(px(value) + 4, y + 14, f"{value:.1f}"))
    bottom = 22 + row * len(figures)
    if median is not None:
        parts.append(
            f'<line x1="{px(median):.1f}" x2="{px(median):.1f}" y1="18" y2="{bottom}" stroke="{GREY}">'
            f"<title>median {median:.2f}</title></line>"
        )
    if threshold is not None:
        parts.append(
            f'<line class="threshold" x1="{px(threshold):.1f}" x2="{px(threshold):.1f}" y1="16" y2="{bottom + 4}"'
            f' stroke="{RED}" stroke-width="2" stroke-dasharray="5,3"><title>threshold {threshold:.2f}</title></line>'
        )
        parts.append(
            _text(min(px(threshold), width - 110), bottom + 14, f"threshold {threshold:.1f}", size=10, fill=RED)
        )
    return _svg(width, height + 10, f"{probe} per node against its threshold", "".join(parts))


def timeline_svg(attempts: Sequence[Mapping[str, Any]], width: int = 640) -> str:
    """Each attempt as a bar over wall time, coloured by how it ended; drills and failures marked on it,
    the failure's kind and the decision written beside it."""
    if not attempts:
        return '<p class="empty">No training attempts recorded.</p>'
    label_w, row = 90, 34
    t0 = min(a["start"] for a in attempts)
    ends = [t for a in attempts for t in (a.get("end"), (a.get("decision") or {}).get("ts"), a["start"]) if t]
    t1 = max(ends)
    scale = (width - label_w - 20) / max(1e-6, t1 - t0)

    def px(ts: float) -> float:
        return label_w + (ts - t0) * scale

    parts = []
    for i, a in enumerate(attempts):
        y = 8 + i * row
        color = STATE_COLORS.get(a.get("state") or "", GREY)
        end = a.get("end") or t1
        parts.append(_text(label_w - 6, y + 14, f"attempt {a['attempt']}", anchor="end"))
        parts.append(
            f'<rect class="attempt" x="{px(a["start"]):.1f}" y="{y}" width="{max(2.0, px(end) - px(a["start"])):.1f}"'
            f' height="18" fill="{color}"><title>attempt {esc(a["attempt"])} on {esc(", ".join(a.get("nodes") or []))}:'
            f" {esc(a.get('state'))}</title></rect>"
        )
        for d in a.get("drills") or []:
            x = px(d["ts"])
            parts.append(
                f'<path d="M{x:.1f},{y - 3} l5,12 l-5,12 l-5,-12 z" fill="{ORANGE}"><title>drill {esc(d.get("fault"))}'
                f" on {esc(d.get('node'))} at step {esc(d.get('step'))}</title></path>"
            )
        failure, decision = a.get("failure"), a.get("decision")
        if failure or decision:
            note = " \u2192 ".join(str(x) for x in ((failure or {}).get("kind"), (decision or {}).get("action")) if x)
            parts.append(_text(min(px(end) + 4, width - 150), y + 30, note, size=10, fill=RED))
    parts.append(_text(label_w, 8 + row * len(attempts) + 6, "0 s", fill=GREY))
    parts.append(_text(width - 20, 8 + row * len(attempts) + 6, f"{t1 - t0:.1f} s", anchor="end", fill=GREY))
    return _svg(width, 8 + row * len(attempts) + 12, "training attempts over time", "".join(parts))


def _short(value: float) -> str:
    """An axis label: 3 significant digits, scientific for a learning rate's small values."""
    return f"{value:.3g}"


def series_svg(
    title: str,
    points: Sequence[Sequence[float]],
    bands: Sequence[Sequence[float]] = (),
    faults: Sequence[Mapping[str, Any]] = (),
    steps: tuple[float, float] | None = None,
    stepped: bool = False,
    name: str = "series",
    width: int = 640,
    height: int = 200,
) -> str:
    """One metric over steps: its line, the min-max band of each summed-up stretch (light), and a red dashed
    line at each fault. ``steps``: the x range shared by the run's charts, so they line up; ``stepped``: a
    value that holds until the next point (the world size); ``name``: the line's class."""
    finite = [(x, y) for x, y in points if isinstance(y, (int, float)) and math.isfinite(y)]
    if not finite:
        return f'<p class="empty">No {esc(title)} recorded.</p>'
    left, right, top, bottom = 60, 15, 22, 26
    x0, x1 = steps or (min(p[0] for p in finite), max(p[0] for p in finite))
    values = [y for _, y in finite] + [v for b in bands for v in b[2:4] if math.isfinite(v)]
    y0, y1 = min(values), max(values)
    if y1 - y0 < 1e-12:  # a flat series (a constant lr, one world size): centred, not on the axis
        y0, y1 = y0 - (abs(y0) or 1) * 0.1, y1 + (abs(y1) or 1) * 0.1
    sx, sy = (width - left - right) / max(1, x1 - x0), (height - top - bottom) / (y1 - y0)

    def px(step: float) -> float:
        return left + (step - x0) * sx

    def py(value: float) -> float:
        return height - bottom - (value - y0) * sy

    parts = [
        _text(left, 14, title, size=12),
        f'<line x1="{left}" x2="{left}" y1="{top}" y2="{height - bottom}" stroke="#999"/>',
        f'<line x1="{left}" x2="{width - right}" y1="{height - bottom}" y2="{height - bottom}" stroke="#999"/>',
        _text(left - 4, py(y0) + 4, _short(y0), anchor="end"),
        _text(left - 4, py(y1) + 4, _short(y1), anchor="end"),
        _text(left, height - 8, f"step {x0:g}"),
        _text(width - right, height - 8, f"step {x1:g}", anchor="end"),
    ]
    for first, last, low, high in bands:
        parts.append(
            f'<rect class="band" x="{px(first):.1f}" y="{py(high):.1f}" width="{max(1.0, px(last) - px(first)):.1f}"'
            f' height="{max(1.0, py(low) - py(high)):.1f}" fill="{LIGHT}" opacity="0.5"><title>steps {first:g}-{last:g}:'
            f" {_short(low)} to {_short(high)}</title></rect>"
        )
    for fault in faults:
        if fault.get("step") is None:
            continue
        x = px(min(max(fault["step"], x0), x1))
        parts.append(
            f'<line class="fault" x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{height - bottom}" stroke="{RED}"'
            f' stroke-dasharray="4"><title>{esc(fault.get("label"))} at step {esc(fault["step"])}</title></line>'
        )
    if stepped:
        ends = [*(x for x, _ in finite[1:]), x1]
        path = " ".join(f"{px(x):.1f},{py(y):.1f} {px(e):.1f},{py(y):.1f}" for (x, y), e in zip(finite, ends))
    else:
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in finite)
    parts.append(f'<polyline class="series {esc(name)}" fill="none" stroke="{BLUE}" stroke-width="2" points="{path}"/>')
    if len(finite) == 1:  # one point draws no line: a dot says where it is
        parts.append(f'<circle cx="{px(finite[0][0]):.1f}" cy="{py(finite[0][1]):.1f}" r="3" fill="{BLUE}"/>')
    return _svg(width, height, f"{title} versus step", "".join(parts))
