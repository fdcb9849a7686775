"""The report stage: the run's summary and HTML report; release what the run held."""

from __future__ import annotations

import logging

from trainyard.checkpoint import lease
from trainyard.events.fold import fold
from trainyard.pipeline.recorder import recorded
from trainyard.pipeline.results import ReportResult
from trainyard.pipeline.run import Run
from trainyard.report.summary import format_summary, write_report
from trainyard.storage.hot import unpin

log = logging.getLogger(__name__)


@recorded("report")
def report(run: Run, airflow_base: str = "/") -> ReportResult:
    """Write the run's summary and HTML report from its ledger; release the run's hot data and checkpoints.
    ``airflow_base``: Airflow's UI root, for the report's links to the DAG run and its task logs."""
    unpin(run.hot_dataset_dir, run.holder)
    lease.release(run.checkpoint_root, run.run_id)
    # One fold of the ledger for the files and the task log alike: what the log says is what the report says.
    summary = write_report(run.dir, fold(run.ledger.events()), airflow_base)
    log.info("%s", format_summary(summary))
    return ReportResult(summary["report"], summary["summary"], summary["steps_trained"], summary["last_loss"])
