"""The sections that say what a run ran with and where to look further: its configuration (the pinned spec
and the trigger's overrides), the data check's and the gate's great-expectations results, the training
metrics over steps, and the links to the node logs and to the run's pages in Airflow.

Rendered from the summary's dict alone (``summary["details"]``: ``report.details.run_details``), as the
other sections are; every value is escaped.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from trainyard.report.charts import esc, series_svg
from trainyard.report.html import badge, table
from trainyard.report.metrics import METRICS

SPEC_SHOWN = 64 << 10
"""The most characters of the pinned spec shown (a spec with a long inline script is cut, said so)."""


def config_section(summary: Mapping[str, Any]) -> str:
    """The trigger's Params that changed the spec, then the whole spec as the run pinned it."""
    details, pinned = summary.get("details") or {}, summary.get("pinned") or {}
    overrides = pinned.get("overrides") or {}
    rows = [[esc(name), esc(json.dumps(v.get("spec"))), esc(json.dumps(v.get("run")))] for name, v in overrides.items()]
    changed = (
        "<p>Changed by the trigger's Params:</p>" + table(["param", "in the spec file", "this run"], rows, "overrides")
        if rows
        else '<p class="empty">No Param changed the spec file: the run used it as written.</p>'
    )
    source = f"<p>Spec file: <code>{esc(pinned['spec_file'])}</code></p>" if pinned.get("spec_file") else ""
    spec = details.get("spec")
    if spec is None:
        shown = '<p class="empty">No pinned spec found (spec.json).</p>'
    else:
        text = json.dumps(spec, indent=2)
        cut = f"\n... ({len(text) - SPEC_SHOWN} more characters in spec.json)" if len(text) > SPEC_SHOWN else ""
        shown = f'<details><summary>Pinned spec (spec.json)</summary><pre class="spec">{esc(text[:SPEC_SHOWN] + cut)}</pre></details>'
    return f"<h2>Configuration</h2>{source}{changed}{shown}"


def _checks(rows: list[Mapping[str, Any]], cls: str) -> str:
    body = [
        [
            esc(r.get("suite") or ""),
            esc(r.get("check")),
            badge("ok" if r.get("passed") else "failed"),
            esc(r.get("observed")),
        ]
        for r in rows
    ]
    return table(["table", "expectation", "result", "observed"], body, cls)


def data_checks_section(summary: Mapping[str, Any]) -> str:
    """Each expectation the data check evaluated (great-expectations), passed or not, with what it saw."""
    rows = (summary.get("details") or {}).get("data_checks") or []
    if not rows:
        return '<h2>Data check</h2><p class="empty">No data check result recorded (data_quality.json).</p>'
    passed = sum(1 for r in rows if r.get("passed"))
    return f"<h2>Data check</h2><p>{passed} of {len(rows)} expectations passed.</p>{_checks(rows, 'data-checks')}"


def gate_section(summary: Mapping[str, Any]) -> str:
    """The checkpoint gate: what it checked, each value against the run's, each problem and each metric check."""
    gate = summary.get("gate")
    if not gate:
        return '<h2>Checkpoint gate</h2><p class="empty">The gate has not checked a checkpoint.</p>'
    rows = [
        ["checkpoint", esc(gate.get("path"))],
        ["verdict", badge("valid" if gate.get("valid") else "invalid")],
        ["step checked", esc(gate.get("step"))],
        ["run's final step", esc(gate.get("target_step"))],
        ["steps short of it", esc(gate.get("steps_short"))],
        ["manifest sha256", f"<code>{esc(gate.get('manifest_sha256') or '-')}</code>"],
        ["check took (s)", esc(gate.get("seconds"))],
    ]
    problems = "".join(f"<li>{esc(p)}</li>" for p in gate.get("problems") or [])
    notes = "".join(f"<li>{esc(n)}</li>" for n in gate.get("notes") or [])
    metric_rows = (summary.get("details") or {}).get("gate_checks") or []
    return (
        "<h2>Checkpoint gate</h2>"
        + table(["check", "value"], rows, "gate")
        + (
            f'<p>Problems found:</p><ul class="gate-problems">{problems}</ul>'
            if problems
            else "<p>No problem found.</p>"
        )
        + (f"<p>Not checked:</p><ul>{notes}</ul>" if notes else "")
        + (
            "<p>Loss expectations (metric_quality.json):</p>" + _checks(metric_rows, "gate-checks")
            if metric_rows
            else ""
        )
    )


def metrics_section(summary: Mapping[str, Any]) -> str:
    """Throughput, step time, learning rate and world size over steps, on the loss curve's step range, with a
    red dashed line at each fault; a light band: the min-max of the steps one step event summed up."""
    series = summary.get("metrics") or {}
    faults = series.get("faults") or []
    loss = (series.get("loss") or {}).get("points") or []
    steps = (min(p[0] for p in loss), max(p[0] for p in loss)) if loss else None
    charts = [
        series_svg(title, series[name]["points"], series[name]["bands"], faults, steps, name=name)
        for name, title in METRICS
        if name in series and name != "loss"  # the loss has its own section, with where attempts resumed
    ]
    world = series.get("world_size") or []
    if world:
        charts.append(series_svg("world size (ranks)", world, (), faults, steps, stepped=True, name="world_size"))
    if not charts:
        return '<h2>Training metrics</h2><p class="empty">No step metrics recorded.</p>'
    said = "".join(f"<li>step {esc(f.get('step'))}: {esc(f.get('label'))}</li>" for f in faults)
    return (
        '<h2>Training metrics</h2><div class="charts">' + "".join(charts) + "</div>"
        + (f"<p>Faults (red dashed lines):</p><ul>{said}</ul>" if said else "<p>No faults.</p>")
    )  # fmt: skip


def links_section(summary: Mapping[str, Any], logs_href: str = "") -> str:
    """The run in Airflow (the DAG run, each task's log) and the node logs in the run folder (``logs_href``:
    where the node logs are relative to the page; the report file sits in the run folder)."""
    details = summary.get("details") or {}
    links = details.get("links") or {}
    items = []
    if links.get("dag_run"):
        items.append(f'<li><a class="dag-run" href="{esc(links["dag_run"])}">DAG run in Airflow</a></li>')
    tasks = " ".join(
        f'<a class="task-log" href="{esc(href)}">{esc(task)}</a>' for task, href in (links.get("tasks") or {}).items()
    )
    if tasks:
        items.append(f"<li>Airflow task logs: {tasks}</li>")
    logs = " ".join(
        f'<a class="node-log" href="{esc(logs_href + log["name"])}">{esc(log["name"])}</a> ({esc(log["bytes"])} bytes)'
        for log in details.get("node_logs") or []
    )
    items.append(f"<li>Node logs: {logs}</li>" if logs else '<li class="empty">No node log in the run folder.</li>')
    problems = "".join(f"<li>{esc(p)}</li>" for p in details.get("problems") or [])
    return f"<h2>Logs and links</h2><ul>{''.join(items)}</ul>" + (
        f"<p>Not shown:</p><ul>{problems}</ul>" if problems else ""
    )
