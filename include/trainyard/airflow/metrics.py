"""Stage durations and recovery figures, sent through Airflow's metrics client.

The figures come from the run ledger's one fold (docs/architecture.md, the event model), never from timing the
task again, so the dashboards and the report agree. Airflow 3.3 keeps the
client in the task SDK (``airflow.sdk.observability.stats``; ``airflow.stats``
is a deprecated shim); the task process initializes it from ``[metrics]``, so
StatsD, Datadog or OpenTelemetry is the deployment's choice, and with none
configured every call is a no-op.

Names carry the DAG and the stage, because plain StatsD drops tags; the same
values also go as tags for the backends that keep them (Datadog,
OpenTelemetry, InfluxDB-style StatsD). Emitting never fails a task: a broken
client or an odd ledger is logged and the task carries on.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

from airflow.sdk.observability import stats

from trainyard.events.fold import fold
from trainyard.events.ledger import Ledger
from trainyard.pipeline.run import Run
from trainyard.recovery.figures import figures_from

log = logging.getLogger(__name__)

PREFIX = "trainyard"
TRAIN = "train"
# Airflow refuses names over 250 characters (StatsD) and prefix + name over 255 (OpenTelemetry,
# prefix "airflow" by default); 230 leaves room for a longer prefix.
MAX_NAME = 230
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")

# recovery_figures key -> (metric, kind). Timers are sent in milliseconds, as StatsD expects; gauges,
# not counters, for the rest: they are the run's totals, and a retried task sends them again.
RECOVERY: dict[str, tuple[str, Literal["timing", "gauge"]]] = {
    "detection_s": ("detection", "timing"),
    "resume_delay_s": ("resume_delay", "timing"),
    "restart_total_s": ("restart", "timing"),
    "restore_total_s": ("restore", "timing"),
    "replay_total_s": ("replay", "timing"),
    "productive_s": ("productive", "timing"),
    "lost_steps": ("lost_steps", "gauge"),
    "ettr": ("ettr", "gauge"),
}


@dataclass(frozen=True)
class Metric:
    kind: Literal["timing", "gauge", "incr"]
    name: str
    value: float
    tags: dict[str, str] = field(default_factory=dict)


def segment(text: str) -> str:
    """One dot-free name segment: StatsD reads '.' as hierarchy (as Airflow does, '.' becomes '__')."""
    return _UNSAFE.sub("_", text.replace(".", "__")) or "_"


def metric_name(*parts: str) -> str:
    """``trainyard.<parts>``, valid for Airflow's name checks; an over-long part (a DAG id) is cut and
    given a hash of itself, so two long ids never share a name."""
    name = ".".join([PREFIX, *parts])
    if len(name) <= MAX_NAME:
        return name
    longest = max(range(len(parts)), key=lambda i: len(parts[i]))
    digest = hashlib.sha1(parts[longest].encode()).hexdigest()[:8]
    keep = len(parts[longest]) - (len(name) - MAX_NAME) - len(digest) - 1
    return metric_name(*parts[:longest], f"{parts[longest][: max(keep, 1)]}-{digest}", *parts[longest + 1 :])


# ---------------------------------------------------------------- what to send (pure: ledger in, metrics out)


def stage_metrics(ledger: Ledger, stage: str, dag_id: str, since: float | None = None) -> list[Metric]:
    """Duration (ms) and outcome counter of the stage's last end or failure at or after ``since``."""
    end = fold(ledger.events(stage)).stages.get(stage)  # its last end or failure
    if end is None or end.get("seconds") is None or (since is not None and end["end"] < since):
        return []
    dag, tags = segment(dag_id), {"dag_id": dag_id, "stage": stage}
    outcome = "succeeded" if end["ok"] else "failed"
    return [
        Metric("timing", metric_name("stage", "duration", dag, segment(stage)), float(end["seconds"]) * 1000, tags),
        Metric("incr", metric_name("stage", outcome, dag, segment(stage)), 1, tags),
    ]


def recovery_metrics(ledger: Ledger, dag_id: str) -> list[Metric]:
    """The train stage's recovery figures: its ``recovery_figures`` event, or for a run that failed
    before writing one, the same figures computed from the ledger. A figure with no value (no
    failure, so no detection time) is not sent: a zero would read as an instant recovery."""
    state = fold(ledger.events(TRAIN))
    train = state.train
    figures = train.figures or figures_from(state)
    dag, tags = segment(dag_id), {"dag_id": dag_id}
    out = [
        Metric(kind, metric_name("recovery", name, dag), figures[key] * (1000 if kind == "timing" else 1), tags)
        for key, (name, kind) in RECOVERY.items()
        if figures.get(key) is not None
    ]
    attempts = len(train.attempts)
    failures = sum(len(a.failures) for a in train.attempts)
    out.append(Metric("gauge", metric_name("recovery", "attempts", dag), attempts, tags))
    out.append(Metric("gauge", metric_name("recovery", "failures", dag), failures, tags))
    return out


# ---------------------------------------------------------------- sending


def send(metrics: list[Metric]) -> None:
    for m in metrics:
        if m.kind == "timing":
            stats.timing(m.name, m.value, tags=m.tags)
        elif m.kind == "gauge":
            stats.gauge(m.name, m.value, tags=m.tags)
        else:
            stats.incr(m.name, int(m.value), tags=m.tags)


def emit_stage(ledger: Ledger, stage: str, dag_id: str, since: float | None = None) -> list[Metric]:
    """Send the stage's duration and outcome; what was sent (empty on any problem, which is logged)."""
    return _safely(lambda: stage_metrics(ledger, stage, dag_id, since), f"stage {stage}")


def emit_recovery(ledger: Ledger, dag_id: str) -> list[Metric]:
    """Send the train stage's recovery figures; what was sent (empty on any problem, which is logged)."""
    return _safely(lambda: recovery_metrics(ledger, dag_id), "recovery")


def _safely(build: Callable[[], list[Metric]], what: str) -> list[Metric]:
    try:
        metrics = build()
        send(metrics)
        return metrics
    except Exception:
        log.warning("trainyard metrics for %s not sent", what, exc_info=True)
        return []


@contextmanager
def emitted(run: Run, stage: str) -> Iterator[Run]:
    """Around one task's work on ``stage``: when it ends, however it ends, send the figures it recorded.

    Only events written during the block count, so a retried task or a
    deferred one woken up again never sends an earlier try's figures twice;
    a block that ends without finishing the stage (a deferral) sends nothing.
    """
    since = time.time()
    try:
        yield run
    finally:
        if emit_stage(run.ledger, stage, run.dag_id, since) and stage == TRAIN:
            emit_recovery(run.ledger, run.dag_id)
