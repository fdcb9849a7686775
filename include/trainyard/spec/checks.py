"""Checks that relate fields, files or rendered values: what one field's type cannot say.

``cross_field_problems(spec)`` runs the table ``CHECKS``; each row names the
fields it reads, so a file whose structure is partly wrong still gets every
check that does not read a broken field. ``uri_problems`` checks a tier
URI (``spec.uris``). Every line starts with the field it is about. Dataset folders
(``spec.folders``) and resuming (``spec.resume``) have modules of their
own: both are checked again at run time on rendered values.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import TypeGuard

from croniter import croniter
from pydantic import BaseModel

from trainyard.reference import REFERENCE_WORKLOAD, flag_problems
from trainyard.spec.args import arg_entries, arg_problems, env_problems, workdir_problems
from trainyard.spec.folders import dataset_name_problems
from trainyard.spec.models import (
    FORMAT_SUFFIXES,
    TEXT_EXPECTATIONS,
    TEXT_FORMATS,
    TOKEN_EXPECTATIONS,
    Lifecycle,
    PipelineSpec,
)
from trainyard.spec.resume import resume_root_fields, resume_shape
from trainyard.spec.templating import placeholder_problems
from trainyard.spec.uris import URI_SCHEMES, uri_problems

CRON_PRESETS = ("@hourly", "@daily", "@weekly", "@monthly", "@yearly", "@once")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")

Check = Callable[[PipelineSpec], list[str]]

# ---------------------------------------------------------------- one spec


def _nodes(spec: PipelineSpec) -> list[str]:
    nodes, problems = spec.nodes, []
    if nodes.min > nodes.count:
        problems.append(f"nodes.min: {nodes.min} must be <= nodes.count ({nodes.count})")
    if nodes.max is not None and nodes.max < nodes.count:
        problems.append(f"nodes.max: {nodes.max} must be >= nodes.count ({nodes.count})")
    if nodes.backend == "kubernetes" and nodes.kubernetes is None:
        problems.append("nodes.kubernetes: required when nodes.backend is kubernetes (at least its image)")
    if nodes.backend == "local" and nodes.kubernetes is not None:
        problems.append("nodes.kubernetes: only allowed with nodes.backend: kubernetes")
    return problems


def _gpus(spec: PipelineSpec) -> list[str]:
    nodes = spec.nodes
    if nodes.backend == "kubernetes" and nodes.gpus_per_node:
        return [
            "nodes.gpus_per_node: local backend only; on Kubernetes set nodes.kubernetes.gpus (nvidia.com/gpu per pod)"
        ]
    field, gpus = (
        ("nodes.kubernetes.gpus", nodes.kubernetes.gpus) if nodes.kubernetes is not None
        else ("nodes.gpus_per_node", nodes.gpus_per_node)
    )  # fmt: skip
    # The reference workload puts rank LOCAL_RANK on cuda:LOCAL_RANK: more ranks than GPUs have none,
    # fewer leave GPUs idle. A script of one's own may place itself otherwise.
    if spec.training.entrypoint == REFERENCE_WORKLOAD and gpus and nodes.procs_per_node != gpus:
        return [
            f"nodes.procs_per_node: {nodes.procs_per_node} must equal {field} ({gpus}): {REFERENCE_WORKLOAD}"
            f" runs one rank per GPU"
        ]
    return []


def _expectations(spec: PipelineSpec) -> list[str]:
    expect, problems = spec.dataset.expectations, []
    if expect.max_shards is not None and expect.max_shards < expect.min_shards:
        problems.append(
            f"dataset.expectations.max_shards: {expect.max_shards} must be >= min_shards ({expect.min_shards})"
        )
    if expect.max_tokens_per_shard is not None and expect.max_tokens_per_shard < expect.min_tokens_per_shard:
        problems.append(
            f"dataset.expectations.max_tokens_per_shard: {expect.max_tokens_per_shard} must be >= min_tokens_per_shard"
            f" ({expect.min_tokens_per_shard})"
        )
    return problems


def _changed(model: BaseModel) -> set[str]:
    """The fields given a value other than their default. Not ``model_fields_set``: a run's pinned spec is the
    whole model, defaults written out, and must load again as the spec it was."""
    fields = type(model).model_fields
    return {
        name
        for name in model.model_fields_set
        if getattr(model, name) != fields[name].get_default(call_default_factory=True)
    }


def _format(spec: PipelineSpec) -> list[str]:
    """Fields that belong to another format are a mistake to name, not to ignore."""
    ds, problems = spec.dataset, []
    text = ds.format in TEXT_FORMATS
    if ds.format == "numpy" and ds.dtype is None:
        problems.append(
            "dataset.dtype: required with dataset.format: numpy; write uint16 or uint32, the dtype the token"
            " arrays were written with (nanoGPT's .bin files: uint16)"
        )
    if ds.format != "numpy" and ds.dtype is not None:
        problems.append(f"dataset.dtype: only for dataset.format: numpy (this dataset is {ds.format}); remove it")
    if not text and "text_column" in _changed(ds):
        problems.append(
            f"dataset.text_column: only for text formats (parquet, jsonl; this dataset is {ds.format}); remove it"
        )
    wrong, which = (
        (TOKEN_EXPECTATIONS, "token formats (tok, numpy)") if text
        else (TEXT_EXPECTATIONS, "text formats (parquet, jsonl)")
    )  # fmt: skip
    for name in sorted(wrong & _changed(ds.expectations)):
        problems.append(
            f"dataset.expectations.{name}: only checked for {which}; this dataset is {ds.format}: remove it"
            " or set dataset.format"
        )
    expect = ds.expectations
    if expect.max_chars is not None and expect.max_chars < expect.min_chars:
        problems.append(f"dataset.expectations.max_chars: {expect.max_chars} must be >= min_chars ({expect.min_chars})")
    return problems


def _files(spec: PipelineSpec) -> list[str]:
    """A file named twice, or one that is a shard of the format: the gate checks shards as shards, never as files."""
    ds, problems = spec.dataset, []
    names = [f.name for f in ds.files]
    suffixes = FORMAT_SUFFIXES[ds.format]
    for i, name in enumerate(names):
        if name in names[:i]:
            problems.append(
                f"dataset.files[{i}].name: {name!r} is listed twice (first as dataset.files[{names.index(name)}])"
            )
        if name.endswith(suffixes):
            problems.append(
                f"dataset.files[{i}].name: {name!r} is a shard of dataset.format {ds.format} (its {'/'.join(suffixes)}"
                " files are staged and checked as shards already); remove it from dataset.files"
            )
    return problems


def _workload_format(spec: PipelineSpec) -> list[str]:
    """The reference workload reads token formats; a raw ``.bin`` is read with its ``--data-dtype``."""
    ds, training = spec.dataset, spec.training
    if training.entrypoint != REFERENCE_WORKLOAD:
        return []
    if problems := flag_problems(arg_entries(training.args)):
        return problems
    if ds.format in TEXT_FORMATS:
        return [
            f"dataset.format: {ds.format} is text, which {REFERENCE_WORKLOAD} cannot train on (it reads token"
            " ids); set training.entrypoint to your script, which tokenizes the text, or use tok or numpy"
        ]
    passed = training.arg("data-dtype") or "uint16"
    if ds.format == "numpy" and ds.dtype is not None and passed != ds.dtype:
        return [
            f"training.args.data-dtype: {passed!r} but dataset.dtype is {ds.dtype!r}; {REFERENCE_WORKLOAD} reads"
            f" .bin files with --data-dtype (default uint16): set training.args.data-dtype: {ds.dtype}"
        ]
    return []


def _batch(spec: PipelineSpec) -> list[str]:
    nodes, training = spec.nodes, spec.training
    ranks = training.micro_batch * nodes.count * nodes.procs_per_node
    if training.global_batch % ranks:
        return [
            f"training.global_batch: {training.global_batch} must be divisible by training.micro_batch x nodes.count"
            f" x nodes.procs_per_node ({training.micro_batch} x {nodes.count} x {nodes.procs_per_node} = {ranks})"
        ]
    return []


def _entrypoint(spec: PipelineSpec) -> list[str]:
    entry = spec.training.entrypoint
    if not entry.endswith(".py") and not _MODULE.match(entry):
        return [f"training.entrypoint: {entry!r} is neither a dotted module name nor a .py script"]
    return []


OUTSIDE_FAULTS = frozenset({"kill", "hang", "slow"})
"""Drills a launcher can act out from outside any process: SIGKILL, SIGSTOP, a SIGSTOP/SIGCONT duty cycle."""
DRILLING_ENTRYPOINTS = frozenset({"trainyard.workload", "trainyard.train"})
"""Entrypoints known to act out every drill themselves (``trainyard.runtime.drills``), exactly at their step.
Any other script is told its drills too (``TRAINYARD_DRILLS``): a loop on trainyard's runtime or the Hugging Face
/ Lightning ``TrainyardCallback`` acts them out and says so (``drills_acted``); for one that does not, the
supervisor acts out ``OUTSIDE_FAULTS`` and records the others as not acted out, with why."""


def acts_drills(entrypoint: str) -> bool:
    """Whether the training process is known to act out all its drills itself: the reference workload."""
    return entrypoint in DRILLING_ENTRYPOINTS


def drill_refusal(fault: str, entrypoint: str, backend: str) -> str | None:
    """Why a drill cannot be acted out for this entrypoint on this backend (None: it can, or only the script
    can tell: a drill it does not act out is refused when the attempt ends)."""
    if acts_drills(entrypoint) or backend == "local" or fault not in OUTSIDE_FAULTS:
        return None
    return (
        f"the {backend} backend cannot signal a node's processes from outside, and {entrypoint} is not known to"
        " act out kill, hang or slow itself (the reference workload does)"
    )


def _drills(spec: PipelineSpec) -> list[str]:
    entry, backend = spec.training.entrypoint, spec.nodes.backend
    return [
        f"drills[{i}]: {why}; drop the drill"
        for i, drill in enumerate(spec.drills)
        if (why := drill_refusal(drill.fault, entry, backend))
    ]


def _resume_from(spec: PipelineSpec) -> list[str]:
    return resume_shape(spec.training.resume_from)


def _resume_roots(spec: PipelineSpec) -> list[str]:
    problems = []
    for (field, uri), written in zip(resume_root_fields(spec), spec.training.allowed_resume_roots):
        problems += [f"{field}: {p.replace(repr(uri), repr(written))}" for p in uri_problems(uri, ("file",))]
        if "{{" in uri:
            problems.append(f"{field}: run templates are only allowed in dataset.source and dataset.name")
    return problems


def _schedule(spec: PipelineSpec) -> list[str]:
    schedule = spec.schedule
    if schedule is None or schedule in CRON_PRESETS:
        return []
    if schedule.startswith("@") or not croniter.is_valid(schedule):
        return [
            f"schedule: {schedule!r} is not a cron expression ('minute hour day month weekday', e.g. '0 2 * * *')"
            f" or one of {', '.join(CRON_PRESETS)}"
        ]
    return []


def _roots(spec: PipelineSpec) -> dict[str, tuple[str, tuple[str, ...]]]:
    return {
        "runs_root": (spec.runs_root, ("file",)),
        "dataset.source": (spec.dataset.source, URI_SCHEMES),
        "dataset.hot": (spec.dataset.hot, ("file",)),
        "checkpoint.hot": (spec.checkpoint.hot, ("file",)),
        "checkpoint.cold": (spec.checkpoint.cold, URI_SCHEMES),
    }


def _uris(spec: PipelineSpec) -> list[str]:
    fields = _roots(spec)
    problems = []
    for field, (uri, schemes) in fields.items():
        problems += [f"{field}: {p}" for p in uri_problems(uri, schemes)]
    # Only the dataset source is per run; the other roots must not move between runs.
    for field, (uri, _) in fields.items():
        if field != "dataset.source" and "{{" in uri:
            problems.append(f"{field}: run templates are only allowed in dataset.source and dataset.name")
    return problems


def _dataset_name(spec: PipelineSpec) -> list[str]:
    name = spec.dataset.name
    problems = placeholder_problems(name) + dataset_name_problems(name)
    return [f"dataset.name: {p}" for p in problems]


def _connections(spec: PipelineSpec) -> list[str]:
    problems = []
    if spec.dataset.source.startswith("s3://") and not spec.dataset.connection:
        problems.append("dataset.connection: required for an s3:// source (an Airflow connection id of type aws)")
    if spec.checkpoint.cold.startswith("s3://") and not spec.checkpoint.connection:
        problems.append("checkpoint.connection: required for an s3:// cold tier (an Airflow connection id of type aws)")
    return problems


def _lifecycles(spec: PipelineSpec) -> list[str]:
    problems = []
    for field, uri, rule in (
        ("dataset", spec.dataset.source, spec.dataset.lifecycle),
        ("checkpoint", spec.checkpoint.cold, spec.checkpoint.lifecycle),
    ):
        if rule is not None:
            problems += [f"{field}.lifecycle: {p}" for p in _lifecycle_problems(uri, rule)]
    return problems


def _lifecycle_problems(uri: str, rule: Lifecycle) -> list[str]:
    problems = []
    if not uri.startswith("s3://"):
        problems.append(f"lifecycle rules need an s3:// tier, not {uri!r}")
    if rule.expire_days is None and rule.transition_days is None:
        problems.append("set expire_days, transition_days or both")
    if (rule.transition_days is None) != (rule.storage_class is None):
        problems.append("transition_days and storage_class go together")
    return problems


def _notify(spec: PipelineSpec) -> list[str]:
    if spec.notify is None:
        return []
    return _repeated("notify.email", spec.notify.email) + _repeated("notify.on", spec.notify.on)


def _params(spec: PipelineSpec) -> list[str]:
    problems = []
    for i, name in enumerate(spec.params):
        if name in spec.params[:i]:
            problems.append(f"params[{i}]: {name!r} is listed twice")
        if name == "lr" and not positive_number(spec.training.arg("lr")):
            problems.append(
                f"params[{i}]: 'lr' overrides training.args.lr, which is not set to a positive number;"
                " set it (the entrypoint's --lr) or drop 'lr' from params"
            )
    return problems


def _pass_env(spec: PipelineSpec) -> list[str]:
    if spec.training.pass_env and spec.nodes.backend == "kubernetes":
        return [
            "training.pass_env: passes the worker's variables to local training processes only; a pod gets its"
            " variables from its image or the cluster (a Secret in its namespace): drop the field"
        ]
    return _repeated("training.pass_env", spec.training.pass_env)


def _command(spec: PipelineSpec) -> list[str]:
    t = spec.training
    return (
        arg_problems(t.args, t.args_form, t.booleans, t.resume_args)
        + env_problems(t.env)
        + workdir_problems(t.workdir, spec.nodes.backend)
    )


def _repeated(field: str, items: Sequence[str]) -> list[str]:
    return [f"{field}[{i}]: {item!r} is listed twice" for i, item in enumerate(items) if item in items[:i]]


# The fields each check reads (dotted paths; a prefix covers everything under it). A check that reads
# a field whose value was broken is skipped: its answer would be about a stand-in default.
def _log_pattern(spec: PipelineSpec) -> list[str]:
    """The pattern the driver matches the script's log lines with: it must compile and name its step."""
    pattern = spec.training.log_pattern
    if pattern is None:
        return []
    try:
        groups = re.compile(pattern).groupindex
    except re.error as exc:
        return [f"training.log_pattern: not a regular expression ({exc}); fix it or remove it for the default forms"]
    if "step" not in groups:
        return ["training.log_pattern: has no named group 'step'; write the step's digits as (?P<step>\\d+)"]
    return []


CHECKS: tuple[tuple[tuple[str, ...], Check], ...] = (
    (("nodes",), _nodes),
    (("nodes", "training.entrypoint"), _gpus),
    (("dataset.expectations",), _expectations),
    (("dataset.format", "dataset.dtype", "dataset.text_column", "dataset.expectations"), _format),
    (("dataset.format", "dataset.dtype", "training.entrypoint", "training.args"), _workload_format),
    (("dataset.files", "dataset.format"), _files),
    (("training.global_batch", "training.micro_batch", "nodes.count", "nodes.procs_per_node"), _batch),
    (("training.entrypoint",), _entrypoint),
    (("drills", "training.entrypoint", "nodes.backend"), _drills),
    (("training.resume_from",), _resume_from),
    (("training.allowed_resume_roots",), _resume_roots),
    (("training.pass_env", "nodes.backend"), _pass_env),
    (("training.log_pattern",), _log_pattern),
    (("schedule",), _schedule),
    (("runs_root", "dataset.source", "dataset.hot", "checkpoint.hot", "checkpoint.cold"), _uris),
    (("dataset.name",), _dataset_name),
    (("dataset.source", "dataset.connection", "checkpoint.cold", "checkpoint.connection"), _connections),
    (("dataset.source", "dataset.lifecycle", "checkpoint.cold", "checkpoint.lifecycle"), _lifecycles),
    (("notify",), _notify),
    (("params", "training.args"), _params),
    (("training", "nodes.backend"), _command),
)


def cross_field_problems(spec: PipelineSpec, broken: Iterable[str] = ()) -> list[str]:
    """Every cross-field problem of ``spec``, skipping checks that read a ``broken`` field (dotted paths)."""
    broken = list(broken)
    return [line for reads, check in CHECKS if not _overlaps(reads, broken) for line in check(spec)]


def _overlaps(reads: Sequence[str], broken: Sequence[str]) -> bool:
    return any(r == b or r.startswith(b + ".") or b.startswith(r + ".") for r in reads for b in broken)


def positive_number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
