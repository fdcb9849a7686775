"""THE fold: a run ledger turned into run state, once, for every reader.

``fold(events) -> RunState``: the stages (start, end or failure, seconds,
result, why one failed), the run's state, the burn-in (every node's verdict,
the thresholds), the training (``TrainRun``, ``trainyard.events.train``: the
resume point, every attempt with EVERY failure and EVERY decision taken about
it, in order, its regroups and growth, the world size over time, the spares,
the drills, the steps, the recovery figures), the checkpoints (saved,
validated, quarantined, tiered, published) and the gate's verdict. The
controller (``recovery.state``), the report, ``trainyard summary``, the
recovery figures, the metrics, the notice, the drill and the resume point all
read it; none reads an event dict itself (docs/architecture.md, the event
model). The run's pinned Params are kept too. Old ledgers' names are read here, and only here.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from trainyard.events.records import Gated, Limits, NodeJudged, StageError
from trainyard.events.train import TRAIN, Event, TrainRun

__all__ = ["TRAIN", "CheckpointRow", "Event", "Gated", "RunState", "TrainRun", "fold", "run_state"]

BURN_IN = "burn_in"


@dataclass
class CheckpointRow:
    path: str
    name: str
    step: int | None = None
    attempt: int | None = None
    saved_at: float | None = None
    blocked_s: float | None = None
    """How long the save held training up (``checkpoint_saved``'s ``blocked_s``); None: not said."""
    valid: bool | None = None
    problems: list[str] = field(default_factory=list)
    fate: list[str] = field(default_factory=list)
    latest: bool = False


@dataclass(frozen=True)
class RunState:
    stages: dict[str, dict[str, Any]]
    """Finished stages in the order they finished (a retried stage: its last try): seconds, ok, start, end."""
    running: list[str]
    """Stages started and not finished (a stage started again after a failure is in both)."""
    train: TrainRun
    checkpoints: list[CheckpointRow]
    latest_checkpoint: str | None
    """What ``LATEST`` named when the ledger ends (the last promotion or lineage reset)."""
    gated: Gated | None = None
    """The gate's last ``checkpoint_checked`` (None: the gate has not checked one): what publish may take."""
    results: dict[str, Any] = field(default_factory=dict)
    """Each stage's result as its last ``stage_end`` recorded it."""
    errors: dict[str, StageError] = field(default_factory=dict)
    """Each failed stage's last ``stage_failed``: the error's class and message."""
    verdicts: dict[str, NodeJudged] = field(default_factory=dict)
    """The burn-in's verdict of each node (its last ``node_verdict``)."""
    limits: Limits | None = None
    """The burn-in's last ``thresholds``; None: none recorded."""
    started: float | None = None
    """The first event's time; None: an empty ledger."""
    ended: float | None = None
    """The last event's time."""
    pinned: dict[str, Any] | None = None
    """The run's ``params`` event (written as its spec was pinned): the trigger's Params, which of them differ
    from the spec file (``overrides``: param -> spec and run values) and the spec file; None: not pinned yet."""

    def state(self, closing: bool = False) -> str:
        """The run's state (see ``run_state``); ``closing``: asked by the report stage, which ends the run."""
        return run_state(self.stages, self.running, closing)


def run_state(stages: dict[str, dict[str, Any]], running: list[str], closing: bool = False) -> str:
    """``running`` while a stage is open, else ``failed`` if one failed, else ``succeeded`` once the report
    stage ended; before that the run is between tasks, so still ``running``. ``closing``: the report stage
    asks as it ends the run (itself still open): the outcome is the other stages'."""
    if running and not closing:
        return "running"
    if any(not s["ok"] for s in stages.values()):
        return "failed"
    return "succeeded" if closing or "report" in stages else "running"


def fold(events: Iterable[Event]) -> RunState:
    """The run state of a ledger's events (in time order)."""
    events = list(events)
    stages, running, results, errors = _stages(events)
    checkpoints, latest = _checkpoints(events)
    verdicts, limits = _burn_in(events)
    return RunState(
        stages, running, TrainRun.of(events), checkpoints, latest, _gated(events), results, errors, verdicts, limits,
        events[0]["ts"] if events else None, events[-1]["ts"] if events else None, _pinned(events),
    )  # fmt: skip


def _pinned(events: list[Event]) -> dict[str, Any] | None:
    pinned = next((e for e in events if e["event"] == "params"), None)
    if pinned is None:
        return None
    return {"params": dict(pinned.get("params") or {}), "overrides": dict(pinned.get("overrides") or {}),
            "spec_file": pinned.get("spec_file")}  # fmt: skip


def _gated(events: list[Event]) -> Gated | None:
    checked = [e for e in events if e["event"] == "checkpoint_checked" and e.get("path")]
    if not checked:
        return None
    last = checked[-1]
    return Gated(str(last["path"]), last.get("valid") is True, last.get("manifest_sha256"),
                 tuple(last.get("problems") or ()), tuple(last.get("notes") or ()), last.get("seconds"),
                 last.get("ts"), last.get("step"), last.get("target_step"), last.get("steps_short"))  # fmt: skip


def _burn_in(events: list[Event]) -> tuple[dict[str, NodeJudged], Limits | None]:
    verdicts: dict[str, NodeJudged] = {}
    limits = None
    for e in events:
        if e.get("stage") != BURN_IN:
            continue
        if e["event"] == "node_verdict":
            verdicts[str(e.get("node"))] = NodeJudged(
                e.get("figures"), e.get("again"), e.get("suspect"), e.get("verdict"), e.get("reason"),
                e.get("collective"),
            )  # fmt: skip
        elif e["event"] == "thresholds":
            # Old ledgers (before the confirmation round) name the reference figures "medians".
            references = e.get("reference_values") or e.get("medians")
            limits = Limits(e.get("thresholds"), references, e.get("seconds"))
    return verdicts, limits


def _stages(
    events: list[Event],
) -> tuple[dict[str, dict[str, Any]], list[str], dict[str, Any], dict[str, StageError]]:
    stages: dict[str, dict[str, Any]] = {}
    started: dict[str, float] = {}
    results: dict[str, Any] = {}
    errors: dict[str, StageError] = {}
    for e in events:
        if e["event"] not in ("stage_start", "stage_end", "stage_failed"):
            continue
        name: str = e["stage"]  # Ledger.append writes it on every event
        if e["event"] == "stage_start":
            started.setdefault(name, e["ts"])  # a deferred task logs a start per wake-up: keep the first
            continue
        stages.pop(name, None)  # a retry's end replaces the failed try, at its own place
        stages[name] = {
            "seconds": e["seconds"],
            "ok": e["event"] == "stage_end",
            "start": started.pop(name, e["ts"] - e["seconds"]),
            "end": e["ts"],
        }
        if e["event"] == "stage_end":
            results[name] = e.get("result") or {}
            errors.pop(name, None)
        else:
            error, message = str(e.get("error") or ""), str(e.get("message") or "")
            errors[name] = StageError(error or "unknown error", message)
            stages[name]["error"] = f"{error}: {message}".strip(": ")
    return stages, list(started), results, errors


def _checkpoints(events: list[Event]) -> tuple[list[CheckpointRow], str | None]:
    rows: dict[str, CheckpointRow] = {}
    latest: str | None = None

    def row(path: str, step: Any = None) -> CheckpointRow:
        r = rows.setdefault(path, CheckpointRow(path, os.path.basename(path)))
        if step is not None and r.step is None:
            r.step = step
        return r

    for e in events:
        kind, path = e["event"], e.get("path")
        if kind == "lineage_reset":
            latest = path
            if path:
                row(path).fate.append("lineage start")
        elif kind == "rolled_back":
            for r in rows.values():
                if r.saved_at is not None and (r.step or 0) > e["to_step"]:
                    r.fate.append(f"superseded (rollback to step {e['to_step']})")
        elif kind == "published":  # the cold copy of the checked checkpoint, by its step
            for r in rows.values():
                if r.step is not None and r.step == e.get("step") and r.saved_at is not None:
                    r.fate.append(f"published to {e.get('uri')}")
        elif not path or not kind.startswith("checkpoint_"):
            continue
        elif kind == "checkpoint_saved":
            r = row(path, e.get("step"))
            r.attempt, r.saved_at, r.valid, r.problems = e.get("attempt"), e["ts"], None, []
            r.blocked_s = e.get("blocked_s")
        elif kind == "checkpoint_adopted":  # a framework's save, made a checkpoint by the orchestrator
            r = row(path, e.get("step"))
            r.saved_at, r.valid, r.problems = e["ts"], None, []
            r.fate.append(f"adopted from {e.get('source')} ({e.get('framework')})")
        elif kind == "checkpoint_validated":
            r = row(path, e.get("step"))
            r.valid, r.problems = bool(e.get("valid")), list(e.get("problems") or [])
        elif kind == "checkpoint_promoted":
            latest = path
            row(path, e.get("step")).fate.append("promoted")
        elif kind == "checkpoint_quarantined":
            r = row(path)
            r.valid, r.problems = False, list(e.get("problems") or r.problems)
            r.fate.append(f"quarantined to {e.get('to')}")
        elif kind == "checkpoint_retired":
            row(path, e.get("step")).fate.append("retired (keep_hot)")
        elif kind == "checkpoint_tiered":
            row(path).fate.append(f"tiered to {e.get('uri')}")
        elif kind == "checkpoint_checked":
            r = row(path)
            r.fate.append("gate passed" if e.get("valid") else "gate failed: " + "; ".join(e.get("problems") or []))
    for r in rows.values():
        r.latest = r.path == latest
    return sorted(rows.values(), key=lambda r: (r.step is None, r.step or 0, r.path)), latest
