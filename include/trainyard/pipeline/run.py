"""One pipeline run: its spec (with the trigger's Params), paths and ledger.

A run starts with ``open_run``, which pins the spec (Params applied) into the
run folder; every later stage, retry and the report reopen it with
``load_run`` from that snapshot. The Airflow layer only passes in the
identifiers Airflow knows (DAG id, run id, the run's date, Params).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from trainyard.atomic import read_json, write_json_atomic
from trainyard.backends.registry import backend_for
from trainyard.errors import SpecError
from trainyard.events.ledger import Ledger, run_dir, safe_name
from trainyard.spec import PARAM_FIELDS, NodesSpec, PipelineSpec, load_spec, spec_from_data, with_params
from trainyard.spec.resume import resume_problems, resume_root_fields
from trainyard.spec.templating import render
from trainyard.storage import S3Settings, Tier, local_path, open_tier

SNAPSHOT = "spec.json"
RUN_STAGE = "run"  # ledger stage of events about the run as a whole (not one of the pipeline's stages)


@dataclass(frozen=True)
class Run:
    spec: PipelineSpec
    spec_path: Path
    dag_id: str
    run_id: str
    ds: str
    connections: Callable[[str], S3Settings] | None = field(default=None, repr=False)
    """Resolves a connection id to S3 settings (Airflow connections); None: the environment."""

    def tier(self, uri: str, connection: str | None) -> Tier:
        if uri.startswith("s3://") and connection and self.connections:
            return open_tier(uri, self.connections(connection))
        return open_tier(uri)

    @property
    def holder(self) -> str:
        """Who pins hot-tier data for this run."""
        return f"{self.dag_id}/{self.run_id}"

    @property
    def variables(self) -> dict[str, str]:
        return {"ds": self.ds, "ds_nodash": self.ds.replace("-", ""), "dag_id": self.dag_id, "run_id": self.run_id}

    def resolve(self, field: str, text: str) -> str:
        """Fill a spec string's placeholders; a missing variable is a ``SpecError`` naming the field."""
        try:
            return render(text, self.variables)
        except KeyError as exc:
            raise SpecError([f"{self.spec_path}: {field}: {exc.args[0]}"]) from None

    @cached_property
    def dir(self) -> Path:
        root = local_path(self.resolve("runs_root", self.spec.runs_root))
        return run_dir(root, self.dag_id, self.run_id)

    @cached_property
    def ledger(self) -> Ledger:
        return Ledger.in_dir(self.dir)

    @property
    def source_uri(self) -> str:
        return self.resolve("dataset.source", self.spec.dataset.source)

    @property
    def hot_dataset_dir(self) -> Path:
        return self.hot_root / self.resolve("dataset.name", self.spec.dataset.name)

    @property
    def hot_root(self) -> Path:
        return Path(local_path(self.resolve("dataset.hot", self.spec.dataset.hot)))

    @property
    def checkpoint_root(self) -> Path:
        """The pipeline's checkpoints: shared by its runs, so each run can resume the last."""
        return Path(local_path(self.resolve("checkpoint.hot", self.spec.checkpoint.hot))) / safe_name(self.dag_id)

    @property
    def cold_checkpoint_uri(self) -> str:
        return self.resolve("checkpoint.cold", self.spec.checkpoint.cold).rstrip("/") + "/" + safe_name(self.dag_id)


def defers(nodes: NodesSpec) -> bool:
    """Whether the run's train task defers while an attempt runs, decided here alone (the operator picks the
    driver by it, the lineage's lease outlasts the waits by it): only Kubernetes attempts can be left to a
    trigger; local attempts are the task's own child processes."""
    return backend_for(nodes).defers


def wake_every_s(nodes: NodesSpec) -> float | None:
    """How often a deferred train task wakes at the latest, as its backend says; None: the task does not defer."""
    backend = backend_for(nodes)
    return backend.wake_every_s if backend.defers else None


def open_run(
    spec_path: str | Path,
    dag_id: str,
    run_id: str,
    ds: str,
    params: Mapping[str, Any] | None = None,
    connections: Callable[[str], S3Settings] | None = None,
    spec: PipelineSpec | None = None,
) -> Run:
    """Open the run, pinning its spec: the first open writes it, every later one reads it back.

    ``spec``: a spec built in Python (a hand-written DAG's); ``spec_path`` then only names it in messages.

    ``spec.json`` holds the spec as run (Params applied), the Params and the
    run's identifiers; the ledger gets one ``params`` event with the Params and
    which of them differ from the spec file, so the run can be reproduced from
    its folder alone. Once the snapshot exists, the YAML file is not read again
    for this run: an edit made while it runs (or before a retry) waits for the
    next run. The Airflow layer opens a run once (``pin_spec``) and passes the
    snapshot's path on; this function serves the library's callers (drills).
    """
    spec_path = Path(spec_path)
    file_spec = spec if spec is not None else load_spec(spec_path)
    spec = with_params(file_spec, params, spec_path) if params else file_spec
    run = Run(spec=spec, spec_path=spec_path, dag_id=dag_id, run_id=run_id, ds=ds, connections=connections)
    check_resume(run)  # now, not after staging and burn-in: resume_from is a Param anyone who triggers can set
    snapshot = run.dir / SNAPSHOT
    if snapshot.exists():
        return load_run(snapshot, connections)
    # The event goes first and the snapshot last: a task killed in between leaves no snapshot, and the
    # next open finds the event and writes only the snapshot (the ledger is read just this once).
    if next(run.ledger.events(RUN_STAGE, "params"), None) is None:
        run.ledger.append(
            RUN_STAGE,
            "params",
            params=dict(params or {}),
            overrides=param_overrides(file_spec, spec),
            spec_file=str(spec_path),
            snapshot=SNAPSHOT,
            ds=ds,
        )
    write_json_atomic(
        snapshot,
        {
            "spec_file": str(spec_path),
            "params": dict(params or {}),
            "spec": spec.model_dump(mode="json"),
            "dag_id": dag_id,
            "run_id": run_id,
            "ds": ds,
        },
        sort_keys=False,  # the spec's mappings in the order written: training.args reach the script so
    )
    return run


def load_run(snapshot: str | Path, connections: Callable[[str], S3Settings] | None = None) -> Run:
    """The run pinned in ``snapshot`` (its ``spec.json``): the spec it started with, whatever the file says now."""
    snapshot = Path(snapshot)
    try:
        pinned = read_json(snapshot)  # in the run folder: never through a link, any bytes a ValueError
        spec_file = Path(pinned["spec_file"])
        spec = spec_from_data(pinned["spec"], spec_file)
        ids = pinned["dag_id"], pinned["run_id"], pinned["ds"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SpecError(
            [
                f"{snapshot}: cannot read the run's pinned spec ({type(exc).__name__}: {exc});"
                " clear the run's first task (pin_spec) to pin it again"
            ]
        ) from None
    return Run(spec=spec, spec_path=spec_file, dag_id=ids[0], run_id=ids[1], ds=ids[2], connections=connections)


def param_overrides(file_spec: PipelineSpec, spec: PipelineSpec) -> dict[str, dict[str, Any]]:
    """``{param: {"spec": value in the file, "run": value used}}`` for each Param the trigger changed."""
    changed = {}
    for name, path in PARAM_FIELDS.items():
        before, after = _field(file_spec, path), _field(spec, path)
        if before != after:
            changed[name] = {"spec": before, "run": after}
    return changed


def _field(spec: PipelineSpec, path: tuple[str, ...]) -> Any:
    if path[:2] == ("training", "args"):  # a mapping or a list of items: one reader (``TrainingSpec.arg``)
        return spec.training.arg(path[2])
    node: Any = spec
    for key in path:
        node = node.get(key) if isinstance(node, dict) else getattr(node, key, None)
    return node


# Where a run may resume from: its pipeline's own checkpoint roots, and those the spec allows.
# ``training.resume_from`` is also a Param, so whoever may trigger a DAG may set it: an unconfined path
# would read another pipeline's checkpoints. The rule is ``spec.resume.resume_problems``; these find the
# run's rendered roots. ``open_run`` checks it when the run starts, the train stage again when it decides.


def resume_roots(run: Run) -> tuple[list[Path], list[str]]:
    """The folders ``run`` may resume from, and what is wrong with the spec's ``allowed_resume_roots``."""
    roots, problems = [run.checkpoint_root], []
    cold = run.cold_checkpoint_uri
    if cold.startswith("file://"):
        roots.append(Path(local_path(cold)))
    for (name, uri), text in zip(resume_root_fields(run.spec), run.spec.training.allowed_resume_roots):
        path = Path(local_path(run.resolve(name, uri)))  # checked again rendered: ${VAR} may hold anything
        if not path.is_absolute() or ".." in path.parts:
            problems.append(f"{name}: {text!r} must be an absolute folder path without '..'")
        else:
            roots.append(path)
    return roots, problems


def check_resume(run: Run) -> None:
    """``SpecError`` (naming the spec file) unless the run's ``resume_from`` is inside its allowed roots."""
    roots, problems = resume_roots(run)
    problems += resume_problems(run.spec, run.spec.training.resume_from, roots)
    if problems:
        raise SpecError([f"{run.spec_path}: {p}" for p in problems])
