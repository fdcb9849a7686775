"""A training pipeline written by hand with trainyard's operators: an evaluation between the gate and publishing.

The DAGs trainyard builds from ``dags/pipelines/*.yaml`` are fixed: stage, check, pressure test, train, gate,
publish, report. This one is written as any Airflow DAG, with the same operators, and adds a task of its
own: ``evaluate`` decides whether the checkpoint that passed the gate is good enough to publish. Replace
its body with your evaluation (load the checkpoint, score it on held-out data); whatever it returns that
``PublishOperator`` needs is the gate's result, passed on.

Copy this file and ``custom_pipeline.yaml`` into your DAG folder (trainyard installed as a package).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from airflow.sdk import DAG, Param, task
from airflow.sdk.exceptions import AirflowFailException

from trainyard.airflow.notify import dag_callbacks
from trainyard.airflow.operators import (
    CheckDatasetOperator,
    CheckpointGateOperator,
    PinSpecOperator,
    PressureTestOperator,
    PublishOperator,
    ReportOperator,
    StageDatasetOperator,
    TrainOperator,
)
from trainyard.pipeline.results import GateResult
from trainyard.spec.load import load_spec

SPEC = Path(__file__).with_name("custom_pipeline.yaml")  # or a PipelineSpec built in Python

with DAG(
    dag_id="custom_pipeline",
    schedule=None,
    start_date=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    catchup=False,
    params={"max_loss": Param(6.0, type="number", description="the final loss a checkpoint must be under")},
    tags=["trainyard", "example"],
    # The spec's notify section (email, Slack, webhook), as the built DAGs send it: from the spec file.
    **dag_callbacks(str(SPEC), load_spec(SPEC)),
):
    pinned = PinSpecOperator(task_id="pin_spec", spec=SPEC)
    stage = StageDatasetOperator(task_id="stage_dataset", spec=SPEC, run_file=pinned.output)
    check = CheckDatasetOperator(task_id="check_dataset", spec=SPEC, run_file=pinned.output)
    burn = PressureTestOperator(task_id="pressure_test", spec=SPEC, run_file=pinned.output)
    trained = TrainOperator(task_id="train", spec=SPEC, run_file=pinned.output, nodes=burn.output)
    gate = CheckpointGateOperator(task_id="check_checkpoint", spec=SPEC, run_file=pinned.output, trained=trained.output)

    @task
    def evaluate(gate: GateResult, params: dict | None = None) -> GateResult:
        """Your evaluation goes here. This one holds the checkpoint's recorded loss to the run's max_loss."""
        loss = gate.metrics.get("loss")
        limit = float((params or {})["max_loss"])
        if loss is None or loss > limit:
            raise AirflowFailException(f"step {gate.step}: loss {loss} is not under {limit}; not published")
        print(f"step {gate.step}: loss {loss:.4f} < {limit}: publishing {gate.checkpoint}")
        return gate

    evaluated = evaluate(gate.output)
    published = PublishOperator(task_id="publish", spec=SPEC, run_file=pinned.output, gate=evaluated)
    report = ReportOperator(task_id="report", spec=SPEC, run_file=pinned.output)
    stage >> check >> burn
    published >> report
    pinned.as_setup() >> report.as_teardown()  # the report is written whatever the stages did
