"""The pipeline spec's models: one pydantic tree per ``dags/pipelines/*.yaml`` file.

One spec tree, validated once (docs/architecture.md, the spec). This module owns the fields,
their documentation, their ranges and the per-field rules (a pattern field's
error names its own rule); the vocabularies (probes, Params) are ``Literal`` types defined here once and read elsewhere with
``typing.get_args``; failure kinds and actions are declared with their traits in ``trainyard.kinds``
and re-exported here. Checks that relate two fields live in ``checks``.
"""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainValidator, model_validator

from trainyard.kinds import DEFAULT_ACTIONS as DEFAULT_ACTIONS
from trainyard.kinds import Action as Action
from trainyard.kinds import FailureKind as FailureKind
from trainyard.preload import Framework
from trainyard.spec.admin import (
    NOTIFY_CONNECTIONS,
    POD_SERVICE_ACCOUNTS,
    notify_connections,
    pod_service_accounts,
    setting_env,
)
from trainyard.spec.args import (
    ArgItem,
    ArgMap,
    ArgsForm,
    ArgValue,
    Booleans,
    named,
    valid_args,
)

# ---------------------------------------------------------------- vocabularies

Probe = Literal["matmul_gflops", "membw_gbps", "disk_write_mbps", "disk_read_mbps", "bf16_tflops", "link_gbps"]
NotifyOn = Literal["failure", "recovery"]
DataFormat = Literal["tok", "numpy", "parquet", "jsonl"]
"""How a dataset's files are written: trainyard's ``*.tok`` shards, numpy token arrays (``.bin``/``.npy``),
or text in Parquet or JSON Lines."""
TokenDtype = Literal["uint16", "uint32"]
TEXT_FORMATS: tuple[DataFormat, ...] = ("parquet", "jsonl")
FORMAT_SUFFIXES: dict[DataFormat, tuple[str, ...]] = {
    "tok": (".tok",),
    "numpy": (".bin", ".npy"),
    "parquet": (".parquet",),
    "jsonl": (".jsonl",),
}
"""The files of each format, the ones its gate checks. Staging copies only these, except for ``tok``,
which stages the whole prefix as it always has (a tokenizer file beside the shards comes along)."""
ParamName = Literal["nodes", "min_nodes", "max_steps", "micro_batch", "lr", "resume_from"]

PROBES: tuple[Probe, ...] = get_args(Probe)
DrillFault = Literal["throttle", "blip", "slow_link", "crash", "hang"]
DEFAULT_RATIOS: dict[str, float] = {"disk_write_mbps": 0.5, "disk_read_mbps": 0.5, "link_gbps": 0.7}
"""Straggler ratios of the probes noisier than compute (``ratio_overrides`` wins)."""
"""The pressure test's per-node probes, in the order of its verdict table."""

# The trainyard launcher's own service account (docker/k8s/launcher-rbac.yaml): training pods are
# untrusted (docs/architecture.md, untrusted input) and must never run with the orchestrator's Kubernetes permissions.
LAUNCHER_SERVICE_ACCOUNT = "trainyard-launcher"

# ---------------------------------------------------------------- bounds

# Ranges that keep every value finite and its uses cheap (a DAG parse builds enums and divisor
# lists from these; a value beyond them is a typo, not a model choice).
MAX_NODES = 512
MAX_STEPS = 1_000_000_000
MAX_BATCH = 1 << 24
MAX_DAYS = 36_500
DAY_S = 86_400.0
MAX_KB = 1 << 20  # 1 GiB: the largest all-reduce message a probe sends

Steps = Annotated[int, Field(ge=1, le=MAX_STEPS)]
Batch = Annotated[int, Field(ge=1, le=MAX_BATCH)]
Days = Annotated[int, Field(ge=1, le=MAX_DAYS)]
Ratio = Annotated[float, Field(gt=0, le=1)]

# ---------------------------------------------------------------- per-field rules


def _rule(regex: str, rule: str) -> AfterValidator:
    """A pattern check whose error says which rule the value breaks (not a bare regex)."""
    pattern = re.compile(regex)

    def check(value: str) -> str:
        if not pattern.fullmatch(value):
            raise ValueError(f"{value!r} is not {rule}")
        return value

    return AfterValidator(check)


def _dns_subdomain(value: str) -> str:
    if len(value) > 253 or not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", value):
        raise ValueError(
            f"{value!r} is not a DNS subdomain: lowercase letters, digits, '-' and '.', at most 253"
            " characters, each dot-separated part starting and ending with a letter or digit"
        )
    return value


def _absolute_path(value: str) -> str:
    if not value.startswith("/") or ".." in PurePosixPath(value).parts or "\\" in value or "\x00" in value:
        raise ValueError(f"{value!r} is not an absolute path: start with '/', without '..', backslashes or NUL")
    return value


Name = Annotated[
    str,
    Field(max_length=200),
    _rule(r"[A-Za-z0-9][A-Za-z0-9_.-]*", "a name: letters, digits, '_', '.' and '-', starting with a letter or digit"),
]
DnsLabel = Annotated[
    str,
    _rule(
        r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?",
        "a DNS-1123 label: at most 63 lowercase letters, digits and '-', starting and ending with a letter or digit",
    ),
]
DnsSubdomain = Annotated[str, AfterValidator(_dns_subdomain)]


def _passed_variable(value: str) -> str:
    # Airflow's settings and connections are the secrets the allow-list keeps from training code;
    # TRAINYARD_* is the launcher's contract, set by it alone.
    if value.upper().startswith(("AIRFLOW", "TRAINYARD_")):
        raise ValueError(
            f"{value!r} may not be passed to training code: AIRFLOW* variables hold the orchestrator's"
            " secrets and TRAINYARD_* is set by the launcher"
        )
    return value


PassedVariable = Annotated[
    str,
    _rule(
        r"[A-Za-z_][A-Za-z0-9_]{0,127}",
        "an environment variable name: letters, digits and '_', not starting with a digit",
    ),
    AfterValidator(_passed_variable),
]
AbsolutePath = Annotated[str, AfterValidator(_absolute_path)]


def _relative_key(value: str) -> str:
    # The rules staging holds every object key to (storage.keys.check_key): the name becomes a path in the hot folder.
    parts = value.split("/")
    if value.startswith("/") or "\\" in value or "\x00" in value or any(p in ("", ".", "..") for p in parts):
        raise ValueError(
            f"{value!r} is not a relative path inside the dataset: no leading '/', no empty, '.' or '..' parts,"
            " no backslashes or NUL (e.g. meta.pkl or tokenizer/vocab.json)"
        )
    return value


RelativeKey = Annotated[str, Field(min_length=1, max_length=1024), AfterValidator(_relative_key)]
Sha256Hex = Annotated[str, _rule(r"[0-9a-f]{64}", "a sha256 digest: 64 lowercase hex digits, as sha256sum prints it")]

# One address, no display name: a local part, '@', a domain with a dot (no spaces, commas or angle
# brackets, which would smuggle a second recipient into the To header).
_EMAIL = re.compile(r"[^@\s,;<>\"]+@[^@\s,;<>\"]+\.[^@\s,;<>\".]+\Z")


def _email(value: str) -> str:
    if not _EMAIL.match(value):
        raise ValueError(f"{value!r} is not an email address; write one address as name@domain.tld")
    return value


Email = Annotated[str, AfterValidator(_email)]

# Kubernetes label syntax (also taint and node-selector keys): an optional DNS-subdomain prefix and
# '/', then a name; values are empty or a name.
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
RESERVED_LABEL_DOMAINS = ("kubernetes.io", "k8s.io")


def _label_key(value: str) -> str:
    prefix, _, name = value.rpartition("/")
    if not _LABEL_NAME.fullmatch(name) or (prefix and _subdomain_problem(prefix)) or value.startswith("/"):
        raise ValueError(
            f"{value!r} is not a Kubernetes label key: an optional DNS subdomain and '/' (example.com/),"
            " then at most 63 letters, digits, '-', '_' and '.', starting and ending with a letter or digit"
        )
    return value


def _subdomain_problem(text: str) -> bool:
    try:
        _dns_subdomain(text)
    except ValueError:
        return True
    return False


def _label_value(value: str) -> str:
    if value and not _LABEL_NAME.fullmatch(value):
        raise ValueError(
            f"{value!r} is not a Kubernetes label value: empty, or at most 63 letters, digits, '-', '_'"
            " and '.', starting and ending with a letter or digit"
        )
    return value


def reserved_label_domain(key: str) -> str | None:
    """The Kubernetes-reserved namespace ``key`` is in (``kubernetes.io``, ``k8s.io`` or a subdomain), if any."""
    prefix = key.rpartition("/")[0].lower()
    return next((d for d in RESERVED_LABEL_DOMAINS if prefix == d or prefix.endswith("." + d)), None)


def _own_label_key(value: str) -> str:
    domain = reserved_label_domain(value)
    if domain is not None:
        raise ValueError(
            f"{value!r} is in the {domain}/ namespace, which Kubernetes keeps for its own labels (marking"
            " nodes with it could overwrite one, e.g. kubernetes.io/hostname); use a key of your own,"
            " e.g. trainyard.io/evicted"
        )
    return value


LabelKey = Annotated[str, AfterValidator(_label_key)]
LabelValue = Annotated[str, AfterValidator(_label_value)]
OwnLabelKey = Annotated[str, AfterValidator(_label_key), AfterValidator(_own_label_key)]
"""A label (or taint) key trainyard writes: valid syntax, outside the namespaces Kubernetes reserves."""


def _pod_service_account(value: str) -> str:
    if value == LAUNCHER_SERVICE_ACCOUNT:
        raise ValueError(
            f"{value!r} is the trainyard launcher's own service account; training pods run untrusted"
            " code and must not hold its permissions: use a service account of their own (or null)"
        )
    if value not in (allowed := pod_service_accounts()):
        # Any other account of the namespace (the Airflow chart's airflow-scheduler, say) may hold
        # permissions the pipeline author does not, and the pods run the author's code.
        raise ValueError(
            f"{value!r} is not an allowed pod service account (allowed: {', '.join(sorted(allowed))}); use one of"
            " them or null, or have the Airflow admin add it to [trainyard] pod_service_accounts"
            f" ({setting_env(POD_SERVICE_ACCOUNTS)})"
        )
    return value


PodServiceAccount = Annotated[str, AfterValidator(_dns_subdomain), AfterValidator(_pod_service_account)]

BACKENDS: tuple[str, ...] = ("local", "kubernetes")
"""The names ``nodes.backend`` takes: each is an entry of ``backends.registry.BACKENDS`` (a backend adds its name
here and its entry there; the registry's import fails when they disagree)."""


def _backend(value: str) -> str:
    if value not in BACKENDS:
        names = [repr(b) for b in BACKENDS]
        raise ValueError(f"{value!r} is not allowed; expected {', '.join(names[:-1])} or {names[-1]}")
    return value


BackendName = Annotated[str, AfterValidator(_backend)]

# The command line's types and rules are ``spec.args``'s; here only the field's validation.
ArgsValue = Annotated[ArgMap | list[ArgItem], PlainValidator(valid_args)]

# ---------------------------------------------------------------- models


class _Model(BaseModel):
    # allow_inf_nan: no .inf or .nan in any float field, whatever its bounds.
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True, allow_inf_nan=False)


class DataExpectations(_Model):
    min_shards: int = Field(1, ge=1, le=10_000_000)
    """Fewest shards the staged dataset may have."""
    max_shards: int | None = Field(None, ge=1, le=10_000_000)
    """Most shards the staged dataset may have; null: no bound."""
    min_tokens_per_shard: int = Field(1, ge=1, le=1 << 40)
    """Fewest tokens a shard may hold (a shard below it is empty or truncated)."""
    max_tokens_per_shard: int | None = Field(None, ge=1, le=1 << 40)
    """Most tokens a shard may hold; null: no bound."""
    max_vocab: int | None = Field(None, ge=1, le=1 << 32)
    """Largest vocabulary a shard header may declare (the model's embedding size, at most a uint32's range); null: no bound."""
    dtypes: list[TokenDtype] = ["uint16", "uint32"]
    """Token dtypes a shard may use."""
    unique_shards: bool = True
    """No two shards (files, in any format) may have the same content (their staged digest)."""
    min_chars: int = Field(1, ge=0, le=1 << 30)
    """Text formats: fewest characters a document's text may have (1: no empty texts)."""
    max_chars: int | None = Field(1_000_000, ge=1, le=1 << 30)
    """Text formats: most characters a document's text may have (a longer one is usually documents run
    together); null: no bound."""
    max_duplicate_ratio: float = Field(0.1, ge=0, le=1)
    """Text formats: the largest share of sampled texts that may repeat an earlier one (0: every text unique)."""
    sample_rows: int = Field(100_000, ge=1, le=10_000_000)
    """Text formats: how many documents the check reads, shared evenly among the files (the first rows of
    each, so memory stays bounded on any corpus); a malformed line or row group inside them fails the check."""


TOKEN_EXPECTATIONS = frozenset({"min_tokens_per_shard", "max_tokens_per_shard", "max_vocab", "dtypes"})
"""``DataExpectations`` fields that only token formats (``tok``, ``numpy``) check."""
TEXT_EXPECTATIONS = frozenset({"min_chars", "max_chars", "max_duplicate_ratio", "sample_rows"})
"""``DataExpectations`` fields that only text formats (``parquet``, ``jsonl``) check."""


class Lifecycle(_Model):
    expire_days: Days | None = None
    """Delete objects under the cold prefix this many days after they were written (at most 36500)."""
    transition_days: Days | None = None
    """Move objects to ``storage_class`` this many days after they were written (at most 36500)."""
    storage_class: str | None = Field(None, min_length=1, max_length=100)
    """Target storage class of the transition (e.g. GLACIER, or a MinIO tier name)."""


class DataFile(_Model):
    name: RelativeKey
    """The file's path relative to ``dataset.source`` (and to the staged folder), e.g. ``meta.pkl``."""
    sha256: Sha256Hex | None = None
    """The sha256 the file must have (hex, as ``sha256sum`` prints it); null: not checked beyond staging's own
    verification of the copy."""
    size: int | None = Field(None, ge=0, le=1 << 50)
    """The size in bytes the file must have; null: any."""
    required: bool = True
    """A required file missing at the source fails staging; an optional one is a warning in the data check."""


class DatasetSpec(_Model):
    source: str
    """Cold-tier URI of the shard folder (``file:///abs/path`` or ``s3://bucket/prefix``); may use ``{{ ds }}`` and ``${VAR}``."""
    hot: str = "file://${TRAINYARD_HOME}/hot"
    """Hot-tier root near the compute; a ``file://`` URI."""
    name: str
    """Key of the staged copy inside the hot root: a relative path without ``.``/``..`` parts, neither inside
    nor around another pipeline's dataset in the same hot root; may use ``{{ ds }}`` (one placeholder renders
    within one path part)."""
    connection: str | None = None
    """Airflow connection id (type aws, ``endpoint_url`` in extra) for an ``s3://`` source."""
    format: DataFormat = "tok"
    """How the files are written: ``tok`` (trainyard's shards, the whole prefix is staged), ``numpy``
    (token arrays: raw ``.bin`` as nanoGPT writes them, or ``.npy``), ``parquet`` or ``jsonl`` (text,
    one document per row or line; the training script tokenizes it)."""
    dtype: TokenDtype | None = None
    """Format ``numpy`` only, and required there: the token dtype the files were written with (a raw
    ``.bin`` has no header to say it; nanoGPT writes uint16). A ``.npy`` file's header must agree."""
    text_column: str = Field("text", min_length=1, max_length=256)
    """Text formats only: the column (Parquet) or field (JSON Lines) that holds each document's text."""
    expectations: DataExpectations = DataExpectations()
    """Checks the staged data must pass before any node is spent on it."""
    hot_capacity_gb: float | None = Field(None, gt=0, le=1_000_000)
    """Size of the hot root, shared by every dataset staged there; least recently used
    unpinned datasets are evicted to make room. Null: unbounded."""
    concurrency: int = Field(4, ge=1, le=64)
    """Objects transferred at once."""
    lifecycle: Lifecycle | None = None
    """Expiration or transition rule set on the ``s3://`` source prefix."""
    files: list[DataFile] = Field([], max_length=1000)
    """Files the training script reads beside its shards (a vocabulary such as nanoGPT's ``meta.pkl``, a tokenizer):
    staged with the dataset in every format, verified by size and hash (never opened, never unpickled), and
    required by the data check. They are not shards: a name with the format's own suffix is refused."""


class KubernetesSpec(_Model):
    connection: str | None = None
    """Airflow connection id of the cluster (type kubernetes); null: in-cluster config or the default kubeconfig."""
    namespace: DnsLabel = "default"
    """Namespace of the training Job, Service and PodGroup (a DNS-1123 label)."""
    image: str = Field(min_length=1)
    """Trainer image (torch plus trainyard)."""
    service_account: PodServiceAccount | None = None
    """Service account of the training pods: ``trainyard-trainer`` or one the Airflow admin allows
    (``[trainyard] pod_service_accounts``); never the launcher's own (``trainyard-launcher``): pods run
    untrusted code. Null: none (no API token is mounted)."""
    scheduler: Literal["default", "volcano"] = "default"
    """``volcano`` adds a PodGroup with minMember = nodes for gang scheduling."""
    cpu: str = "1"
    """CPU request and limit per pod (Kubernetes quantity)."""
    memory: str = "2Gi"
    """Memory request and limit per pod (Kubernetes quantity)."""
    gpus: int = Field(0, ge=0, le=64)
    """``nvidia.com/gpu`` per pod."""
    node_selector: dict[LabelKey, LabelValue] = {}
    """Node labels the pods must match (Kubernetes label keys and values; well-known ones such as
    ``kubernetes.io/arch`` may be selected on, since selecting reads a label and writes none)."""
    tolerations: list[dict[str, str]] = []
    """Pod tolerations, as in a pod spec."""
    hot_pvc: DnsSubdomain | None = None
    """PersistentVolumeClaim that holds the hot tier, mounted in every pod."""
    evicted_label: OwnLabelKey = "trainyard.io/evicted"
    """Label put on nodes the pressure test evicted; training pods avoid it. A key of your own: the
    ``kubernetes.io/`` and ``k8s.io/`` namespaces (and their subdomains) belong to Kubernetes."""
    evict_with: Literal["label", "taint"] = "label"
    """How an evicted node is marked: ``label`` (only trainyard's pods avoid it) or ``taint``
    (the label plus a NoSchedule taint of the same key, so every pod that does not tolerate it avoids it)."""
    hot_mount: AbsolutePath | None = None
    """Where ``hot_pvc`` is mounted in the pods (where the orchestrator mounts the same volume);
    null: the deepest folder the run's paths share (``$TRAINYARD_HOME``)."""
    store_host: str | None = None
    """Address the burn-in pods use to reach the worker running the pressure test; null: its host's IP."""
    cluster_domain: DnsSubdomain = "cluster.local"
    """DNS domain of the cluster; pod 0's name under it is the rendezvous endpoint."""
    deferrable: bool = True
    """Free the worker slot while an attempt runs: the train task defers to a trigger, which watches
    the pods (and the heartbeats, where the triggerer mounts the hot tier) and wakes it on each event.
    false: the task supervises the attempt itself, holding its slot."""
    wake_every_s: float = Field(300.0, ge=5, le=DAY_S)
    """While deferred, the train task also wakes this often to judge new checkpoints (retention, cold
    copies) and check heartbeats itself."""
    poll_s: float = Field(5.0, gt=0, le=600)
    """Seconds between the trigger's looks at the attempt's pods and heartbeats."""
    verify_pods: int = Field(0, ge=0, le=1024)
    """The checkpoint gate hashes the final checkpoint's files with a Job of this many pods, each a slice
    of the files, reading the hot tier's claim (needs ``hot_pvc``); 0: on the Airflow worker, a thread a core."""
    verify_timeout_s: float = Field(3600.0, gt=0, le=DAY_S)
    """How long the verification Job may take, from its creation (scheduling included)."""


class NodesSpec(_Model):
    count: int = Field(ge=1, le=MAX_NODES)
    """Nodes to train on (at most 512)."""
    min: int = Field(1, ge=1, le=MAX_NODES)
    """Fewest nodes a run may scale down to after a failure."""
    max: int | None = Field(None, ge=1, le=MAX_NODES)
    """Most nodes a UI trigger may ask for (default: count + spare; at most 512)."""
    spare: int = Field(0, ge=0, le=MAX_NODES)
    """Extra candidates pressure-tested beside ``count``, so weak ones can be left out."""
    procs_per_node: int = Field(1, ge=1, le=16)
    """Training processes (ranks) per node."""
    gpus_per_node: int = Field(0, ge=0, le=64)
    """``local`` backend: GPUs of this host each node gets (``CUDA_VISIBLE_DEVICES``; node i has GPUs
    i*g to i*g+g-1), refused if the host has fewer than count x this; 0: none, training runs on CPUs.
    On Kubernetes, ``kubernetes.gpus`` says it."""
    backend: BackendName = Field("local", json_schema_extra={"enum": list(BACKENDS)})
    """``local``: one torchrun agent process per node on this machine; ``kubernetes``: pods."""
    kubernetes: KubernetesSpec | None = None
    """Settings of the kubernetes backend (required with it)."""

    @property
    def upper(self) -> int:
        return self.max if self.max is not None else self.count + self.spare


class BurnInDrill(_Model):
    node: str
    """Candidate to act out the fault (``node-0``, ``node-1``, ...)."""
    fault: DrillFault
    """``throttle``: slow by ``factor``; ``blip``: slow in the first round only (the confirmation round clears it);
    ``slow_link``: its collective traffic slow by ``factor``; ``crash``: exit; ``hang``: stop responding."""
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
    collective_sizes_kb: list[Annotated[int, Field(ge=1, le=MAX_KB)]] = Field(
        [64, 1024, 8192], min_length=1, max_length=16
    )
    """All-reduce message sizes of the collective probe (KiB, 1 to 1048576 each, at most 16 sizes)."""
    min_gflops: float = Field(0.0, ge=0, le=1e9)
    """Absolute floor of the compute probe (GFLOP/s)."""
    min_membw_gbps: float = Field(0.0, ge=0, le=1e6)
    """Absolute floor of memory bandwidth (GB/s)."""
    min_disk_mbps: float = Field(0.0, ge=0, le=1e7)
    """Absolute floor of hot-tier write and read throughput (MB/s)."""
    min_link_gbps: float = Field(0.0, ge=0, le=1e5)
    """Absolute floor of a node's link bandwidth (GB/s), its best pair in the pairwise link test."""
    min_bf16_fraction_of_peak: float = Field(0.5, ge=0, le=1)
    """A GPU below this fraction of its model's dense bf16 peak is evicted (a healthy H100 reaches about 0.7)."""
    max_gpu_temp_c: float = Field(85.0, gt=0, le=150)
    """A GPU hotter than this under the probe's load is evicted (datacenter GPUs slow down near 87-90 C)."""
    straggler_ratio: Ratio = 0.9
    """A node below this fraction of its reference (the batch median, or the fleet history) on a probe is a suspect."""
    ratio_overrides: dict[Probe, Ratio] = {}
    """Per-probe straggler ratios, over the defaults (disks 0.5: shared disks are noisier than cores; links 0.7)."""
    cooldown_h: float = Field(24.0, ge=0, le=24 * 365)
    """An evicted node sits out this long, then a later pressure test re-tests it and re-admits it if it passes."""
    drills: list[BurnInDrill] = Field([], max_length=MAX_NODES)
    """Faults to act out during the test, for rehearsals (also ``TRAINYARD_BURNIN_DRILLS``)."""

    def ratio(self, probe: Probe) -> float:
        if probe not in PROBES:
            return _unknown_probe(probe)
        return self.ratio_overrides.get(probe, DEFAULT_RATIOS.get(probe, self.straggler_ratio))

    def floor(self, probe: Probe) -> float:
        floors = {
            "matmul_gflops": self.min_gflops,
            "membw_gbps": self.min_membw_gbps,
            "disk_write_mbps": self.min_disk_mbps,
            "disk_read_mbps": self.min_disk_mbps,
            "bf16_tflops": 0.0,  # a device's own floor is its fraction of peak
            "link_gbps": self.min_link_gbps,
        }
        return floors[probe] if probe in floors else _unknown_probe(probe)


def _unknown_probe(probe: str) -> float:
    raise ValueError(f"unknown pressure-test probe {probe!r}; probes: {', '.join(PROBES)}")


class TrainingSpec(_Model):
    entrypoint: str = "trainyard.workload"
    """Python module (``-m``) or ``.py`` script run by torchrun on every rank."""
    framework: Framework = "auto"
    """What the script trains with, imported once on the local backend before its ranks are forked, so a
    relaunch's ranks start without importing it again: ``torch``, ``hf`` (transformers and
    ``trainyard.runtime.hf``), ``lightning`` (``lightning.pytorch`` and ``trainyard.runtime.lightning``);
    ``auto`` reads it from a ``.py`` script's imports (torch for a module); ``none`` starts every rank as a new
    interpreter, for a script that must not share a process's imports."""
    args: ArgsValue = {}
    """The entrypoint's arguments, in the order written: a mapping (each entry written as ``args_form`` says,
    a boolean as ``booleans`` says, a list as ``--key v1 v2``), or a list whose string items are passed as
    is (a config file, a literal flag) and whose mapping items are written like the mapping. A number reaches
    the script as Python writes it (``1.0e-4`` as ``0.0001``; quote it to keep your spelling). Strings may hold
    templates: ``{{ ds }}``, ``{{ run_id }}``, ``${VAR}``, ``{{ data_dir }}``, ``{{ checkpoint_dir }}``,
    ``{{ run_dir }}``, ``{{ max_steps }}``."""
    max_steps: Steps
    """Optimizer steps to train."""
    global_batch: Batch
    """Sequences per optimizer step, kept constant when the world size changes."""
    micro_batch: Batch
    """Sequences per forward pass on one rank."""
    checkpoint_every: Steps
    """Steps between checkpoints (the final step is always saved)."""
    checkpoint_async: bool = True
    """Write checkpoints in the background: training blocks only to copy the state to memory, so
    saving often costs little and a fault loses fewer steps. The manifest still comes last."""
    heartbeat_timeout_s: float = Field(60.0, gt=0, le=DAY_S)
    """A rank silent for this long is hung."""
    startup_grace_s: float = Field(120.0, gt=0, le=DAY_S)
    """Seconds a rank may take to its first heartbeat (interpreter, imports, rendezvous, data), or
    ``heartbeat_timeout_s`` where that is longer. A script with no beat from any rank by then writes none:
    hang detection stays off for it (the run says so once), and its processes' exits are its liveness."""
    progress_every_s: float = Field(30.0, ge=0, le=DAY_S)
    """Seconds between progress records: a line in the ``train`` task's log (step, loss, speed, ETA, last
    checkpoint) and a ledger ``step`` event with the min/mean/max loss and step time since the last one
    (checkpoint steps, the first and last step and a non-finite loss are always recorded). 0: both at
    every step (every poll for the log), for short runs whose every step matters; a long run stays cheap to view."""
    seed: int = Field(0, ge=0, le=(1 << 32) - 1)
    """Seed of weights and data order."""
    resume_from: str = "latest"
    """``latest`` (the newest valid checkpoint, if any), ``none``, or the absolute path of a checkpoint,
    which must lie inside this pipeline's checkpoint folders or one of ``allowed_resume_roots``."""
    allowed_resume_roots: list[str] = Field([], max_length=64)
    """More folders a ``resume_from`` path may lie in (another pipeline's checkpoints, on purpose):
    absolute ``file://`` URIs or paths; may use ``${VAR}``. Checked when a run starts, before staging."""
    pass_env: list[PassedVariable] = Field([], max_length=64)
    """Names of the worker's environment variables that reach training processes on the local backend
    (an experiment tracker's key, a proxy). Nothing else crosses but an allow-list of paths, locale and
    CUDA/OMP/MKL/TORCH/NCCL/GLOO tuning: training code is untrusted. Kubernetes pods take theirs from the
    image or the cluster, never from the worker."""
    workdir: str | None = None
    """Where the ranks start. Null: the folder holding a ``.py`` entrypoint (as ``python train.py`` is run from
    its repo), the run's folder for a module; on Kubernetes the image's ``WORKDIR`` (the container's
    ``workingDir`` only when given). A relative path (and a relative ``.py`` entrypoint) is the spec file's
    folder's on the local backend, the image's on Kubernetes. May hold the templates ``args`` may."""
    args_form: ArgsForm = "--key value"
    """How a mapping's entry is written: ``--key value`` (two words) or ``--key=value`` (one; nanoGPT's
    configurator, ``HfArgumentParser``). A list value needs ``--key value``."""
    booleans: Booleans = "flag"
    """How a boolean in ``args`` is written: ``flag`` (true: a bare ``--key``; false is refused, never dropped),
    ``flag/--no-flag`` (false: ``--no-key``), or the value as ``true/false``, ``True/False`` or ``1/0``."""
    resume_args: list[str] = Field([], max_length=64)
    """Arguments added after ``args`` only when an attempt resumes from a checkpoint (a relaunch after a fault,
    a run resuming the lineage): ``["--init_from=resume"]``. Besides the ``args`` templates, ``{{ resume_from }}``
    is the checkpoint trainyard chose, as the script's own file."""
    env: dict[str, str] = Field({}, max_length=256)
    """Variables set for the ranks, locally and in pods (``WANDB_MODE: offline``); values may hold the ``args``
    templates. Not ``TRAINYARD_*`` nor what the launchers set (``RANK``, ``MASTER_ADDR``, ...)."""

    log_pattern: str | None = Field(None, max_length=1000)
    """For a script that writes no heartbeats: a regular expression finding its step in a line of its log,
    with a named group ``step`` and optionally ``loss`` (``'it (?P<step>\\d+) .* loss=(?P<loss>[0-9.]+)'``).
    null: the common forms (nanoGPT's ``iter N: loss X``, ``step N``, Hugging Face's and Lightning's progress
    bars; ``recovery/logsteps.py``). The steps read become the run's progress line, step events and figures."""

    log_silence_s: float | None = Field(None, ge=1, le=DAY_S)
    """For a script that writes no heartbeats: hang detection from its log. When the nodes' logs show no new step
    (by ``log_pattern`` or the common forms) for this long after their first one, the attempt is hung and
    relaunched from its checkpoint; set it above the longest quiet stretch a healthy run has (an evaluation, a
    save). No node is blamed: the logs cannot say which node stalled the others. null: off."""

    def arg(self, name: str) -> ArgValue | None:
        """The value of the named argument ``--name`` (a later one wins), None when not given: whichever form
        ``args`` takes, every reader asks here."""
        return named(self.args).get(name)


class MetricExpectations(_Model):
    max_loss: float | None = Field(None, gt=0, le=1e9)
    """A checkpoint whose loss is above this is not valid; null: no bound."""
    max_spike_ratio: float | None = Field(3.0, gt=1, le=1e6)
    """No step's loss may exceed this multiple of the running median before it; null: no check."""
    spike_window: int = Field(20, ge=2, le=100_000)
    """Recorded losses in the running median of the spike check: one per step when
    ``training.progress_every_s`` is 0, else each progress record's sampled steps, end and peak."""


class CheckpointSpec(_Model):
    hot: str = "file://${TRAINYARD_HOME}/checkpoints"
    """Root of checkpoints near the compute (``file://``); the pipeline's folder lives under it."""
    cold: str = "file://${TRAINYARD_HOME}/cold/checkpoints"
    """Where valid checkpoints are published (``file://`` or ``s3://``)."""
    connection: str | None = None
    """Airflow connection id for an ``s3://`` cold tier."""
    keep_hot: int = Field(3, ge=1, le=10_000)
    """Latest valid checkpoints kept in the hot tier (the latest valid one is never deleted)."""
    cold_every_steps: Steps | None = None
    """Copy to the cold tier each valid checkpoint whose step is a multiple of this during training;
    null: only the published one."""
    expectations: MetricExpectations = MetricExpectations()
    """Metric bounds a checkpoint must meet."""
    lifecycle: Lifecycle | None = None
    """Expiration or transition rule set on the ``s3://`` cold prefix of published checkpoints."""
    step_key: str | None = Field(None, min_length=1, max_length=100, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """A top-level key of the script's own ``torch.save`` file (``ckpt.pt``) that holds its step, read before the
    common ones (``step``, ``global_step``, ``iter_num``, ``iteration``, ``epoch``) when the file's name carries
    no step; null: only the common ones."""
    save_folder: str | None = Field(None, min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.=+-]*$")
    """The name of a folder the script overwrites in place at each save (its ``torch.save`` files, one of them
    holding the step), beside the common ``latest``, ``last``, ``checkpoint`` and ``ckpt``: each completed
    overwrite is adopted as one save, copied; null: only the common names."""


class RecoverySpec(_Model):
    max_attempts: int = Field(3, ge=1, le=100)
    """Training attempts per run, the first included."""
    backoff_s: float = Field(5.0, ge=0, le=3600)
    """Pause before a retry."""
    actions: dict[FailureKind, Action] = {}
    """Per-failure-kind action overriding the defaults (docs/architecture.md, failure kinds)."""
    in_place: bool = True
    """A lost, hung, flaky or preempted node whose action is ``retry`` or ``scale_down`` is healed in place
    where the attempt can regroup (the local backend without GPUs, a script that trains through
    ``runtime.elastic_group``, any number of processes per node): the survivors keep their processes and
    state and form a new group on the supervisor's store. Otherwise (Kubernetes, GPU nodes, a script that
    never forms the group), or when false, the attempt is relaunched. The ledger's ``recovery_path`` says
    which and why. False: always relaunch (the relaunch path: every node restarted from the checkpoint)."""
    rejoin: bool = True
    """In place: a node left out because its process died (``node_lost``, ``transient``) is started again at
    once, outside the group; reaching the store ready (started, data open, model built) is its re-test, and
    the world grows back to ``nodes.count`` at the next step boundary, the global batch kept. Warm spares
    join the same way. False: it stays out until the attempt ends (a hung node always does)."""

    snapshot_every: int = Field(1, ge=0, le=1_000_000)
    """Steps between in-memory snapshots of the training state (0: none). Where the backend keeps a node's
    memory across a relaunch (the local backend: ``/dev/shm``), each node keeps the state of its newest steps,
    and a relaunch of the run resumes from the newest whole snapshot the nodes hold when it is newer than the
    checkpoint (the ledger's ``resumed`` says which and why). An attempt that regroups in place takes none (its
    survivors keep the state in their processes). Snapshots are never checkpoints: the gate,
    publishing and the lineage use only the saved ones; they are dropped when the train stage ends. Taken by
    ``runtime.elastic_group`` (the reference workload, ``examples/byo_train.py``) and the Hugging Face and
    Lightning adapters; a script without trainyard calls takes none."""

    def action_for(self, kind: FailureKind) -> Action:
        return self.actions.get(kind, DEFAULT_ACTIONS[kind])


class Drill(_Model):
    fault: Literal["kill", "hang", "slow", "corrupt_checkpoint", "nan", "oom", "exception", "preempt"]
    """``kill``: SIGKILL a node; ``hang``: SIGSTOP it; ``slow``: make it a straggler; ``corrupt_checkpoint``:
    flip a byte of the next checkpoint; ``nan``: NaN loss; ``oom``: out-of-memory error; ``exception``: a bug;
    ``preempt``: SIGTERM the node (notice, as a pod deletion or a spot interruption gives it)."""
    step: Steps
    """Step at which the fault strikes (for ``corrupt_checkpoint``: the first checkpoint at or after it)."""
    node: str | None = None
    """Node that acts it out (``node-1``); null: every node (``nan``, ``corrupt_checkpoint``) or node-0."""
    factor: float = Field(1.0, gt=0, le=1000)
    """``slow`` only: extra time per step, as a multiple of the step time."""
    attempt: int = Field(1, ge=1, le=100)
    """The training attempt it strikes in (later attempts run clean, so recovery can succeed)."""


def _notify_connection(value: str) -> str:
    if value not in (allowed := notify_connections()):
        raise ValueError(
            f"{value!r} is not a connection notices may use (allowed: {', '.join(sorted(allowed))}): a notice carries"
            " the connection's credentials to its host; name one of them, or have the Airflow admin add it to"
            f" [trainyard] notify_connections ({setting_env(NOTIFY_CONNECTIONS)})"
        )
    return value


NotifyConnection = Annotated[str, Field(min_length=1), AfterValidator(_notify_connection)]
"""An Airflow connection id on the admin's list of those notices may use (``[trainyard] notify_connections``)."""


class SlackNotify(_Model):
    connection: NotifyConnection = "slack_default"
    """Airflow connection id of a Slack incoming webhook (type ``slackwebhook``, the Slack provider's): the
    webhook's token, or its whole URL, in the password."""


class WebhookNotify(_Model):
    connection: NotifyConnection
    """Airflow connection id of an HTTP endpoint that gets each notice as a JSON ``POST``: its whole URL
    (``https://...``) in the password (a URL that carries a token is a secret) or the host; request headers
    (an ``Authorization`` token) in the extra's ``headers`` object."""


class NotifySpec(_Model):
    email: list[Email] = Field([], max_length=100)
    """Addresses to write to, through the SMTP connection ``connection``."""
    slack: SlackNotify | None = None
    """Post each notice to a Slack channel through an incoming webhook (the Slack provider's notifier)."""
    webhook: WebhookNotify | None = None
    """Post each notice as JSON (``kind``, ``subject``, ``text``, ``dag_id``, ``run_id``, ``link``) to an
    HTTP endpoint: a chat tool, an incident system, a function."""
    on: list[NotifyOn] = Field(["failure", "recovery"], min_length=1)
    """When to write: ``failure`` (a run failed: which stage, the error class, what recovery did) and
    ``recovery`` (a run succeeded, but recovery acted in ``train``: what failed, what was done, the steps lost)."""
    connection: NotifyConnection = "smtp_default"
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

    @model_validator(mode="after")
    def _somewhere(self) -> NotifySpec:
        if not (self.email or self.slack or self.webhook):
            raise ValueError(
                "nowhere to send: give email (a list of addresses), slack ({connection: CONN_ID}) "
                "or webhook ({connection: CONN_ID}), or remove notify"
            )
        return self


class PipelineSpec(_Model):
    pipeline: Name | None = None
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
    max_active_runs: int = Field(1, ge=1, le=1000)
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
    drills: list[Drill] = Field([], max_length=1000)
    """Faults to act out during training, for rehearsals (see ``trainyard drill``)."""
    notify: NotifySpec | None = None
    """Whom to tell (email, Slack, a webhook) when a run fails or recovers; null: nobody."""

    def dag_id(self, source: Path) -> str:
        return self.pipeline or source.stem


def model_types() -> list[type[_Model]]:
    """Every model of the spec tree (for documentation checks)."""
    return [m for m in globals().values() if isinstance(m, type) and issubclass(m, _Model) and m is not _Model]
