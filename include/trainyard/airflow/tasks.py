"""Task adapters: Airflow context in, a library stage out, errors mapped.

The first task, ``pin_spec``, opens the run: it validates the spec file with
the trigger's Params and pins the result in the run folder (``spec.json``).
Every later adapter gets that snapshot's path (an XCom) and reopens the run
from it, so a run, its retries and its report use the spec it started with,
whatever happens to the YAML file meanwhile. Each calls one function of
``trainyard.pipeline.stages``, imported inside the adapter (the stages bring
torch along, and the DAG processor imports this module to parse every
pipeline, which must take milliseconds), and returns the stage's typed
result (``trainyard.pipeline.results``): the XCom the next task reads. Errors a retry cannot fix (a bad spec, bad
data, too few healthy nodes, an invalid checkpoint) fail the task with no
retry; the rest fail it normally, so the task's retries apply. When the
stage ends, its duration and outcome go to Airflow's metrics client.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from airflow.sdk import Connection, get_current_context
from airflow.sdk.exceptions import AirflowFailException

from trainyard.airflow.assets import checkpoint_asset
from trainyard.airflow.metrics import emitted
from trainyard.errors import FAIL_FAST, SpecError
from trainyard.pipeline.results import (
    BurnInResult,
    DataCheckResult,
    GateResult,
    PublishResult,
    ReportResult,
    StagingResult,
    TrainResult,
)
from trainyard.pipeline.run import SNAPSHOT, Run, load_run, open_run
from trainyard.spec import KubernetesSpec, PipelineSpec, load_spec
from trainyard.storage.s3auth import S3Settings, missing_connection, settings_for

log = logging.getLogger(__name__)


def dagrun_state(dag_id: str, run_id: str) -> str | None:
    """Airflow's state of a DAG run (``queued``, ``running``, ``success``, ``failed``), ``absent`` if there
    is no such run, None if Airflow cannot say: the lineage lease asks it about the run that holds it.

    Through the Task SDK (``RuntimeTaskInstance.get_dagrun_state``), as a task may: workers reach
    the metadata database only through the API server.
    """
    from airflow.sdk.exceptions import AirflowRuntimeError
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

    try:
        state = RuntimeTaskInstance.get_dagrun_state(dag_id, run_id)
    except AirflowRuntimeError as exc:
        if (exc.error.detail or {}).get("status_code") == 404:
            return "absent"  # deleted, or a claim from before a database reset
        log.warning("cannot ask Airflow about run %s of %s (%s); its lease decides", run_id, dag_id, exc)
        return None
    except Exception as exc:
        log.warning(
            "cannot ask Airflow about run %s of %s (%s: %s); its lease decides", run_id, dag_id, type(exc).__name__, exc
        )
        return None
    return str(getattr(state, "value", state))


def _s3_settings(conn_id: str) -> S3Settings:
    """S3 endpoint and credentials from an Airflow connection (type aws): its keys, else the AWS chain; its role_arn assumed."""
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        connection = Connection.get(conn_id)
    except AirflowNotFoundException:
        # A missing connection will not appear by retrying the task: fail fast, saying how to add it.
        raise SpecError([missing_connection(conn_id)]) from None
    return settings_for(connection)


def run_date(ctx: Any) -> str:
    """What ``{{ ds }}`` stands for in this run: its logical date, as Airflow's own ``ds``.

    Airflow 3 runs may have no logical date (a REST trigger with
    ``logical_date: null``, an Asset-triggered run); those take the UTC day of
    their ``run_after`` (when the run was triggered or queued). The snapshot
    pins it, so every task of the run sees the same day.
    """
    if ds := ctx.get("ds"):
        return ds
    return ctx["dag_run"].run_after.astimezone(dt.UTC).strftime("%Y-%m-%d")


SpecSource = str | Path | PipelineSpec
"""A spec file's path, or a spec built in Python (a hand-written DAG may hold either)."""


def pin_spec(spec: SpecSource) -> str:
    """Open the run (the spec + the trigger's Params, validated) and pin it; the snapshot's path."""
    with mapped_errors():
        run = _pin(spec)
    snapshot = run.dir / SNAPSHOT
    log.info("spec %s pinned for run %s (ds %s) in %s", run.spec_path, run.run_id, run.ds, snapshot)
    return str(snapshot)


def _pin(spec: SpecSource) -> Run:
    ctx = get_current_context()
    dag_id = ctx["dag"].dag_id
    path, built = (spec, None) if isinstance(spec, str | Path) else (f"{dag_id} (a spec built in Python)", spec)
    return open_run(
        path, dag_id, ctx["run_id"], run_date(ctx), dict(ctx["params"]), connections=_s3_settings, spec=built
    )


def open_pinned(spec: SpecSource, run_file: str | None) -> Run:
    """The run as ``pin_spec`` pinned it (``run_file``, its XCom).

    Without one (a DAG without ``pin_spec``, or ``airflow tasks test`` running one task in a run of its
    own), the first task of the run pins it, as pin_spec would, and every later one reads that pin back
    (``open_run``): every task of a run trains on the spec its first task saw.
    """
    if not run_file:
        return _pin(spec)
    return _own_run(spec, load_run(_own_run_file(spec, str(run_file)), connections=_s3_settings))


def _own_run_file(spec: SpecSource, run_file: str) -> Path:
    """``run_file`` if it is this task's run's snapshot: ``spec.json`` in the run folder of this DAG and this
    run under the runs root of the operator's own spec; else a ``SpecError``.

    An XCom is anyone's to write: another pipeline's ``spec.json`` would have this task stage, train,
    publish or release the lease of that pipeline. The folder is computed from what Airflow says (the DAG
    and run ids) and the spec the task was built with, never from the file itself.
    """
    ctx = get_current_context()
    source = spec if isinstance(spec, PipelineSpec) else load_spec(Path(spec))
    home = Run(spec=source, spec_path=Path(str(spec)), dag_id=ctx["dag"].dag_id, run_id=ctx["run_id"], ds="")
    expected = Path(os.path.normpath(os.path.abspath(home.dir / SNAPSHOT)))
    if os.path.normpath(os.path.abspath(run_file)) != str(expected) or expected.is_symlink():
        raise SpecError(
            [
                f"run_file {run_file!r} is not this run's pinned spec ({expected}): pass this DAG's pin_spec"
                " output (pin.output), or leave run_file out and the run's first task pins it"
            ]
        )
    return expected


def _own_run(spec: SpecSource, run: Run) -> Run:
    """The pinned run, if it names this DAG and this run (the file at the right place may still be old)."""
    ctx = get_current_context()
    if (run.dag_id, run.run_id) != (ctx["dag"].dag_id, ctx["run_id"]):
        raise SpecError(
            [
                f"{run.dir / SNAPSHOT}: pins run {run.run_id!r} of {run.dag_id!r}, not this task's run"
                f" {ctx['run_id']!r} of {ctx['dag'].dag_id!r}; clear the run's first task (pin_spec) to pin it again"
            ]
        )
    return run


@contextmanager
def mapped_errors() -> Iterator[None]:
    try:
        yield
    except FAIL_FAST as exc:
        raise AirflowFailException(f"{type(exc).__name__}: {exc}") from exc


@contextmanager
def stage_run(spec: SpecSource, run_file: str | None, stage: str) -> Iterator[Run]:
    """The pinned run, with errors mapped and the stage's metrics sent when the block ends (success or failure)."""
    with mapped_errors():
        run = open_pinned(spec, run_file)
        with emitted(run, stage):
            yield run


def stage_dataset(spec: SpecSource, run_file: str | None) -> StagingResult:
    from trainyard.pipeline import stages

    with stage_run(spec, run_file, "stage_dataset") as run:
        return stages.stage_dataset(run)


def check_dataset(spec: SpecSource, run_file: str | None) -> DataCheckResult:
    from trainyard.pipeline import stages

    with stage_run(spec, run_file, "check_dataset") as run:
        return stages.check_dataset(run)


def burn_in(spec: SpecSource, run_file: str | None) -> BurnInResult:
    from trainyard.pipeline import stages

    with stage_run(spec, run_file, "burn_in") as run:
        return stages.burn_in(run, connect=kube_client)


def kube_client(spec: KubernetesSpec | None) -> Any:
    """A ``kubernetes`` API client through the provider's hook and the spec's Airflow connection."""
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

    hook = KubernetesHook(conn_id=spec.connection) if spec and spec.connection else KubernetesHook()
    return hook.api_client


def check_checkpoint(spec: SpecSource, run_file: str | None, train: TrainResult) -> GateResult:
    from trainyard.pipeline import stages

    with stage_run(spec, run_file, "check_checkpoint") as run:
        return stages.check_checkpoint(run, train.checkpoint, train.target_step, connect=kube_client)


def publish(spec: SpecSource, run_file: str | None, check_checkpoint: GateResult) -> PublishResult:
    from trainyard.pipeline import stages

    with stage_run(spec, run_file, "publish") as run:
        result = stages.publish(run, check_checkpoint.checkpoint)
    # The pipeline's checkpoint asset gets the copy's URI, where the task declares it (the built DAG and
    # PublishOperator do); a hand-written task without the outlet updates no asset.
    asset, ctx = checkpoint_asset(run.dag_id), get_current_context()
    if any(getattr(o, "uri", None) == asset.uri for o in ctx["task"].outlets):
        event = ctx["outlet_events"][asset]
        event.extra = {"uri": result.uri, "step": check_checkpoint.step, "run_id": run.run_id}
    return result


def report(spec: SpecSource, run_file: str | None) -> ReportResult:
    # Only this adapter needs these.
    from airflow.sdk import conf

    from trainyard.pipeline import stages
    from trainyard.pipeline.retention import RETENTION_DAYS, drop_expired_runs
    from trainyard.report.pages import run_url

    with mapped_errors():
        run = open_pinned(spec, run_file)
    # The report's links to the DAG run and task logs: the UI's public root, else this host's ("/").
    result = stages.report(run, airflow_base=conf.get("api", "base_url", fallback="") or "/")
    # Every run keeps its pipeline's runs folder to [trainyard] runs_retention_days (provider config).
    drop_expired_runs(run.dir, conf.getfloat("trainyard", "runs_retention_days", fallback=RETENTION_DAYS), time.time())
    log.info("report: %s", Path(result.report).resolve().as_uri())
    # Airflow cannot guess its public address; without [api] base_url there is no link to give.
    if base_url := conf.get("api", "base_url", fallback=None):
        log.info("training-runs view: %s", run_url(base_url, run.dag_id, run.run_id))
    return result
