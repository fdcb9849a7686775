"""Retention of run folders: a pipeline's runs whose ledger has been quiet for longer than the retention go.

A run folder holds what trainyard wrote for one DAG run (its ledger, spec snapshot, report, logs,
heartbeats, store secrets): without retention the runs root grows by one folder a night forever.
Each run's report task drops its own pipeline's expired runs. A run is expired when the newest file
of its ledger (``events.jsonl`` or a writer's file in ``events.d/``) is older than the retention: a
run that has been training for weeks writes its ledger every ``progress_every_s`` and is never
expired. Only folders that are run folders (a regular ``events.jsonl`` at their top) are removed,
never a link, never the running one, never anything outside the pipeline's runs folder.
"""

from __future__ import annotations

import logging
import shutil
import stat
from pathlib import Path

from trainyard.events.ledger import EVENTS_DIR, LEDGER_FILE

log = logging.getLogger(__name__)

DAY_S = 86400.0
RETENTION_DAYS = 30.0
"""``[trainyard] runs_retention_days`` when the deployment sets none (the provider's config declares it)."""


def last_activity(run: Path) -> float | None:
    """Epoch seconds of the run's newest ledger file; None when ``run`` is not a run folder."""
    try:
        if not stat.S_ISREG((run / LEDGER_FILE).lstat().st_mode):
            return None
        times = [(run / LEDGER_FILE).lstat().st_mtime]
        shards = run / EVENTS_DIR
        if shards.is_dir() and not shards.is_symlink():
            times += [p.lstat().st_mtime for p in shards.iterdir()]
    except OSError:
        return None
    return max(times)


def expired_runs(pipeline_runs: Path, keep_days: float, now: float, current: Path) -> list[Path]:
    """The run folders of ``pipeline_runs`` quiet for more than ``keep_days`` (0: keep every run)."""
    if keep_days <= 0 or not pipeline_runs.is_dir():
        return []
    expired = []
    for run in sorted(pipeline_runs.iterdir()):
        if run.is_symlink() or not run.is_dir() or run == current:
            continue
        seen = last_activity(run)
        if seen is not None and now - seen > keep_days * DAY_S:
            expired.append(run)
    return expired


def drop_expired_runs(current: Path, keep_days: float, now: float) -> list[str]:
    """Remove the expired runs beside ``current`` (a run's folder); their names. A folder that cannot be
    removed is one warning, never a failure of the run that found it."""
    dropped = []
    for run in expired_runs(current.parent, keep_days, now, current):
        try:
            shutil.rmtree(run)
        except OSError as exc:
            log.warning("retention: could not remove the expired run folder %s: %s", run, exc)
            continue
        dropped.append(run.name)
    if dropped:
        log.info(
            "retention: removed %d run folder(s) quiet for more than %g days: %s",
            len(dropped),
            keep_days,
            ", ".join(dropped),
        )
    return dropped
