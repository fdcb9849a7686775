"""The stages' typed results: what each stage returns, and what the Airflow layer passes on as its XCom.

Each is a frozen dataclass of JSON values (str, int, float, bool, None, lists and str-keyed dicts of
them; never a nested dataclass, whose type Airflow's serde would not keep). Airflow 3 stores a returned
dataclass as its fields with its class name, and rebuilds it in the task that pulls it, provided the
class is allowed there: ``airflow.dag_builder`` allows these (``airflow.sdk.serde.allow_class``) in
every process that parses the DAG file, which is every task process. The ledger's ``stage_end`` keeps
``as_dict()``, so a ledger reads the same as before the results were typed.

This module imports nothing but the standard library: the DAG file imports it at parse time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class StageResult:
    """What every stage result can do: be a dict (the ledger's ``stage_end``). Each stage builds its own
    result type; nothing goes typed -> dict -> typed."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class StagingResult(StageResult):
    """``stage_dataset``: the cold shards copied to the hot tier."""

    hot_dir: str
    files: int
    bytes_total: int
    transferred: int
    """Files copied this time (the rest were staged and unchanged)."""
    bytes_transferred: int
    seconds: float


@dataclass(frozen=True)
class DataCheckResult(StageResult):
    """``check_dataset``: the staged shards met the spec's expectations."""

    shards: int
    non_empty: int
    tokens: int
    vocab_size: int
    expectations: int
    """How many expectations great-expectations evaluated (all passed)."""
    seconds: float
    result: str | None
    """Where the validation result was saved, if anywhere."""
    format: str = "tok"
    """``dataset.format``: what ``shards`` counts (``*.tok`` shards, token arrays, text files)."""
    documents: int = 0
    """Text formats: the documents sampled and checked."""


@dataclass(frozen=True)
class BurnInResult(StageResult):
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
class TrainResult(StageResult):
    """``train``: where training ended, and the checkpoint it left."""

    nodes: list[str]
    start_step: int
    target_step: int
    last_step: int | None
    checkpoint: str | None
    """The lineage's latest checkpoint, None if there is none."""
    attempts: int


@dataclass(frozen=True)
class GateResult(StageResult):
    """``check_checkpoint``: the final checkpoint passed the gate."""

    checkpoint: str
    step: int | None
    metrics: dict[str, Any]


@dataclass(frozen=True)
class PublishResult(StageResult):
    """``publish``: the checkpoint's cold copy (``uri``, never written again) and the pointer to the latest."""

    uri: str
    pointer: str
    step: int
    bytes: int


@dataclass(frozen=True)
class ReportResult(StageResult):
    """``report``: the run's HTML report and summary files. (Not ``Reported``: that is the attempt trigger's news.)"""

    report: str
    summary: str
    steps_trained: int | None
    last_loss: float | None


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
