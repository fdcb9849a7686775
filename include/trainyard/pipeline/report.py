"""The report stage: the run's summary and HTML report; release what the run held."""

from __future__ import annotations

from trainyard.checkpoint import lease
from trainyard.pipeline.recorder import recorded
from trainyard.pipeline.results import ReportResult
from trainyard.pipeline.run import Run
from trainyard.report.summary import write_report
from trainyard.storage.hot import unpin


@recorded("report")
def report(run: Run) -> ReportResult:
    """Write the run's summary and HTML report from its ledger; release the run's hot data and checkpoints."""
    unpin(run.hot_dataset_dir, run.holder)
    lease.release(run.checkpoint_root, run.run_id)
    summary = write_report(run.dir, run.ledger)
    return ReportResult(summary["report"], summary["summary"], summary["steps_trained"], summary["last_loss"])
