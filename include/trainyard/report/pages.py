"""HTML of a run summary: the self-contained report file and the pages of the training-runs view.

Both show the same sections, rendered from ``summarize``'s dict alone (no
file access here), so what the Airflow UI shows and what the report file
keeps cannot drift apart. Every value from the ledger is escaped. Links are
relative, so the view works under any base URL or proxy prefix.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

from trainyard.report.attempts import attempts_section
from trainyard.report.burn_in import burn_in_section
from trainyard.report.charts import esc, loss_svg
from trainyard.report.context import config_section, data_checks_section, gate_section, links_section, metrics_section
from trainyard.report.details import STAGES
from trainyard.report.faults import resumed_by_fault
from trainyard.report.html import badge as _badge
from trainyard.report.html import long as _long
from trainyard.report.html import num as _num
from trainyard.report.html import table as _table
from trainyard.report.html import when as _when

URL_PREFIX = "/trainyard"
"""Where the Airflow API server mounts the training-runs view (the plugin's ``url_prefix``)."""

RECOVERY_FIGURES = (
    ("detection_s", "failure detected after (s)"),
    ("resume_delay_s", "first step after the fault (s)"),
    ("detection_total_s", "cost, detection: fault to classified, all faults (s)"),
    ("restart_total_s", "cost, restart: classified to the new ranks loading state (s)"),
    ("restore_total_s", "cost, restore: state loaded and the first step again (s)"),
    ("replay_total_s", "cost, replay: lost steps trained again (s)"),
    ("lost_steps", "steps lost"),
    ("productive_s", "productive training time (s)"),
    ("ettr", "effective training time ratio"),
    ("world_path", "world size over time"),
    ("spares_joined", "nodes that joined in place"),
    ("spares_idle", "spares idle at the end"),
)

CSS = """body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse;margin:.5em 0}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top;max-width:28em;overflow-wrap:break-word}th{background:#f4f4f4}
.state{font-weight:bold;padding:1px 6px;border-radius:3px;color:#fff}.succeeded,.ok,.train,.valid{background:#2ca02c}
.failed,.evicted,.invalid{background:#d62728}.running,.spare{background:#1f77b4}.unknown{background:#7f7f7f}
span.state{display:inline-block;white-space:nowrap}table.attempts td{max-width:16em}.charts{display:flex;flex-wrap:wrap;gap:1em}nav a{margin-right:1em}
pre{white-space:pre-wrap;max-width:60em;font-size:12px}.empty{color:#777}"""


def run_href(dag_id: str, run_id: str) -> str:
    """A run's page, relative to the view's root. Run ids hold ':' and '+': every part is quoted."""
    return f"runs/{quote(dag_id, safe='')}/{quote(run_id, safe='')}"


def run_url(base_url: str, dag_id: str, run_id: str) -> str:
    """The run's page under the API server's base URL (``[api] base_url``)."""
    return f"{base_url.rstrip('/')}{URL_PREFIX}/{run_href(dag_id, run_id)}"


def _stage_state(s: Mapping[str, Any]) -> str:
    """A finished stage's badge; a failed one's whole error below it (the fix is often at its end)."""
    if s["ok"]:
        return _badge("ok")
    return _badge("failed") + (f'<pre class="error">{esc(s["error"])}</pre>' if s.get("error") else "")


def stages_section(summary: Mapping[str, Any]) -> str:
    """Every stage of the pipeline in order, one that never ran said so: the pipeline's shape stays visible."""
    done, running = summary["stages"], summary.get("running") or []
    names = [*STAGES, *(n for n in [*done, *running] if n not in STAGES)]
    rows = []
    for name in names:
        if name in done:
            s = done[name]
            rows.append([esc(name), _when(s.get("start")), _when(s.get("end")), f"{s['seconds']:.1f}", _stage_state(s)])
        elif name in running:
            rows.append([esc(name), "", "", "", _badge("running")])
        elif name == "report" and summary.get("writing_report"):
            rows.append([esc(name), "", "", "", '<span class="empty">writing this report</span>'])
        else:
            rows.append([esc(name), "", "", "", '<span class="empty">did not run</span>'])
    return "<h2>Stages</h2>" + _table(["stage", "start", "end", "seconds", "state"], rows, "stages")


def data_section(summary: Mapping[str, Any]) -> str:
    """What the data check passed, the files beside the shards it verified, and what it warned about."""
    data = summary.get("data")
    if not data:
        return ""
    text = ""
    if "shards" in data:
        beside = ", ".join(esc(name) for name in data["extra_files"]) or "none named (dataset.files)"
        text = f"<p>{esc(data['shards'])} {esc(data['format'])} files passed; files beside them verified: {beside}.</p>"
    warnings = "".join(f"<li>{esc(w)}</li>" for w in data["warnings"])
    return f"<h2>Data</h2>{text}" + (f"<p>Warnings:</p><ul>{warnings}</ul>" if warnings else "")


def loss_section(summary: Mapping[str, Any]) -> str:
    starts = [
        (a["resumed_step"], f"attempt {a['attempt']}")
        for a in summary.get("attempt_details") or []
        if a.get("resumed_step") is not None and a["attempt"] > 1
    ]
    boundaries = starts or summary.get("attempt_starts") or []
    text = ""
    if summary.get("steps_trained"):
        text = (
            f"<p>{summary['steps_trained']} steps trained (step {esc(summary['first_step'])} to"
            f" {esc(summary['last_step'])}); loss {_num(summary['first_loss'], 4)} \u2192"
            f" {_num(summary['last_loss'], 4)}. Dashed: where a later attempt resumed.</p>"
        )
    elif summary.get("steps_trained_why"):
        text = f"<p>Steps trained: unknown ({esc(summary['steps_trained_why'])}).</p>"
    bands = ((summary.get("metrics") or {}).get("loss") or {}).get("bands") or []
    return f"<h2>Loss</h2>{loss_svg(summary['loss_curve'], boundaries, bands=bands)}{text}"


def checkpoints_section(summary: Mapping[str, Any]) -> str:
    rows = []
    for c in summary.get("checkpoints") or []:
        validity = (
            "not validated"
            if c.get("valid") is None
            else _badge("valid")
            if c["valid"]
            else _badge("invalid") + " " + _long("; ".join(c.get("problems") or []))
        )
        fate = [esc(f) for f in c.get("fate") or []]
        if c.get("latest"):
            fate.insert(0, "<b>LATEST</b>")
        rows.append(
            [
                esc("-" if c.get("step") is None else c["step"]),
                esc(c.get("name")),
                esc(c.get("attempt") or ""),
                validity,
                "<br>".join(fate),
            ]
        )
    table = (
        _table(["step", "checkpoint", "saved by attempt", "validity", "what happened"], rows, "checkpoints")
        if rows
        else '<p class="empty">No checkpoint recorded.</p>'
    )
    gate = summary.get("gate")
    lines = [f"LATEST at the end of the run: {esc(summary.get('latest_checkpoint') or '-')}"]
    if gate:
        lines.append(
            f"Gate (check_checkpoint): {_badge('valid' if gate.get('valid') else 'invalid')} {esc(gate.get('path'))}"
            + (f" at step {esc(gate.get('step'))}" if gate.get("step") is not None else "")
            + (f" ({esc(gate.get('steps_short'))} short of max_steps)" if gate.get("steps_short") else "")
            + (f" {_long('; '.join(gate.get('problems') or []))}" if gate.get("problems") else "")
        )
    lines.append(f"Published: {esc(summary.get('published') or '-')}")
    return "<h2>Checkpoints</h2>" + table + "<p>" + "<br>".join(lines) + "</p>"


def _figure(figures: Mapping[str, Any], key: str) -> Any:
    """A figure, or ``unknown (why)`` where the run could not know it (a script that reports no steps)."""
    if figures.get(key) is not None:
        return figures[key]
    why = figures.get(key.removesuffix("_s") + "_why")
    return f"unknown ({why})" if why else "-"


def recovery_section(summary: Mapping[str, Any]) -> str:
    figures = summary.get("recovery")
    off = summary.get("hang_detection")
    said = f"<p>Hang detection: {esc(off)}</p>" if off else ""
    said += "".join(f"<p>Drill waiting: {esc(w)}</p>" for w in summary.get("drills_waiting") or [])
    if not figures:
        return ('<h2>Recovery figures</h2><p class="empty">No recovery figures recorded (training did not finish).</p>'
                + said)  # fmt: skip
    faulted = any(a.get("faults") for a in summary.get("attempt_details") or []) or summary.get("attempts", 0) > 1
    if not faulted:  # a healthy run: a table of dashes would read as figures missing
        kept = [(k, label) for k, label in RECOVERY_FIGURES if k in ("productive_s", "ettr", "world_path")]
        rows = [[esc(label), esc(_figure(figures, key))] for key, label in kept]
        return (f"<h2>Recovery figures</h2><p>No faults: the run trained in one attempt, nothing to recover from.</p>"
                f"{_table(['figure', 'value'], rows, 'recovery')}{said}")  # fmt: skip
    rows = [[esc(label), esc(_figure(figures, key))] for key, label in RECOVERY_FIGURES]
    rows += [[esc(label), esc(said)] for label, said in resumed_by_fault(figures)]  # what each went on from
    return (
        f"<h2>Recovery figures</h2>{_table(['figure', 'value'], rows, 'recovery')}"
        f"<p>Attempts: {esc(summary.get('attempts'))}</p>{said}"
    )


def sections(summary: Mapping[str, Any]) -> str:
    return "".join(
        f(summary)
        for f in (
            stages_section,
            config_section,
            data_section,
            data_checks_section,
            burn_in_section,
            attempts_section,
            loss_section,
            metrics_section,
            checkpoints_section,
            gate_section,
            recovery_section,
        )
    )


def _document(title: str, body: str) -> str:
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
        f"<style>{CSS}</style></head><body>{body}</body></html>"
    )


def _heading(summary: Mapping[str, Any], identity: Mapping[str, Any]) -> str:
    facts = [f"DAG <b>{esc(identity.get('dag_id'))}</b>", f"run <b>{esc(identity.get('run_id'))}</b>"]
    if identity.get("ds"):
        facts.append(f"date {esc(identity['ds'])}")
    facts += [
        _badge(summary.get("state")),
        f"started {_when(summary.get('started'))}",
        f"last event {_when(summary.get('ended'))}",
    ]
    return f"<p>{' &middot; '.join(facts)}</p>"


def report_html(summary: Mapping[str, Any], identity: Mapping[str, Any] | None = None) -> str:
    """The self-contained report file: the run's sections and nothing that needs a server."""
    identity = identity or {}
    return _document(
        f"trainyard run report {identity.get('run_id', '')}",
        f"<h1>trainyard run report</h1>{_heading(summary, identity)}{sections(summary)}{links_section(summary)}",
    )


def run_page(summary: Mapping[str, Any], identity: Mapping[str, Any], has_report: bool = False) -> str:
    """The view's page of one run; it lives at ``runs/<dag>/<run>``, so ``../../`` is the view's root."""
    here = "../../" + run_href(identity["dag_id"], identity["run_id"])
    links = ['<a href="../../">all training runs</a>', f'<a href="{esc(here)}/summary.json">summary (JSON)</a>']
    if has_report:
        links.append(f'<a href="{esc(here)}/report.html">report file</a>')
    body = (
        f"<nav>{''.join(links)}</nav><h1>Training run {esc(identity['run_id'])}</h1>"
        f"{_heading(summary, identity)}{sections(summary)}{links_section(summary, here + '/')}"
    )
    return _document(f"trainyard {identity['dag_id']} {identity['run_id']}", body)


def index_page(runs: Sequence[Mapping[str, Any]], root_label: str = "") -> str:
    """Runs grouped by DAG, newest first within each. The page lives at the view's root."""
    if not runs:
        return _document(
            "trainyard training runs",
            f'<h1>Training runs</h1><p class="empty">No run ledger found under {esc(root_label)}.</p>',
        )
    body = ["<h1>Training runs</h1>"]
    by_dag: dict[str, list[Mapping[str, Any]]] = {}
    for r in runs:
        by_dag.setdefault(r["dag_id"], []).append(r)
    for dag_id, items in sorted(by_dag.items()):
        items = sorted(items, key=lambda r: r.get("started") or 0, reverse=True)
        rows = [
            [
                f'<a href="{esc(run_href(r["dag_id"], r["run_id"]))}">{esc(r["run_id"])}</a>',
                esc(r.get("ds") or ""),
                _badge(r.get("state")),
                _when(r.get("started")),
                _num((r["ended"] - r["started"]) if r.get("ended") and r.get("started") else None, 1),
                esc(r.get("attempts") or 0),
                esc("unknown" if r.get("steps_trained") is None else r["steps_trained"]),
                _num(r.get("last_loss"), 4),
            ]
            for r in items
        ]
        body.append(
            f"<h2>{esc(dag_id)}</h2>"
            + _table(
                ["run", "date", "state", "started", "seconds", "attempts", "steps trained", "last loss"], rows, "runs"
            )
        )
    return _document("trainyard training runs", "".join(body))


def error_page(status: int, message: str, home: str = "../../") -> str:
    """``home``: the view's root relative to the page that failed."""
    return _document(
        f"trainyard: {status}",
        f'<nav><a href="{esc(home)}">all training runs</a></nav><h1>{status}</h1><p>{esc(message)}</p>',
    )


def to_json(data: Any) -> str:
    """JSON for the view's endpoints; a NaN loss (a diverged step) becomes null, which browsers can parse."""
    return json.dumps(_finite(data), default=str)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
