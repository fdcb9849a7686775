"""The run summary (text and JSON) and a self-contained HTML report, from the ledger.

Nothing here reads task logs: if a figure is not in the ledger, the stage that
knows it must record it. The same summary feeds the report file, the
training-runs view in the Airflow UI (``trainyard.report.pages``) and its JSON.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from trainyard.atomic import read_json, write_json_atomic, write_text_atomic
from trainyard.events.fold import RunState, TrainRun, fold, run_state
from trainyard.events.ledger import Ledger
from trainyard.events.records import DecisionTaken, FailureSeen, Growth
from trainyard.protocol import steps as progress
from trainyard.protocol.heartbeat import HOW_TO_BEAT
from trainyard.recovery.figures import figures_from
from trainyard.report.details import STAGES, run_details
from trainyard.report.faults import attempt_lines, cost_line, resumed_by_fault
from trainyard.report.metrics import series
from trainyard.report.pages import report_html

__all__ = ["STAGES", "attempt_table", "format_summary", "run_state", "summarize", "summary_of", "write_report"]
DECISION_FIELDS = ("new_nodes", "micro_batch", "delay_s", "to_step", "path", "left_out", "joiners", "generation")
"""The decision's fields an attempt row keeps beside its kind, action and reason (those that were set)."""


def summarize(ledger: Ledger) -> dict[str, Any]:
    """The run's summary, from the one fold of its ledger (one read of the lines appended since the last,
    see trainyard.events.ledger); nothing here reads an event itself."""
    return summary_of(fold(ledger.events()))


def summary_of(state: RunState, closing: bool = False) -> dict[str, Any]:
    """The summary of a folded run; ``closing``: written by the report stage as it ends the run."""
    train = state.train
    steps = progress.loss_points(train.steps)  # a step trained again after a recovery replaces the lost one
    limits, gate = state.limits, state.gated
    return {
        "state": state.state(closing),
        "started": state.started,
        "ended": state.ended,
        "stages": state.stages,
        # The report stage is still open as it writes its own summary: it is not what runs.
        "running": [s for s in state.running if not (closing and s == "report")],
        "writing_report": closing and "report" in state.running,  # its own row says so, not "did not run"
        # The final attempt's group (after a scale-down or a regroup), not the nodes the stage started on.
        "nodes_used": list(last.nodes) if (last := train.last) else state.results.get("train", {}).get("nodes", []),
        "node_verdicts": {n: asdict(v) for n, v in state.verdicts.items()},
        "thresholds": None if limits is None else asdict(limits),
        # No step events: a script that reports none trained an unknown number of steps, not 0.
        "steps_trained": progress.steps_trained(train.steps) if train.steps else None,
        "steps_trained_why": None if train.steps else progress.NO_STEPS,
        # The steps trained, whether or not their events carry a loss (a log may say "Step 5/200" and no loss).
        "first_step": min((progress.first_step(e) for e in train.steps), default=None),
        "last_step": max((int(e["step"]) for e in train.steps), default=None),
        "first_loss": steps[0][1] if steps else None,
        "last_loss": steps[-1][1] if steps else None,
        "loss_curve": progress.downsample(steps),  # a chart's worth, however long the run
        "attempts": len(train.attempts),
        "attempt_details": (attempts := attempt_table(train)),
        # Every step event's loss, throughput, step time and lr, with the world size and the faults by step.
        "metrics": series(train.steps, train.worlds, attempts, loss=steps),
        "pinned": state.pinned,
        "world_path": train.world_path,
        "recovery_path": _recovery_path(train),
        "hang_detection": _hang_detection(train),
        # A rehearsal that did nothing says so: its node was a spare outside the group and never joined in time.
        "drills_waiting": [f"{w.fault} at step {w.step} on {w.node}: {w.reason}" for w in train.still_waiting],
        "attempt_starts": list(train.resumed_steps),
        "recovery": _figures(state),
        "checkpoints": [asdict(r) for r in state.checkpoints],
        "latest_checkpoint": state.latest_checkpoint,
        "gate": None if gate is None else {**asdict(gate), "problems": list(gate.problems)},
        "checkpoint": state.results.get("check_checkpoint", {}).get("checkpoint"),
        "published": state.results.get("publish", {}).get("uri"),
        "data": _data(state),
    }


WALL_FIGURES = ("productive_s", "productive_why", "ettr", "ettr_why")
"""The figures that need the train stage's wall time, which the stage records only as it ends."""


def _figures(state: RunState) -> dict[str, Any] | None:
    """The recovery figures the train stage recorded as it finished its attempts, with each fault's row from the
    whole fold; once the stage has ended, the ones that need its wall time (ETTR) from it too."""
    if state.train.figures is None:
        return None
    figures = dict(state.train.figures)
    folded = figures_from(state)
    # Each fault's own row (what it resumed from and why, its split) is not in the recorded event: the fold's.
    figures["failures"] = folded["failures"]
    if "train" in state.stages:
        figures.update({k: folded[k] for k in WALL_FIGURES if k in folded})
    return figures


def _data(state: RunState) -> dict[str, Any] | None:
    """What the data check passed (its shards, the ``dataset.files`` verified) and its warnings, which hold
    staging's; before the check has passed, staging's warnings alone. None before either said anything."""
    checked, staged = state.results.get("check_dataset"), state.results.get("stage_dataset")
    if checked is None and not (staged or {}).get("warnings"):
        return None
    data = {"warnings": list((checked or staged or {}).get("warnings") or [])}
    if checked is not None:
        data.update({name: checked.get(name) for name in ("format", "shards", "tokens", "documents")})
        data["extra_files"] = list(checked.get("extra_files") or [])
    return data


def _recovery_path(train: TrainRun) -> str | None:
    """How a lost node is healed, as the train stage's latest ``recovery_path`` says: a relaunch and why, or in
    place -- said as done only once a group formed on the store (the ranks joined it, or a regroup happened);
    allowed but unproven (a script that may never group), "not yet". None before the train stage starts."""
    if train.in_place is None:
        return None
    if not train.in_place:
        return f"relaunch: {train.why_not or 'no reason recorded'}"
    return "in place" if train.grouped or train.formed else "in place (not yet: no group formed)"


def _hang_detection(train: TrainRun) -> str | None:
    """``off: why, and how to turn it on`` where the script writes no heartbeats (``hang_detection_off``); else None."""
    if train.hang_detection_off is None:
        return None
    return f"off: {train.hang_detection_off}; to turn it on, {HOW_TO_BEAT}"


def _failure(f: FailureSeen) -> dict[str, Any]:
    return {"ts": f.at, "kind": f.kind, "evidence": f.evidence, "culprits": list(f.culprits), "step": f.step}


def _decision(d: DecisionTaken) -> dict[str, Any]:
    row: dict[str, Any] = {"ts": d.at, "kind": d.kind, "action": d.action, "reason": d.reason}
    for name in DECISION_FIELDS:
        value = getattr(d, name)
        if value is not None and value != () and not (name == "delay_s" and not value):
            row[name] = list(value) if isinstance(value, tuple) else value
    return row


def _growth(g: Growth) -> dict[str, Any]:
    return {"ts": g.at, "generation": g.generation, "nodes": list(g.nodes), "joiners": list(g.joiners),
            "micro_batch": g.micro_batch, "world_size": g.world_size}  # fmt: skip


def attempt_table(train: TrainRun) -> list[dict[str, Any]]:
    """One row per training attempt: what it ran on, how it ended, and EVERY fault (failure and decision, with
    the path, the joiners and the generation of one healed in place) and growth of its world, in order."""
    rows = []
    for a in train.attempts:
        faults = [
            {
                "failure": _failure(f.failure) if f.failure else None,
                "decision": _decision(f.decision) if f.decision else None,
            }
            for f in a.faults
        ]
        row: dict[str, Any] = {
            "attempt": a.number,
            "start": a.started,
            "end": a.ended,
            "state": a.state,
            "nodes": list(a.start_nodes),
            "world_size": a.world_size,
            "micro_batch": a.start_micro_batch,
            "resume_from": a.resume_from,
            "resumed_step": a.resumed_step,
            "drills": [{"ts": d.at, "fault": d.fault, "node": d.node, "step": d.step} for d in a.drills],
            "faults": faults,
            "growths": [_growth(g) for g in a.growths],
            # The last of each, for the timeline chart.
            "failure": next((f["failure"] for f in reversed(faults) if f["failure"]), None),
            "decision": next((f["decision"] for f in reversed(faults) if f["decision"]), None),
        }
        if a.ended is not None:
            row.update(trigger=a.trigger, reason=a.reason, last_step=a.last_step,
                       seconds=a.seconds if a.seconds is not None else round(a.ended - a.started, 3))  # fmt: skip
        rows.append(row)
    return rows


def format_summary(summary: dict[str, Any]) -> str:
    lines = ["trainyard run summary", "  stages:"]
    for name in STAGES:
        if name in summary["stages"]:
            s = summary["stages"][name]
            lines.append(f"    {name:<17} {s['seconds']:>8.1f} s  {'ok' if s['ok'] else 'FAILED'}")
            if not s["ok"] and s.get("error"):  # the ledger's reason: without it FAILED says nothing to act on
                lines += [f"      {line}" for line in str(s["error"]).splitlines()]
    lines += _data_lines(summary.get("data"))
    lines.append(f"  nodes used:       {', '.join(summary['nodes_used']) or '-'}")
    if summary["steps_trained"]:
        lines.append(
            f"  steps trained:    {summary['steps_trained']} (step {summary['first_step']} to {summary['last_step']})"
        )
        if summary["first_loss"] is not None and summary["last_loss"] is not None:
            lines.append(f"  loss:             {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}")
    elif summary.get("steps_trained_why") and summary["attempts"]:
        lines.append(f"  steps trained:    unknown ({summary['steps_trained_why']})")
    recovery = summary.get("recovery") or {}
    if summary["attempts"] > 1 and recovery:
        lines.append(
            f"  attempts:         {summary['attempts']} (detection {recovery.get('detection_s')} s, resume delay"
            f" {_known(recovery, 'resume_delay_s', ' s')}, lost steps {_known(recovery, 'lost_steps')},"
            f" ETTR {_known(recovery, 'ettr')})"
        )
    if cost := cost_line(recovery):  # in place, every fault is in one attempt: not only when there were several
        lines.append(f"  fault cost:       {cost}")
    lines += [f"  {label}: {said}" for label, said in resumed_by_fault(recovery)]
    for row in summary.get("attempt_details") or []:
        lines.append(f"  attempt {row['attempt']}:        {row['state']} on {', '.join(row.get('nodes') or []) or '-'}")
        lines += [f"    {line}" for line in attempt_lines(row)]
    if summary.get("recovery_path"):
        lines.append(f"  recovery path:    {summary['recovery_path']}")
    if summary.get("world_path"):
        lines.append(f"  world path:       {summary['world_path']}")
    if summary.get("hang_detection"):
        lines.append(f"  hang detection:   {summary['hang_detection']}")
    lines += [f"  drill waiting:    {said}" for said in summary.get("drills_waiting") or []]
    lines.append(f"  valid checkpoint: {summary['checkpoint'] or '-'}")
    lines.append(f"  published to:     {summary['published'] or '-'}")
    if summary.get("report"):
        lines.append(f"  report:           {summary['report']}")
    return "\n".join(lines)


def _data_lines(data: dict[str, Any] | None) -> list[str]:
    if not data:
        return []
    lines = []
    if "shards" in data:
        beside = f"; beside them {', '.join(data['extra_files'])}" if data["extra_files"] else ""
        lines.append(f"  data checked:     {data['shards']} {data['format']} files{beside}")
    return lines + [f"  data warning:     {w}" for w in data["warnings"]]


def _known(figures: dict[str, Any], name: str, unit: str = "") -> str:
    """A recovery figure with its unit, or ``unknown (why)`` where the run could not know it (never 0)."""
    value = figures.get(name)
    if value is not None:
        return f"{value}{unit}"
    why = figures.get(name.removesuffix("_s") + "_why")
    return f"unknown ({why})" if why else "-"


def write_report(run_dir: Path, state: RunState, airflow_base: str = "/") -> dict[str, Any]:
    """Write the folded run's ``summary.json`` and ``report.html``; the summary written (``report``, ``summary``:
    where). ``airflow_base``: Airflow's UI root for the report's links (``[api] base_url``; "/": this host's)."""
    # Written by the report stage itself, which is still open: the run's outcome is the other stages'.
    summary = summary_of(state, closing=True)
    identity = run_identity(run_dir)
    summary["details"] = run_details(run_dir, identity["dag_id"], identity["run_id"], airflow_base)
    summary["report"] = str(run_dir / "report.html")
    summary["summary"] = str(run_dir / "summary.json")
    write_json_atomic(run_dir / "summary.json", summary)
    write_text_atomic(run_dir / "report.html", report_html(summary, identity))
    return summary


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
