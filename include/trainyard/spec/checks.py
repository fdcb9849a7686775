"""Checks that relate fields, files or rendered values: what one field's type cannot say.

``cross_field_problems(spec)`` runs the table ``CHECKS``; each row names the
fields it reads, so a file whose structure is partly wrong still gets every
check that does not read a broken field. ``nested_roots`` relates the specs
of one folder; ``dataset_name_problems`` and ``resume_problems`` are called
again at run time on rendered values (a template can render to what the
spec check could not see). Every line starts with the field it is about.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import TypeGuard

from croniter import croniter

from trainyard.spec.models import Lifecycle, PipelineSpec
from trainyard.spec.templating import ENV_REF, TEMPLATE, placeholder_problems, render

CRON_PRESETS = ("@hourly", "@daily", "@weekly", "@monthly", "@yearly", "@once")
URI_SCHEMES = ("file", "s3")
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


REFERENCE_WORKLOAD = "trainyard.workload"


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


def _resume_from(spec: PipelineSpec) -> list[str]:
    return _resume_shape(spec.training.resume_from)


def _resume_shape(value: str) -> list[str]:
    if not valid_resume(value):
        return [f"training.resume_from: {value!r} must be 'latest', 'none' or an absolute checkpoint path"]
    return []


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
        if name == "lr" and not positive_number(spec.training.args.get("lr")):
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


def _repeated(field: str, items: Sequence[str]) -> list[str]:
    return [f"{field}[{i}]: {item!r} is listed twice" for i, item in enumerate(items) if item in items[:i]]


# The fields each check reads (dotted paths; a prefix covers everything under it). A check that reads
# a field whose value was broken is skipped: its answer would be about a stand-in default.
CHECKS: tuple[tuple[tuple[str, ...], Check], ...] = (
    (("nodes",), _nodes),
    (("nodes", "training.entrypoint"), _gpus),
    (("dataset.expectations",), _expectations),
    (("training.global_batch", "training.micro_batch", "nodes.count", "nodes.procs_per_node"), _batch),
    (("training.entrypoint",), _entrypoint),
    (("training.resume_from",), _resume_from),
    (("training.allowed_resume_roots",), _resume_roots),
    (("training.pass_env", "nodes.backend"), _pass_env),
    (("schedule",), _schedule),
    (("runs_root", "dataset.source", "dataset.hot", "checkpoint.hot", "checkpoint.cold"), _uris),
    (("dataset.name",), _dataset_name),
    (("dataset.source", "dataset.connection", "checkpoint.cold", "checkpoint.connection"), _connections),
    (("dataset.source", "dataset.lifecycle", "checkpoint.cold", "checkpoint.lifecycle"), _lifecycles),
    (("notify",), _notify),
    (("params", "training.args"), _params),
)


def cross_field_problems(spec: PipelineSpec, broken: Iterable[str] = ()) -> list[str]:
    """Every cross-field problem of ``spec``, skipping checks that read a ``broken`` field (dotted paths)."""
    broken = list(broken)
    return [line for reads, check in CHECKS if not _overlaps(reads, broken) for line in check(spec)]


def _overlaps(reads: Sequence[str], broken: Sequence[str]) -> bool:
    return any(r == b or r.startswith(b + ".") or b.startswith(r + ".") for r in reads for b in broken)


def positive_number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


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


# ---------------------------------------------------------------- dataset folders


def dataset_name_problems(name: str, template: str | None = None) -> list[str]:
    """What makes ``name`` unfit as a dataset folder under the hot root (empty when fit).

    Called on the spec's text and again at run time on the rendered name (pass the
    spec's ``template`` then): a folder trainyard stages into, and may evict, must
    be a plain relative path of its own, never the root itself or outside it.
    """
    parts = name.split("/")
    if not name or name.startswith("/") or "\\" in name or "\x00" in name or ".." in parts:
        return [f"{name!r} escapes the hot root; use a relative key without '..' (e.g. tokens/{{{{ ds }}}})"]
    if "." in parts or "" in parts:
        return [
            f"{name!r} has an empty or '.' part; name a folder of its own under the hot root (e.g. tokens/{{{{ ds }}}})"
        ]
    if template is not None and len(parts) != len(template.split("/")):
        return [
            f"{name!r} (from {template!r}) has more parts than its template: a placeholder rendered a '/';"
            " each placeholder must render within one path part"
        ]
    return []


def nested_roots(specs: Mapping[Path, PipelineSpec]) -> list[str]:
    """A line for each spec whose dataset folder may lie inside (or around) another spec's."""
    return list(nested_specs(specs).values())


def nested_specs(specs: Mapping[Path, PipelineSpec]) -> dict[Path, str]:
    """``{spec path: why}`` for each spec whose dataset folder may lie inside (or around) an earlier spec's.

    Folders are compared as whole paths (hot root, then name), so a hot root inside
    another's counts too. Templates and ``${VAR}`` match any value within their path
    part (``tokens`` nests with ``tokens/{{ ds }}``). Two specs naming the same
    source and folder share one staged copy on purpose, and pass.
    """
    folders = [(path, spec, _folder(spec)) for path, spec in specs.items()]
    problems = {}
    for i, (path, spec, folder) in enumerate(folders):
        for other_path, other, other_folder in folders[:i]:
            same = (spec.dataset.source, spec.dataset.name) == (other.dataset.source, other.dataset.name)
            if not same and _may_overlap(folder, other_folder):
                problems[path] = (
                    f"{path}: dataset.name: {spec.dataset.name!r} may be the folder of, inside or around"
                    f" {other_path.name}'s dataset {other.dataset.name!r} (dataset.hot and dataset.name together);"
                    " dataset folders must not nest (staging or evicting one would touch the other's files):"
                    " rename one"
                )
                break
    return problems


def _folder(spec: PipelineSpec) -> list[str]:
    """The path parts of the dataset's hot folder: the hot root's, then the name's."""
    try:  # the hot root holds no run templates (its own check); ${VAR} as on this machine
        hot = render(spec.dataset.hot, {})
    except KeyError:
        hot = spec.dataset.hot
    root = os.path.normpath(hot.removeprefix("file://"))
    return [p for p in root.split("/") if p] + [p for p in spec.dataset.name.split("/") if p]


def _may_overlap(a: list[str], b: list[str]) -> bool:
    """Whether one folder may be the other or lie inside it: every shared part may be equal."""
    return all(_may_equal(x, y) for x, y in zip(a, b))


def _may_equal(x: str, y: str) -> bool:
    (x_head, x_tail), (y_head, y_tail) = _ends(x), _ends(y)
    if x_tail is None:
        return x == y if y_tail is None else _fits(x, y_head, y_tail)
    if y_tail is None:
        return _fits(y, x_head, x_tail)
    heads_fit = x_head.startswith(y_head) or y_head.startswith(x_head)
    return heads_fit and (x_tail.endswith(y_tail) or y_tail.endswith(x_tail))


def _fits(literal: str, head: str, tail: str) -> bool:
    """Whether a literal part can be what a part with placeholders (``head``...``tail``) renders to."""
    return len(literal) >= len(head) + len(tail) and literal.startswith(head) and literal.endswith(tail)


def _ends(part: str) -> tuple[str, str | None]:
    """A part's literal text before its first and after its last placeholder; (part, None) without one."""
    spans = [m.span() for m in (*TEMPLATE.finditer(part), *ENV_REF.finditer(part))]
    if not spans:
        return part, None
    return part[: min(s for s, _ in spans)], part[max(e for _, e in spans) :]


# ---------------------------------------------------------------- resuming


def valid_resume(value: str) -> bool:
    """'latest', 'none' or an absolute path without '..' (the shape; ``resume_problems`` checks the place)."""
    return value in ("latest", "none") or (value.startswith("/") and ".." not in PurePosixPath(value).parts)


def resume_root_fields(spec: PipelineSpec) -> list[tuple[str, str]]:
    """(field, URI as written) of each ``training.allowed_resume_roots`` entry; a bare path as ``file://``."""
    return [
        (f"training.allowed_resume_roots[{i}]", root if "://" in root else "file://" + root)
        for i, root in enumerate(spec.training.allowed_resume_roots)
    ]


def resume_problems(spec: PipelineSpec, resume_from: str, roots: Sequence[str | Path]) -> list[str]:
    """Why the run may not resume from ``resume_from`` (empty when it may).

    ``roots`` are rendered: the pipeline's own checkpoint folders (hot, and cold
    where it is a ``file://`` URI) and its rendered ``allowed_resume_roots``. A
    path must lie inside one of them both as written and with its links
    resolved. The message is the same whether or not the path exists, so the
    check tells a trigger nothing about folders it may not read.
    """
    if resume_from in ("latest", "none") or not valid_resume(resume_from):
        return _resume_shape(resume_from)
    folders = [str(r).removeprefix("file://") for r in roots if "://" not in str(r) or str(r).startswith("file://")]
    if any(_inside(resume_from, folder) for folder in folders):
        return []
    if spec.training.allowed_resume_roots:
        fix = "or from inside one of training.allowed_resume_roots, or add the folder that holds it there"
    else:
        fix = "or list the folder that holds it in training.allowed_resume_roots"
    return [
        f"training.resume_from: {resume_from!r} is outside this pipeline's checkpoint folders and"
        f" training.allowed_resume_roots; resume from this pipeline's own checkpoints {fix}"
    ]


def _inside(path: str, root: str) -> bool:
    def within(p: str, r: str) -> bool:  # strictly below: a checkpoint root itself is no checkpoint
        return p.startswith(r.rstrip("/") + "/")

    return within(os.path.normpath(path), os.path.normpath(root)) and within(
        os.path.realpath(path), os.path.realpath(root)
    )
