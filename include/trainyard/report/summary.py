"""The run summary (text and JSON) and a self-contained HTML report, from the ledger.

Nothing here reads task logs: if a figure is not in the ledger, the stage that
knows it must record it. The same summary feeds the report file, the
training-runs view in the Airflow UI (``trainyard.report.pages``) and its JSON.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trainyard.atomic import read_json, write_json_atomic, write_text_atomic
from trainyard.events.ledger import Ledger
from trainyard.protocol import steps as progress
from trainyard.report.pages import report_html

STAGES = ("stage_dataset", "check_dataset", "burn_in", "train", "check_checkpoint", "publish", "report")
ATTEMPT_EVENTS = ("attempt_start", "attempt_end", "failure_classified", "decision", "drill_fired")
DECISION_FIELDS = ("action", "reason", "new_nodes", "micro_batch", "delay_s", "to_step")


def summarize(ledger: Ledger) -> dict[str, Any]:
    events = list(ledger.events())  # one read (of the lines appended since the last, see trainyard.events.ledger)
    train = [e for e in events if e.get("stage") == "train"]
    ends = {e["stage"]: e.get("result", {}) for e in events if e["event"] == "stage_end"}
    stages, running = stage_table(events)
    # A step trained again after a recovery replaces the lost one.
    step_events = [e for e in train if e["event"] == "step"]
    steps = progress.loss_points(step_events)
    verdicts = {e["node"]: e for e in events if e.get("stage") == "burn_in" and e["event"] == "node_verdict"}
    thresholds = _last(e for e in events if e.get("stage") == "burn_in" and e["event"] == "thresholds")
    checkpoints, latest = checkpoint_table(events)
    return {
        "state": run_state(stages, running),
        "started": events[0]["ts"] if events else None,
        "ended": events[-1]["ts"] if events else None,
        "stages": stages,
        "running": running,
        "nodes_used": ends.get("train", {}).get("nodes", []),
        # .get: the view also shows ledgers written by older versions of the stages.
        "node_verdicts": {
            n: {k: v.get(k) for k in ("figures", "again", "suspect", "verdict", "reason", "collective")}
            for n, v in verdicts.items()
        },
        "thresholds": {
            "thresholds": thresholds.get("thresholds"),
            # ledgers from before the confirmation round name the reference "medians"
            "references": thresholds.get("reference_values") or thresholds.get("medians"),
            "seconds": thresholds.get("seconds"),
        }
        if thresholds
        else None,
        "steps_trained": progress.steps_trained(step_events),
        "first_step": steps[0][0] if steps else None,
        "last_step": steps[-1][0] if steps else None,
        "first_loss": steps[0][1] if steps else None,
        "last_loss": steps[-1][1] if steps else None,
        "loss_curve": progress.downsample(steps),  # a chart's worth, however long the run
        "attempts": sum(1 for e in train if e["event"] == "attempt_start"),
        "attempt_details": attempt_table(train),
        "timeline": [
            {k: e.get(k) for k in ("ts", "event", "attempt", "nodes", "kind", "action", "reason", "evidence")}
            for e in train
            if e["event"] in ATTEMPT_EVENTS
        ],
        "attempt_starts": [e["step"] for e in train if e["event"] == "resumed"],
        "recovery": _last(e for e in train if e["event"] == "recovery_figures"),
        "checkpoints": checkpoints,
        "latest_checkpoint": latest,
        "gate": _last(e for e in events if e["event"] == "checkpoint_checked"),
        "checkpoint": ends.get("check_checkpoint", {}).get("checkpoint"),
        "published": ends.get("publish", {}).get("uri"),
    }


def _last(events: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    found = None
    for event in events:
        found = event
    return found


def stage_table(events: list[dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Finished stages in the order they finished (a retried stage: its last try), and the unfinished ones.

    Only finished stages go in the table, so ``seconds`` and ``ok`` are always set;
    a stage started again after a failure is both in the table and running.
    """
    stages: dict[str, dict[str, Any]] = {}
    started: dict[str, float] = {}
    for e in events:
        if e["event"] not in ("stage_start", "stage_end", "stage_failed"):
            continue
        name: str = e["stage"]  # Ledger.append writes it on every event
        if e["event"] == "stage_start":
            started.setdefault(name, e["ts"])  # a deferred task logs a start per wake-up: keep the first
        else:
            stages.pop(name, None)  # a retry's end replaces the failed try, at its own place
            stages[name] = {
                "seconds": e["seconds"],
                "ok": e["event"] == "stage_end",
                "start": started.pop(name, e["ts"] - e["seconds"]),
                "end": e["ts"],
            }
            if e["event"] == "stage_failed":
                stages[name]["error"] = f"{e.get('error', '')}: {e.get('message', '')}".strip(": ")
    return stages, [name for name in started]


def run_state(stages: dict[str, dict[str, Any]], running: list[str]) -> str:
    """``running`` while a stage is open, else ``failed`` if one failed, else ``succeeded`` once the report
    stage ended; before that the run is between tasks, so still ``running``."""
    if running:
        return "running"
    if any(not s["ok"] for s in stages.values()):
        return "failed"
    return "succeeded" if "report" in stages else "running"


def attempt_table(train: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per training attempt: what it ran on, how it ended, the failure's kind and the decision."""
    rows: dict[int, dict[str, Any]] = {}
    current: dict[str, Any] | None = None
    for e in train:
        kind = e["event"]
        if kind == "attempt_start":
            current = rows[e["attempt"]] = {
                "attempt": e["attempt"],
                "start": e["ts"],
                "end": None,
                "state": "running",
                **{k: e.get(k) for k in ("nodes", "world_size", "micro_batch", "resume_from")},
                "resumed_step": None,
                "drills": [],
                "failure": None,
                "decision": None,
            }
            continue
        attempt = e.get("attempt")
        row = current if attempt is None else rows.get(attempt)
        if row is None:
            continue
        if kind == "attempt_end":
            row.update(
                end=e["ts"],
                state=e.get("state"),
                trigger=e.get("trigger"),
                reason=e.get("reason"),
                last_step=e.get("last_step"),
                seconds=e.get("seconds", round(e["ts"] - row["start"], 3)),
            )
        elif kind == "resumed" and row["resumed_step"] is None:
            row["resumed_step"] = e.get("step")
        elif kind == "drill_fired":  # written by the workload, which does not know the attempt number
            row["drills"].append({k: e.get(k) for k in ("ts", "fault", "node", "step")})
        elif kind == "failure_classified":
            row["failure"] = {k: e.get(k) for k in ("ts", "kind", "evidence", "culprits")}
        elif kind == "decision":
            row["decision"] = {"ts": e["ts"], **{k: e[k] for k in DECISION_FIELDS if k in e}}
    return list(rows.values())


def checkpoint_table(events: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str | None]:
    """Every checkpoint the run saved or started from, with its validity and fate; and what ``LATEST``
    named when the ledger ends (the last promotion or lineage reset)."""
    rows: dict[str, dict[str, Any]] = {}
    latest: str | None = None

    def row(path: str, step: Any = None) -> dict[str, Any]:
        if path not in rows:
            rows[path] = {
                "path": path,
                "name": os.path.basename(path),
                "step": step,
                "attempt": None,
                "saved_at": None,
                "valid": None,
                "problems": [],
                "fate": [],
            }
        if step is not None and rows[path]["step"] is None:
            rows[path]["step"] = step
        return rows[path]

    for e in events:
        kind, path = e["event"], e.get("path")
        if kind == "lineage_reset":
            latest = path
            if path:
                row(path)["fate"].append("lineage start")
        elif kind == "rolled_back":
            for r in rows.values():
                if r["saved_at"] is not None and (r["step"] or 0) > e["to_step"]:
                    r["fate"].append(f"superseded (rollback to step {e['to_step']})")
        elif not path or not kind.startswith("checkpoint_"):
            continue
        elif kind == "checkpoint_saved":
            r = row(path, e.get("step"))
            r.update(attempt=e.get("attempt"), saved_at=e["ts"], valid=None, problems=[])
        elif kind == "checkpoint_validated":
            row(path, e.get("step")).update(valid=bool(e.get("valid")), problems=list(e.get("problems") or []))
        elif kind == "checkpoint_promoted":
            latest = path
            row(path, e.get("step"))["fate"].append("promoted")
        elif kind == "checkpoint_quarantined":
            r = row(path)
            r.update(valid=False, problems=list(e.get("problems") or r["problems"]))
            r["fate"].append(f"quarantined to {e.get('to')}")
        elif kind == "checkpoint_retired":
            row(path, e.get("step"))["fate"].append("retired (keep_hot)")
        elif kind == "checkpoint_tiered":
            row(path)["fate"].append(f"tiered to {e.get('uri')}")
        elif kind == "checkpoint_checked":
            r = row(path)
            r["fate"].append("gate passed" if e.get("valid") else "gate failed: " + "; ".join(e.get("problems") or []))
    for r in rows.values():
        r["latest"] = r["path"] == latest
    return sorted(rows.values(), key=lambda r: (r["step"] is None, r["step"] or 0, r["path"])), latest


def format_summary(summary: dict[str, Any]) -> str:
    lines = ["trainyard run summary", "  stages:"]
    for name in STAGES:
        if name in summary["stages"]:
            s = summary["stages"][name]
            lines.append(f"    {name:<17} {s['seconds']:>8.1f} s  {'ok' if s['ok'] else 'FAILED'}")
    lines.append(f"  nodes used:       {', '.join(summary['nodes_used']) or '-'}")
    if summary["steps_trained"]:
        lines.append(
            f"  steps trained:    {summary['steps_trained']} (step {summary['first_step']} to {summary['last_step']})"
        )
        lines.append(f"  loss:             {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}")
    recovery = summary.get("recovery") or {}
    if summary["attempts"] > 1 and recovery:
        lines.append(
            f"  attempts:         {summary['attempts']} (detection {recovery.get('detection_s')} s, resume delay"
            f" {recovery.get('resume_delay_s')} s, lost steps {recovery.get('lost_steps')}, ETTR {recovery.get('ettr')})"
        )
    lines.append(f"  valid checkpoint: {summary['checkpoint'] or '-'}")
    lines.append(f"  published to:     {summary['published'] or '-'}")
    if summary.get("report"):
        lines.append(f"  report:           {summary['report']}")
    return "\n".join(lines)


def write_report(run_dir: Path, ledger: Ledger) -> dict[str, Any]:
    summary = summarize(ledger)
    # Written by the report stage itself, which is still open: the run's outcome is the other stages'.
    summary["running"] = [s for s in summary["running"] if s != "report"]
    summary["state"] = "failed" if any(not s["ok"] for s in summary["stages"].values()) else "succeeded"
    summary["report"] = str(run_dir / "report.html")
    write_json_atomic(run_dir / "summary.json", summary)
    write_text_atomic(run_dir / "report.html", report_html(summary, run_identity(run_dir)))
    return {
        "report": summary["report"],
        "summary": str(run_dir / "summary.json"),
        "steps_trained": summary["steps_trained"],
        "last_loss": summary["last_loss"],
    }


def run_identity(run_dir: Path) -> dict[str, Any]:
    """DAG id, run id and date from the run's spec snapshot (the folder names are file-system-safe forms)."""
    try:
        snap = read_json(run_dir / "spec.json")
    except (OSError, ValueError):
        snap = {}
    return {
        "dag_id": snap.get("dag_id") or run_dir.parent.name,
        "run_id": snap.get("run_id") or run_dir.name,
        "ds": snap.get("ds"),
    }
