"""The pipeline spec: pydantic models of one ``dags/pipelines/*.yaml`` file.

One spec tree, validated once (DESIGN rule 3). ``load_spec`` turns any bad
file into a ``SpecError`` whose lines read ``FILE: field.path: what is wrong
and what is allowed`` -- never a traceback. Structural checks (types, unknown
keys, ranges) come from the models; checks that relate two fields live in
``_cross_field_problems`` so each message can name the exact field.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal, get_args

import yaml
from croniter import croniter
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from trainyard.errors import SpecError
from trainyard.templating import placeholder_problems

FailureKind = Literal["node_lost", "hang", "transient", "oom", "diverged", "user_error", "data_error"]
Action = Literal["retry", "scale_down", "rollback", "fail"]
NotifyOn = Literal["failure", "recovery"]
ParamName = Literal["nodes", "min_nodes", "max_steps", "micro_batch", "lr", "resume_from"]

CRON_PRESETS = ("@hourly", "@daily", "@weekly", "@monthly", "@yearly", "@once")
URI_SCHEMES = ("file", "s3")
_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
# One address, no display name: a local part, '@', a domain with a dot (no spaces, commas or angle
# brackets, which would smuggle a second recipient into the To header).
_EMAIL = re.compile(r"[^@\s,;<>\"]+@[^@\s,;<>\"]+\.[^@\s,;<>\".]+\Z")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")

# DESIGN.md's table of failure kinds and their default actions; ``recovery.actions`` overrides.
DEFAULT_ACTIONS: dict[str, str] = {
    "node_lost": "scale_down",
    "hang": "scale_down",
    "transient": "retry",
    "oom": "retry",
    "diverged": "rollback",
    "user_error": "fail",
    "data_error": "fail",
}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class DataExpectations(_Model):
    min_shards: int = Field(1, ge=1)
    """Fewest shards the staged dataset may have."""
    max_shards: int | None = Field(None, ge=1)
    """Most shards the staged dataset may have; null: no bound."""
    min_tokens_per_shard: int = Field(1, ge=1)
    """Fewest tokens a shard may hold (a shard below it is empty or truncated)."""
    max_tokens_per_shard: int | None = Field(None, ge=1)
    """Most tokens a shard may hold; null: no bound."""
    max_vocab: int | None = Field(None, ge=1)
    """Largest vocabulary a shard header may declare (the model's embedding size); null: no bound."""
    dtypes: list[Literal["uint16", "uint32"]] = ["uint16", "uint32"]
    """Token dtypes a shard may use."""
    unique_shards: bool = True
    """No two shards may have the same content (sha256)."""


class Lifecycle(_Model):
    expire_days: int | None = Field(None, ge=1)
    """Delete objects under the cold prefix this many days after they were written."""
    transition_days: int | None = Field(None, ge=1)
    """Move objects to ``storage_class`` this many days after they were written."""
    storage_class: str | None = None
    """Target storage class of the transition (e.g. GLACIER, or a MinIO tier name)."""


class DatasetSpec(_Model):
    source: str
    """Cold-tier URI of the shard folder (``file:///abs/path`` or ``s3://bucket/prefix``); may use ``{{ ds }}`` and ``${VAR}``."""
    hot: str = "file://${TRAINYARD_HOME}/hot"
    """Hot-tier root near the compute; a ``file://`` URI."""
    name: str
    """Key of the staged copy inside the hot root (relative, no ``..``); may use ``{{ ds }}``."""
    connection: str | None = None
    """Airflow connection id (type aws, ``endpoint_url`` in extra) for an ``s3://`` source."""
    expectations: DataExpectations = DataExpectations()
    """Checks the staged data must pass before any node is spent on it."""
    hot_capacity_gb: float | None = Field(None, gt=0)
    """Size of the hot root, shared by every dataset staged there; least recently used
    unpinned datasets are evicted to make room. Null: unbounded."""
    concurrency: int = Field(4, ge=1, le=64)
    """Objects transferred at once."""
    lifecycle: Lifecycle | None = None
    """Expiration or transition rule set on the ``s3://`` source prefix."""


class KubernetesSpec(_Model):
    connection: str | None = None
    """Airflow connection id of the cluster (type kubernetes); null: in-cluster config or the default kubeconfig."""
    namespace: str = Field("default", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    """Namespace of the training Job, Service and PodGroup."""
    image: str = Field(min_length=1)
    """Trainer image (torch plus trainyard)."""
    service_account: str | None = None
    """Service account of the training pods."""
    scheduler: Literal["default", "volcano"] = "default"
    """``volcano`` adds a PodGroup with minMember = nodes for gang scheduling."""
    cpu: str = "1"
    """CPU request and limit per pod (Kubernetes quantity)."""
    memory: str = "2Gi"
    """Memory request and limit per pod (Kubernetes quantity)."""
    gpus: int = Field(0, ge=0)
    """``nvidia.com/gpu`` per pod."""
    node_selector: dict[str, str] = {}
    """Node labels the pods must match."""
    tolerations: list[dict[str, str]] = []
    """Pod tolerations, as in a pod spec."""
    hot_pvc: str | None = None
    """PersistentVolumeClaim that holds the hot tier, mounted in every pod."""
    evicted_label: str = "trainyard.io/evicted"
    """Label put on nodes the pressure test evicted; training pods avoid it."""
    evict_with: Literal["label", "taint"] = "label"
    """How an evicted node is marked: ``label`` (only trainyard's pods avoid it) or ``taint``
    (the label plus a NoSchedule taint of the same key, so every pod that does not tolerate it avoids it)."""
    hot_mount: str | None = Field(None, pattern=r"^/")
    """Where ``hot_pvc`` is mounted in the pods (where the orchestrator mounts the same volume);
    null: the deepest folder the run's paths share (``$TRAINYARD_HOME``)."""
    store_host: str | None = None
    """Address the burn-in pods use to reach the worker running the pressure test; null: its host's IP."""
    cluster_domain: str = Field("cluster.local", pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    """DNS domain of the cluster; pod 0's name under it is the rendezvous endpoint."""
    deferrable: bool = True
    """Free the worker slot while an attempt runs: the train task defers to a trigger, which watches
    the pods (and the heartbeats, where the triggerer mounts the hot tier) and wakes it on each event.
    false: the task supervises the attempt itself, holding its slot."""
    wake_every_s: float = Field(300.0, ge=5, le=86400)
    """While deferred, the train task also wakes this often to judge new checkpoints (retention, cold
    copies) and check heartbeats itself."""
    poll_s: float = Field(5.0, gt=0, le=600)
    """Seconds between the trigger's looks at the attempt's pods and heartbeats."""


class NodesSpec(_Model):
    count: int = Field(ge=1, le=512)
    """Nodes to train on."""
    min: int = Field(1, ge=1)
    """Fewest nodes a run may scale down to after a failure."""
    max: int | None = Field(None, ge=1)
    """Most nodes a UI trigger may ask for (default: count + spare)."""
    spare: int = Field(0, ge=0)
    """Extra candidates pressure-tested beside ``count``, so weak ones can be left out."""
    procs_per_node: int = Field(1, ge=1, le=16)
    """Training processes (ranks) per node."""
    backend: Literal["local", "kubernetes"] = "local"
    """``local``: one torchrun agent process per node on this machine; ``kubernetes``: pods."""
    kubernetes: KubernetesSpec | None = None
    """Settings of the kubernetes backend (required with it)."""

    @property
    def upper(self) -> int:
        return self.max if self.max is not None else self.count + self.spare


PROBES = ("matmul_gflops", "membw_gbps", "disk_write_mbps", "disk_read_mbps")


class BurnInDrill(_Model):
    node: str
    """Candidate to act out the fault (``node-0``, ``node-1``, ...)."""
    fault: Literal["throttle", "crash", "hang"]
    """``throttle``: slow by ``factor``; ``crash``: exit; ``hang``: stop responding."""
    factor: float = Field(0.3, gt=0, lt=1)
    """Share of throughput a throttled node loses."""


class PressureTestSpec(_Model):
    enabled: bool = True
    """Run the pressure test before training."""
    duration_s: float = Field(20.0, gt=0, le=3600)
    """Time budget of the probes (local probes in turns, then the all-reduce); the stage adds at most ~10 s."""
    timeout_s: float = Field(10.0, gt=0, le=3600)
    """A node that does not start within this (at most 10 s locally) is dead; late reports get at most 5 s of grace."""
    matmul_size: int = Field(256, ge=16, le=16384)
    """Side of the square matrices of the compute probe."""
    membw_mb: int = Field(64, ge=1, le=65536)
    """Buffer copied by the memory-bandwidth probe (MiB)."""
    disk_mb: int = Field(64, ge=1, le=65536)
    """Most data the hot-tier disk probe writes and reads back (MiB)."""
    collective_sizes_kb: list[int] = Field([64, 1024, 8192], min_length=1)
    """All-reduce message sizes of the collective probe (KiB)."""
    min_gflops: float = Field(0.0, ge=0)
    """Absolute floor of the compute probe (GFLOP/s)."""
    min_membw_gbps: float = Field(0.0, ge=0)
    """Absolute floor of memory bandwidth (GB/s)."""
    min_disk_mbps: float = Field(0.0, ge=0)
    """Absolute floor of hot-tier write and read throughput (MB/s)."""
    straggler_ratio: float = Field(0.9, gt=0, le=1)
    """A node below this fraction of the batch median on any probe is a straggler."""
    ratio_overrides: dict[Literal["matmul_gflops", "membw_gbps", "disk_write_mbps", "disk_read_mbps"], float] = {
        "disk_write_mbps": 0.5, "disk_read_mbps": 0.5}
    """Per-probe straggler ratios (shared disks are noisier than cores)."""
    drills: list[BurnInDrill] = []
    """Faults to act out during the test, for rehearsals (also ``TRAINYARD_BURNIN_DRILLS``)."""

    def ratio(self, probe: str) -> float:
        return self.ratio_overrides.get(probe, self.straggler_ratio)  # type: ignore[call-overload]

    def floor(self, probe: str) -> float:
        return {"matmul_gflops": self.min_gflops, "membw_gbps": self.min_membw_gbps}.get(probe, self.min_disk_mbps)


class TrainingSpec(_Model):
    entrypoint: str = "trainyard.train"
    """Python module (``-m``) or ``.py`` script run by torchrun on every rank."""
    args: dict[str, str | int | float | bool] = {}
    """Extra ``--key value`` arguments of the entrypoint (model size, learning rate)."""
    max_steps: int = Field(ge=1)
    """Optimizer steps to train."""
    global_batch: int = Field(ge=1)
    """Sequences per optimizer step, kept constant when the world size changes."""
    micro_batch: int = Field(ge=1)
    """Sequences per forward pass on one rank."""
    checkpoint_every: int = Field(ge=1)
    """Steps between checkpoints (the final step is always saved)."""
    checkpoint_async: bool = True
    """Write checkpoints in the background: training blocks only to copy the state to memory, so
    saving often costs little and a fault loses fewer steps. The manifest still comes last."""
    heartbeat_timeout_s: float = Field(60.0, gt=0)
    """A rank silent for this long is hung."""
    progress_every_s: float = Field(30.0, ge=0, le=86400)
    """Seconds between progress records: a line in the ``train`` task's log (step, loss, speed, ETA, last
    checkpoint) and a ledger ``step`` event with the min/mean/max loss and step time since the last one
    (checkpoint steps, the first and last step and a non-finite loss are always recorded). 0: both at
    every step (every poll for the log), for short runs whose every step matters; a long run stays cheap to view."""
    seed: int = Field(0, ge=0)
    """Seed of weights and data order."""
    resume_from: str = "latest"
    """``latest`` (the newest valid checkpoint, if any), ``none``, or a checkpoint path."""
    allowed_resume_roots: list[str] = []
    """Folders besides the pipeline's own checkpoint roots (hot, and cold if ``file://``) below which
    ``resume_from`` may name a checkpoint: absolute paths (``${VAR}`` allowed). Another pipeline's
    checkpoints are out of reach unless their folder is listed here."""


class MetricExpectations(_Model):
    max_loss: float | None = Field(None, gt=0)
    """A checkpoint whose loss is above this is not valid; null: no bound."""
    max_spike_ratio: float | None = Field(3.0, gt=1)
    """No step's loss may exceed this multiple of the running median before it; null: no check."""
    spike_window: int = Field(20, ge=2)
    """Recorded losses in the running median of the spike check: one per step when
    ``training.progress_every_s`` is 0, else the end and the peak of each progress record."""


class CheckpointSpec(_Model):
    hot: str = "file://${TRAINYARD_HOME}/checkpoints"
    """Root of checkpoints near the compute (``file://``); the pipeline's folder lives under it."""
    cold: str = "file://${TRAINYARD_HOME}/cold/checkpoints"
    """Where valid checkpoints are published (``file://`` or ``s3://``)."""
    connection: str | None = None
    """Airflow connection id for an ``s3://`` cold tier."""
    keep_hot: int = Field(3, ge=1)
    """Latest valid checkpoints kept in the hot tier (the latest valid one is never deleted)."""
    cold_every_steps: int | None = Field(None, ge=1)
    """Copy to the cold tier each valid checkpoint whose step is a multiple of this during training;
    null: only the published one."""
    expectations: MetricExpectations = MetricExpectations()
    """Metric bounds a checkpoint must meet."""
    lifecycle: Lifecycle | None = None
    """Expiration or transition rule set on the ``s3://`` cold prefix of published checkpoints."""


class RecoverySpec(_Model):
    max_attempts: int = Field(3, ge=1, le=100)
    """Training attempts per run, the first included."""
    backoff_s: float = Field(5.0, ge=0, le=3600)
    """Pause before a retry."""
    actions: dict[FailureKind, Action] = {}
    """Per-failure-kind action overriding the defaults (see DESIGN.md)."""

    def action_for(self, kind: str) -> str:
        return self.actions.get(kind, DEFAULT_ACTIONS[kind])  # type: ignore[call-overload]


class Drill(_Model):
    fault: Literal["kill", "hang", "slow", "corrupt_checkpoint", "nan", "oom", "exception"]
    """``kill``: SIGKILL a node; ``hang``: SIGSTOP it; ``slow``: make it a straggler; ``corrupt_checkpoint``:
    flip a byte of the next checkpoint; ``nan``: NaN loss; ``oom``: out-of-memory error; ``exception``: a bug."""
    step: int = Field(ge=1)
    """Step at which the fault strikes (for ``corrupt_checkpoint``: the first checkpoint at or after it)."""
    node: str | None = None
    """Node that acts it out (``node-1``); null: every node (``nan``, ``corrupt_checkpoint``) or node-0."""
    factor: float = Field(1.0, gt=0)
    """``slow`` only: extra time per step, as a multiple of the step time."""
    attempt: int = Field(1, ge=1)
    """The training attempt it strikes in (later attempts run clean, so recovery can succeed)."""


def _email(value: str) -> str:
    if not _EMAIL.match(value):
        raise ValueError(f"{value!r} is not an email address; write one address as name@domain.tld")
    return value


Email = Annotated[str, AfterValidator(_email)]


class NotifySpec(_Model):
    email: list[Email] = Field(min_length=1)
    """Addresses to write to (at least one)."""
    on: list[NotifyOn] = Field(["failure", "recovery"], min_length=1)
    """When to write: ``failure`` (a run failed: which stage, the error class, what recovery did) and
    ``recovery`` (a run succeeded, but recovery acted in ``train``: what failed, what was done, the steps lost)."""
    connection: str = Field("smtp_default", min_length=1)
    """Airflow connection id (type smtp) of the mail server; its credentials stay in the connection."""
    from_email: Email | None = None
    """Sender address; null: the connection's ``from_email`` extra."""

    @model_validator(mode="before")
    @classmethod
    def _on_key(cls, data: Any) -> Any:
        # YAML 1.1 reads a bare ``on:`` key as the boolean true (as in GitHub Actions files); the
        # field is called ``on`` nonetheless, because that is what people write.
        if isinstance(data, dict) and True in data and "on" not in data:
            return {("on" if key is True else key): value for key, value in data.items()}
        return data


class PipelineSpec(_Model):
    pipeline: str | None = Field(None, pattern=_NAME, max_length=200)
    """DAG id (default: the file name without ``.yaml``)."""
    description: str = ""
    """Shown in the Airflow UI."""
    owner: str = "trainyard"
    """Airflow owner of the tasks."""
    tags: list[str] = []
    """Airflow DAG tags."""
    schedule: str | None = None
    """Cron expression or preset (``@daily``); null: triggered by hand only."""
    start_date: dt.date = dt.date(2026, 1, 1)
    """First logical date of a scheduled pipeline."""
    catchup: bool = False
    """Run the missed intervals since ``start_date``."""
    max_active_runs: int = Field(1, ge=1)
    """Airflow's limit on concurrent scheduled and manual runs (a backfill has its own,
    ``--max-active-runs``). Training is one run at a time whatever it says: runs share the
    checkpoint lineage, and a second one fails fast with ``LineageBusy``."""
    runs_root: str = "file://${TRAINYARD_HOME}/runs"
    """Where each run keeps its ledger and report (``file://``)."""
    dataset: DatasetSpec
    """What to train on."""
    nodes: NodesSpec
    """Where to train."""
    pressure_test: PressureTestSpec = PressureTestSpec()
    """How nodes are tested before training."""
    training: TrainingSpec
    """What to run and how long."""
    checkpoint: CheckpointSpec = CheckpointSpec()
    """Where checkpoints go and what makes one valid."""
    recovery: RecoverySpec = RecoverySpec()
    """What to do when training fails."""
    params: list[ParamName] = ["nodes", "min_nodes", "max_steps", "micro_batch", "resume_from"]
    """Which settings a UI trigger may override (``lr`` also needs a positive ``training.args.lr``)."""
    drills: list[Drill] = []
    """Faults to act out during training, for rehearsals (see ``trainyard drill``)."""
    notify: NotifySpec | None = None
    """Whom to email, through Airflow's SMTP notifier, when a run fails or recovers; null: nobody."""

    def dag_id(self, source: Path) -> str:
        return self.pipeline or source.stem


# ---------------------------------------------------------------- loading


class _StrictLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses duplicate keys (the last one would win silently)."""


def _no_duplicates(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}; each key may appear once", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)


def parse_yaml(text: str) -> Any:
    """Parse spec text; ``ValueError`` carries ``line L, column C: problem``."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 -- a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ValueError(f"{where}invalid YAML: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"invalid YAML: {exc}") from None


def load_spec(path: str | Path) -> PipelineSpec:
    """Read and validate one spec file; ``SpecError`` lists every problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError([f"{path}: cannot read the file: {exc}"]) from None
    return spec_from_text(text, path)


def spec_from_text(text: str, path: Path) -> PipelineSpec:
    try:
        data = parse_yaml(text)
    except ValueError as exc:
        raise SpecError([f"{path}: {exc}"]) from None
    if data is None:
        raise SpecError([f"{path}: the file is empty; a spec needs at least dataset, nodes and training"])
    if not isinstance(data, dict):
        raise SpecError([f"{path}: the top level must be a mapping of fields, not a {_type_name(data)}"])
    return spec_from_data(data, path)


def spec_from_data(data: Mapping[str, Any], path: Path) -> PipelineSpec:
    try:
        spec = PipelineSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError([f"{path}: {line}" for line in _describe(exc)]) from None
    problems = _cross_field_problems(spec)
    if problems:
        raise SpecError([f"{path}: {line}" for line in problems])
    return spec


def check_files(paths: Iterable[str | Path]) -> list[str]:
    """Every problem in every file, one line each; empty when all are valid."""
    problems: list[str] = []
    for path in paths:
        try:
            load_spec(path)
        except SpecError as exc:
            problems.extend(exc.problems)
    return problems


# ---------------------------------------------------------------- messages


def _describe(exc: ValidationError) -> list[str]:
    return [f"{_dotted(err['loc'])}: {_message(err)}" for err in exc.errors()]


def _dotted(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if part == "[key]":
            continue  # pydantic's marker for "the key of this mapping"; the key is already named
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _message(err: Mapping[str, Any]) -> str:
    kind, value = err["type"], err.get("input")
    if kind == "missing":
        return "required field is missing"
    if kind == "extra_forbidden":
        allowed = _allowed_fields(err["loc"][:-1])
        return f"unknown field; allowed here: {', '.join(allowed)}"
    got = f" (got {_show(value)})"
    msg = err["msg"]
    if kind == "literal_error":
        return f"{_show(value)} is not allowed; expected {msg.removeprefix('Input should be ')}"
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        return f"{_show(value)} is out of range; it should be {msg.removeprefix('Input should be ')}"
    if kind == "value_error":  # our own validators: the message already says what to write
        return msg.removeprefix("Value error, ")
    if kind == "string_pattern_mismatch":
        return f"{_show(value)} has characters that are not allowed; use letters, digits, '_', '.' and '-'"
    return msg[0].lower() + msg[1:] + got


def _allowed_fields(loc: tuple[Any, ...]) -> list[str]:
    model: Any = PipelineSpec
    for part in loc:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = next((a for a in (field.annotation, *get_args(field.annotation)) if hasattr(a, "model_fields")), None)
    return sorted(getattr(model, "model_fields", {}))


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _type_name(value: Any) -> str:
    return {list: "list", str: "string", int: "number", float: "number", bool: "boolean"}.get(type(value), type(value).__name__)


# ---------------------------------------------------------------- cross-field checks


def _cross_field_problems(spec: PipelineSpec) -> list[str]:
    nodes, training = spec.nodes, spec.training
    problems: list[str] = []
    if nodes.min > nodes.count:
        problems.append(f"nodes.min: {nodes.min} must be <= nodes.count ({nodes.count})")
    if nodes.max is not None and nodes.max < nodes.count:
        problems.append(f"nodes.max: {nodes.max} must be >= nodes.count ({nodes.count})")
    if nodes.backend == "kubernetes" and nodes.kubernetes is None:
        problems.append("nodes.kubernetes: required when nodes.backend is kubernetes (at least its image)")
    if nodes.backend == "local" and nodes.kubernetes is not None:
        problems.append("nodes.kubernetes: only allowed with nodes.backend: kubernetes")
    expect = spec.dataset.expectations
    if expect.max_shards is not None and expect.max_shards < expect.min_shards:
        problems.append(f"dataset.expectations.max_shards: {expect.max_shards} must be >= min_shards ({expect.min_shards})")
    if expect.max_tokens_per_shard is not None and expect.max_tokens_per_shard < expect.min_tokens_per_shard:
        problems.append(
            f"dataset.expectations.max_tokens_per_shard: {expect.max_tokens_per_shard} must be >= min_tokens_per_shard"
            f" ({expect.min_tokens_per_shard})"
        )
    ranks = training.micro_batch * nodes.count * nodes.procs_per_node
    if training.global_batch % ranks:
        problems.append(
            f"training.global_batch: {training.global_batch} must be divisible by training.micro_batch x nodes.count"
            f" x nodes.procs_per_node ({training.micro_batch} x {nodes.count} x {nodes.procs_per_node} = {ranks})"
        )
    if training.entrypoint.endswith(".py") is False and not _MODULE.match(training.entrypoint):
        problems.append(
            f"training.entrypoint: {training.entrypoint!r} is neither a dotted module name nor a .py script"
        )
    if not _valid_resume(training.resume_from):
        problems.append(
            f"training.resume_from: {training.resume_from!r} must be 'latest', 'none' or an absolute checkpoint path"
        )
    problems += _schedule_problems(spec.schedule)
    problems += _uri_problems(spec)
    problems += _key_problems("dataset.name", spec.dataset.name)
    if spec.dataset.source.startswith("s3://") and not spec.dataset.connection:
        problems.append("dataset.connection: required for an s3:// source (an Airflow connection id of type aws)")
    if spec.checkpoint.cold.startswith("s3://") and not spec.checkpoint.connection:
        problems.append("checkpoint.connection: required for an s3:// cold tier (an Airflow connection id of type aws)")
    for field, uri, rule in (("dataset", spec.dataset.source, spec.dataset.lifecycle),
                             ("checkpoint", spec.checkpoint.cold, spec.checkpoint.lifecycle)):
        if rule is not None:
            problems += [f"{field}.lifecycle: {p}" for p in _lifecycle_problems(uri, rule)]
    if spec.notify is not None:
        problems += _repeated("notify.email", spec.notify.email) + _repeated("notify.on", spec.notify.on)
    for i, name in enumerate(spec.params):
        if name in spec.params[:i]:
            problems.append(f"params[{i}]: {name!r} is listed twice")
        if name == "lr" and not _positive_number(training.args.get("lr")):
            problems.append(f"params[{i}]: 'lr' overrides training.args.lr, which is not set to a positive number;"
                            " set it (the entrypoint's --lr) or drop 'lr' from params")
    return problems


def _repeated(field: str, items: list[str]) -> list[str]:
    return [f"{field}[{i}]: {item!r} is listed twice" for i, item in enumerate(items) if item in items[:i]]


def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _lifecycle_problems(uri: str, rule: Lifecycle) -> list[str]:
    problems = []
    if not uri.startswith("s3://"):
        problems.append(f"lifecycle rules need an s3:// tier, not {uri!r}")
    if rule.expire_days is None and rule.transition_days is None:
        problems.append("set expire_days, transition_days or both")
    if (rule.transition_days is None) != (rule.storage_class is None):
        problems.append("transition_days and storage_class go together")
    return problems


def _valid_resume(value: str) -> bool:
    return value in ("latest", "none") or (value.startswith("/") and ".." not in PurePosixPath(value).parts)


def _schedule_problems(schedule: str | None) -> list[str]:
    if schedule is None or schedule in CRON_PRESETS:
        return []
    if schedule.startswith("@") or not croniter.is_valid(schedule):
        return [
            f"schedule: {schedule!r} is not a cron expression ('minute hour day month weekday', e.g. '0 2 * * *')"
            f" or one of {', '.join(CRON_PRESETS)}"
        ]
    return []


def _uri_problems(spec: PipelineSpec) -> list[str]:
    fields = {
        "runs_root": (spec.runs_root, ("file",)),
        "dataset.source": (spec.dataset.source, URI_SCHEMES),
        "dataset.hot": (spec.dataset.hot, ("file",)),
        "checkpoint.hot": (spec.checkpoint.hot, ("file",)),
        "checkpoint.cold": (spec.checkpoint.cold, URI_SCHEMES),
    }
    problems = []
    for field, (uri, schemes) in fields.items():
        problems += [f"{field}: {p}" for p in uri_problems(uri, schemes)]
    # Only the dataset source is per run; the other roots must not move between runs.
    for field, (uri, _) in fields.items():
        if field != "dataset.source" and "{{" in uri:
            problems.append(f"{field}: run templates are only allowed in dataset.source and dataset.name")
    return problems


def uri_problems(uri: str, schemes: tuple[str, ...]) -> list[str]:
    """Problems with a tier URI; ``file://`` paths must be absolute and stay inside their root."""
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme not in schemes:
        return [f"{uri!r} must start with {' or '.join(s + '://' for s in schemes)}"]
    problems = placeholder_problems(uri)
    if scheme == "file" and not (rest.startswith("/") or rest.startswith("${")):
        problems.append(f"{uri!r} must be an absolute path (file:///abs/path or file://${{TRAINYARD_HOME}}/...)")
    if scheme == "s3" and not re.match(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/|\Z)", rest):
        problems.append(f"{uri!r} must name a valid bucket (s3://bucket/prefix)")
    if ".." in PurePosixPath(rest).parts or "\\" in rest or "\x00" in rest:
        problems.append(f"{uri!r} may not contain '..', backslashes or NUL")
    return problems


def _key_problems(field: str, key: str) -> list[str]:
    problems = [f"{field}: {p}" for p in placeholder_problems(key)]
    parts = PurePosixPath(key).parts
    if not key or key.startswith("/") or ".." in parts or "\\" in key or "\x00" in key:
        problems.append(f"{field}: {key!r} escapes the hot root; use a relative key without '..' (e.g. tokens/{{{{ ds }}}})")
    return problems


# ---------------------------------------------------------------- UI params

# Each UI Param overrides one spec field (a path into the spec tree); the
# override is validated by the same models, so a trigger can never run a spec
# that ``trainyard check`` would refuse.
PARAM_FIELDS: dict[str, tuple[str, ...]] = {
    "nodes": ("nodes", "count"),
    "min_nodes": ("nodes", "min"),
    "max_steps": ("training", "max_steps"),
    "micro_batch": ("training", "micro_batch"),
    "lr": ("training", "args", "lr"),
    "resume_from": ("training", "resume_from"),
}

# Trigger-form sections (Airflow 3 groups Params by their schema's ``section``).
SECTION_NODES = "Nodes"
SECTION_TRAINING = "Training"
SECTION_CHECKPOINT = "Checkpoint"
# Bounds that catch typos (60 for 0.006, 3 for 0.003) rather than model choices; a spec's own larger
# value raises them (a default its own schema refused would make the DAG fail to import).
MAX_STEPS_BOUND = 10_000_000
MAX_LR = 1.0
# The same rule as ``_valid_resume``, as a JSON-schema pattern: 'latest', 'none', or an absolute path without '..'.
RESUME_PATTERN = r"^(latest|none|/(?!(.*/)?\.\.(/|$)).*)$"


def param_schemas(spec: PipelineSpec) -> dict[str, dict[str, Any]]:
    """JSON schema (with default, title, description, section) of each exposed UI Param.

    ``description`` is Param's own argument; every other key is the Param's
    schema, which Airflow validates a trigger against before any run exists.
    Closed value sets are enums (a drop-down in the form); the rule that ties
    Params together (global batch divisible by micro-batch x nodes x ranks) is
    checked when the run opens, by ``with_params``, and fails the first task.
    """
    nodes, training = spec.nodes, spec.training
    upper, batch, ranks = nodes.upper, training.global_batch, nodes.procs_per_node
    # When the other knob is a Param too, any value it could take keeps a choice open (its smallest: 1).
    least_micro = 1 if "micro_batch" in spec.params else training.micro_batch
    least_nodes = 1 if "nodes" in spec.params else nodes.count
    lr = training.args.get("lr") if _positive_number(training.args.get("lr")) else MAX_LR  # exposed only when it is one
    batch_rule = f"micro-batch x nodes x {ranks} rank(s) per node must divide the global batch ({batch})"
    schemas: dict[str, dict[str, Any]] = {
        "nodes": {
            "type": "integer", "minimum": 1, "maximum": upper, "default": nodes.count,
            "enum": [c for c in range(1, upper + 1) if batch % (least_micro * c * ranks) == 0],
            "title": "Nodes", "section": SECTION_NODES,
            "description": f"Nodes to train on, 1 to {upper}; the spec says {nodes.count}. Offered: the counts"
                           f" that keep the rule {batch_rule}.",
        },
        "min_nodes": {
            "type": "integer", "minimum": 1, "maximum": upper, "default": nodes.min,
            "title": "Minimum nodes", "section": SECTION_NODES,
            "description": f"Fewest nodes a failure may scale the run down to; at most Nodes."
                           f" The spec says {nodes.min}.",
        },
        "max_steps": {
            "type": "integer", "minimum": 1, "maximum": max(MAX_STEPS_BOUND, training.max_steps),
            "default": training.max_steps,
            "title": "Steps to train", "section": SECTION_TRAINING,
            "description": f"Optimizer steps this run trains, counted from the checkpoint it resumes from;"
                           f" the spec says {training.max_steps}.",
        },
        "micro_batch": {
            "type": "integer", "minimum": 1, "maximum": batch, "default": training.micro_batch,
            "enum": [m for m in _divisors(batch) if batch % (m * least_nodes * ranks) == 0],
            "title": "Micro-batch", "section": SECTION_TRAINING,
            "description": f"Sequences per forward pass on one rank; the spec says {training.micro_batch}."
                           f" Lower it to fit memory: the global batch stays, the rest is gradient accumulation."
                           f" Rule: {batch_rule}.",
        },
        "lr": {
            "type": "number", "exclusiveMinimum": 0, "maximum": max(MAX_LR, lr), "default": lr,
            "title": "Learning rate", "section": SECTION_TRAINING,
            "description": f"Passed to the entrypoint as --lr (training.args.lr); the spec says {lr}.",
        },
        "resume_from": {
            "type": "string", "pattern": RESUME_PATTERN, "default": training.resume_from,
            # examples, not enum: the form offers the two keywords and still accepts a typed absolute path.
            "examples": list(dict.fromkeys(["latest", "none", training.resume_from])),
            "values_display": {"latest": "latest: the newest valid checkpoint", "none": "none: a fresh start"},
            "title": "Resume from", "section": SECTION_CHECKPOINT,
            "description": "'latest' valid checkpoint of this pipeline, 'none' for a fresh start, or the absolute"
                           " path of a checkpoint folder (step_NNNNNN).",
        },
    }
    return {name: schemas[name] for name in spec.params}


def _divisors(n: int) -> list[int]:
    """Divisors of ``n`` in ascending order, in O(sqrt n): DAG parsing must stay fast."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def with_params(spec: PipelineSpec, params: Mapping[str, Any], source: Path) -> PipelineSpec:
    """The spec with a trigger's Params applied; ``SpecError`` names the Param's field."""
    data = spec.model_dump(mode="json", exclude_unset=True)
    for name, value in params.items():
        if name not in PARAM_FIELDS or name not in spec.params:
            continue  # Airflow's own params (and ones this spec does not expose) pass by
        *parents, field = PARAM_FIELDS[name]
        node = data
        for key in parents:
            node = node.setdefault(key, {})
        node[field] = value
    return spec_from_data(data, source)
