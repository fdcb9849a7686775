"""The stages' typed results: what each stage returns, and what the Airflow layer passes on as its XCom.

Each is a frozen dataclass of JSON values (str, int, float, bool, None, lists and str-keyed dicts of
them; never a nested dataclass, whose type Airflow's serde would not keep). Airflow 3 stores a returned
dataclass as its fields with its class name, and rebuilds it in the task that pulls it, provided the
class is allowed there: ``airflow.dag_builder`` allows these (``airflow.sdk.serde.allow_class``) in
every process that parses the DAG file, which is every task process. The ledger's ``stage_end`` keeps
``dataclasses.asdict`` of it, so a ledger reads the same as before the results were typed.

The data stages' results are the records their lower layers return, kept where they are made
(``storage.results.StagingResult``, ``quality.results.DataCheckResult``): one class per record, never a
field-for-field copy here. ``StageResult`` is any one of them (the stage recorder's type).

This module imports nothing but the standard library and those two result modules (standard library
only): the DAG file imports it at parse time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainyard.quality.results import DataCheckResult
from trainyard.storage.results import StagingResult


@dataclass(frozen=True)
class BurnInResult:
    """``burn_in``: the nodes to train on, best first, and what the pressure test found."""

    healthy: list[str]
    spare: list[str] = field(default_factory=list)
    """Passed, not needed this time: they replace lost nodes."""
    evicted: dict[str, str] = field(default_factory=dict)
    """Node -> reason."""
    suspects: dict[str, str] = field(default_factory=dict)
    cleared: list[str] = field(default_factory=list)
    readmitted: list[str] = field(default_factory=list)
    references: dict[str, dict[str, float]] = field(default_factory=dict)
    """Node kind -> probe -> the reference figure."""
    skipped: bool = False
    """No pressure test (``pressure_test.enabled`` false): the nodes are untested."""


@dataclass(frozen=True)
class TrainResult:
    """``train``: where training ended, and the checkpoint it left."""

    nodes: list[str]
    start_step: int
    target_step: int
    last_step: int | None
    checkpoint: str | None
    """The lineage's latest checkpoint, None if there is none."""
    attempts: int


@dataclass(frozen=True)
class GateResult:
    """``check_checkpoint``: the final checkpoint passed the gate."""

    checkpoint: str
    step: int | None
    metrics: dict[str, Any]


@dataclass(frozen=True)
class PublishResult:
    """``publish``: the checkpoint's cold copy (``uri``, never written again) and the pointer to the latest."""

    uri: str
    pointer: str
    step: int
    bytes: int


@dataclass(frozen=True)
class ReportResult:
    """``report``: the run's HTML report and summary files. (Not ``Reported``: that is the attempt trigger's news.)"""

    report: str
    summary: str
    steps_trained: int | None
    last_loss: float | None


StageResult = StagingResult | DataCheckResult | BurnInResult | TrainResult | GateResult | PublishResult | ReportResult
"""What a stage returns: one of the stages' results."""

RESULTS: tuple[type[StageResult], ...] = (
    StagingResult,
    DataCheckResult,
    BurnInResult,
    TrainResult,
    GateResult,
    PublishResult,
    ReportResult,
)
"""Every stage result: the classes the Airflow layer allows through XCom."""

__all__ = ["RESULTS", "BurnInResult", "DataCheckResult", "GateResult", "PublishResult", "ReportResult", "StageResult",
           "StagingResult", "TrainResult"]  # fmt: skip
