"""The pipeline's stages as plain functions, one per task: ``stage(run, ...) -> dict``.

The Airflow layer calls these and passes the returned dicts between tasks as XComs. Each stage records
its start, end and failure in the run ledger (``pipeline.recorder``), so the report and SLO figures never
depend on task logs. Each lives in the module of its part of the pipeline; this is their one index.
"""

from trainyard.pipeline.burnin import burn_in
from trainyard.pipeline.data import check_dataset, stage_dataset
from trainyard.pipeline.gate import check_checkpoint, publish
from trainyard.pipeline.report import report
from trainyard.pipeline.train import continue_training, start_training, train

__all__ = [
    "burn_in",
    "check_checkpoint",
    "check_dataset",
    "continue_training",
    "publish",
    "report",
    "stage_dataset",
    "start_training",
    "train",
]
