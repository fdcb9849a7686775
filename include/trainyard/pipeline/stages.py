"""The pipeline's stages as plain functions, one per task: ``stage(run, ...) -> result``.

Each returns a typed result (``pipeline.results``), which the Airflow layer passes between tasks as
XComs. Each records its start, end and failure in the run ledger through the one stage recorder
(``pipeline.recorder``), so the report and SLO figures never depend on task logs. The train stage is
``pipeline.train.TrainStage`` (blocking or deferred); ``train`` runs it blocking. Each lives in the
module of its part of the pipeline; this is their one index.
"""

from trainyard.pipeline.burnin import burn_in
from trainyard.pipeline.data import check_dataset, stage_dataset
from trainyard.pipeline.gate import check_checkpoint, publish
from trainyard.pipeline.report import report
from trainyard.pipeline.train import TrainStage, train

__all__ = [
    "TrainStage",
    "burn_in",
    "check_checkpoint",
    "check_dataset",
    "publish",
    "report",
    "stage_dataset",
    "train",
]
