"""The run summary (text and JSON) and a self-contained HTML report, from the ledger.

Nothing here reads task logs: if a figure is not in the ledger, the stage that
knows it must record it.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from trainyard.atomic import write_json_atomic
from trainyard.ledger import Ledger

STAGES = ("stage_dataset", "check_dataset", "burn_in", "train", "check_checkpoint", "publish", "report")


def summarize(ledger: Ledger) -> dict[str, Any]:
    stages: dict[str, dict[str, Any]] = {}
    for e in ledger.events():
        if e["event"] in ("stage_end", "stage_failed"):
            stages[e["stage"]] = {"seconds": e["seconds"], "ok": e["event"] == "stage_end"}
    ends = {e["stage"]: e.get("result", {}) for e in ledger.events(event="stage_end")}
    # A step trained again after a recovery replaces the lost one.
    steps = sorted({e["step"]: e["loss"] for e in ledger.events("train", "step") if "loss" in e}.items())
    verdicts = {e["node"]: e for e in ledger.events("burn_in", "node_verdict")}
    return {
        "stages": stages,
        "nodes_used": ends.get("train", {}).get("nodes", []),
        "node_verdicts": {n: {"figures": v["figures"], "verdict": v["verdict"], "reason": v["reason"]} for n, v in verdicts.items()},
        "steps_trained": len({s for s, _ in steps}),
        "first_step": steps[0][0] if steps else None,
        "last_step": steps[-1][0] if steps else None,
        "first_loss": steps[0][1] if steps else None,
        "last_loss": steps[-1][1] if steps else None,
        "loss_curve": steps,
        "attempts": sum(1 for _ in ledger.events("train", "attempt_start")),
        "timeline": [
            {k: e.get(k) for k in ("ts", "event", "attempt", "nodes", "kind", "action", "reason", "evidence")}
            for e in ledger.events("train")
            if e["event"] in ("attempt_start", "attempt_end", "failure_classified", "decision", "drill_fired")
        ],
        "attempt_starts": [e["step"] for e in ledger.events("train", "resumed")],
        "recovery": next((e for e in reversed(list(ledger.events("train", "recovery_figures")))), None),
        "checkpoint": ends.get("check_checkpoint", {}).get("checkpoint"),
        "published": ends.get("publish", {}).get("uri"),
    }


def format_summary(summary: dict[str, Any]) -> str:
    lines = ["trainyard run summary", "  stages:"]
    for name in STAGES:
        if name in summary["stages"]:
            s = summary["stages"][name]
            lines.append(f"    {name:<17} {s['seconds']:>8.1f} s  {'ok' if s['ok'] else 'FAILED'}")
    lines.append(f"  nodes used:       {', '.join(summary['nodes_used']) or '-'}")
    if summary["steps_trained"]:
        lines.append(f"  steps trained:    {summary['steps_trained']} (step {summary['first_step']} to {summary['last_step']})")
        lines.append(f"  loss:             {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}")
    recovery = summary.get("recovery") or {}
    if summary["attempts"] > 1 and recovery:
        lines.append(f"  attempts:         {summary['attempts']} (detection {recovery.get('detection_s')} s, resume delay"
                     f" {recovery.get('resume_delay_s')} s, lost steps {recovery.get('lost_steps')}, ETTR {recovery.get('ettr')})")
    lines.append(f"  valid checkpoint: {summary['checkpoint'] or '-'}")
    lines.append(f"  published to:     {summary['published'] or '-'}")
    if summary.get("report"):
        lines.append(f"  report:           {summary['report']}")
    return "\n".join(lines)


def write_report(run_dir: Path, ledger: Ledger) -> dict[str, Any]:
    summary = summarize(ledger)
    summary["report"] = str(run_dir / "report.html")
    write_json_atomic(run_dir / "summary.json", summary)
    tmp = run_dir / ".report.html.tmp"
    tmp.write_text(_html(summary), encoding="utf-8")
    tmp.replace(run_dir / "report.html")
    return {"report": summary["report"], "summary": str(run_dir / "summary.json"),
            "steps_trained": summary["steps_trained"], "last_loss": summary["last_loss"]}


def _loss_svg(points: list[tuple[int, float]], boundaries: list[int] = (), width: int = 640, height: int = 240) -> str:
    if len(points) < 2:
        return "<p>No loss curve recorded.</p>"
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    sx = (width - 60) / max(1, x1 - x0)
    sy = (height - 40) / max(1e-9, y1 - y0)
    path = " ".join(f"{50 + (x - x0) * sx:.1f},{height - 25 - (y - y0) * sy:.1f}" for x, y in points)
    # A dashed line where a later attempt resumed: the steps after it were trained again.
    marks = "".join(
        f'<line x1="{50 + (b - x0) * sx:.1f}" x2="{50 + (b - x0) * sx:.1f}" y1="10" y2="{height - 25}"'
        f' stroke="#d62728" stroke-dasharray="4"/>' for b in boundaries
    )
    return (
        f'<svg width="{width}" height="{height}" role="img" aria-label="loss versus step">{marks}'
        f'<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{path}"/>'
        f'<text x="5" y="15" font-size="12">{y1:.3f}</text><text x="5" y="{height - 25}" font-size="12">{y0:.3f}</text>'
        f'<text x="50" y="{height - 5}" font-size="12">step {x0}</text>'
        f'<text x="{width - 80}" y="{height - 5}" font-size="12">step {x1}</text></svg>'
    )


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _html(summary: dict[str, Any]) -> str:
    esc = html.escape
    stage_rows = "".join(
        f"<tr><td>{esc(n)}</td><td>{s['seconds']:.1f} s</td><td>{'ok' if s['ok'] else 'FAILED'}</td></tr>"
        for n, s in summary["stages"].items()
    )
    probes = ("matmul_gflops", "membw_gbps", "disk_write_mbps", "disk_read_mbps")
    node_rows = "".join(
        f"<tr><td>{esc(n)}</td>" + "".join(f"<td>{_number((v['figures'] or {}).get(p))}</td>" for p in probes)
        + f"<td>{esc(v['verdict'])}</td><td>{esc(v['reason'])}</td></tr>"
        for n, v in summary["node_verdicts"].items()
    )
    timeline = "".join(
        f"<tr><td>{esc(e['event'])}</td><td>{e.get('attempt') or ''}</td>"
        f"<td>{esc(' '.join(str(e[k]) for k in ('kind', 'action', 'reason', 'evidence') if e.get(k)))}</td></tr>"
        for e in summary["timeline"]
    )
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>trainyard run report</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:4px 8px}}</style>
</head><body><h1>trainyard run report</h1>
<h2>Stages</h2><table><tr><th>stage</th><th>time</th><th>state</th></tr>{stage_rows}</table>
<h2>Nodes</h2><table><tr><th>node</th><th>matmul GFLOP/s</th><th>memory GB/s</th><th>disk write MB/s</th>
<th>disk read MB/s</th><th>verdict</th><th>reason</th></tr>{node_rows}</table>
<h2>Loss</h2>{_loss_svg(summary['loss_curve'], summary['attempt_starts'])}
<h2>Attempts</h2><table><tr><th>event</th><th>attempt</th><th>detail</th></tr>{timeline}</table>
<p>Recovery: {esc(json.dumps({k: v for k, v in (summary['recovery'] or {}).items() if k not in ('ts', 'stage', 'event')}))}</p>
<p>Steps trained: {summary['steps_trained']}; attempts: {summary['attempts']}</p>
<h2>Checkpoint</h2><p>Valid: {esc(str(summary['checkpoint']))}<br>Published: {esc(str(summary['published']))}</p>
</body></html>"""
