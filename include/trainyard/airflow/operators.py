"""The pipeline's stages as operators, for the DAGs trainyard builds and for DAGs written by hand.

Each takes plain arguments: ``spec``, a spec file's path or a ``PipelineSpec`` built in Python; optionally
``run_file``, ``pin_spec``'s XCom (without it the run's first task pins the spec and the others read that
pin: every task of a run uses the spec its first task saw); and the upstream result it works on, as an
XCom (``burn.output``, a ``BurnInResult``; ``train.output``, a ``TrainResult``; ``gate.output``, a
``GateResult``). ``examples/dags/custom_pipeline.py`` puts an evaluation task between the gate and
publishing. Every stage carries the "Training run" link to the run's page in the training-runs view.

``TrainOperator`` needs more than a function: Airflow calls ``on_kill`` when the task is stopped (marked
failed in the UI, a timeout, a SIGTERM), and torchrun agents run in sessions of their own, so without it
they would outlive the task. Where the run defers (``pipeline.run.defers``: the Kubernetes backend) the task
defers while an attempt runs (the pods need no babysitter in the worker): ``TrainStage.begin`` launches,
the backend's trigger (``Backend.trigger``) watches from the triggerer, and each of its events resumes the task in
``attempt_event``, whose ``TrainStage.resume`` decides and launches again or returns the result. A retry's
backoff is a deferral too, on the provider's ``DateTimeTrigger`` (resumed in ``backoff_over``): no worker
slot sleeps through it.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator, BaseOperatorLink, conf
from airflow.sdk.serde import allow_class

from trainyard.airflow import tasks
from trainyard.airflow.assets import checkpoint_asset
from trainyard.airflow.lineage import Lineage, operator_lineage
from trainyard.airflow.tasks import SpecSource, dagrun_state, kube_client, stage_run
from trainyard.pipeline.results import (
    RESULTS,
    BurnInResult,
    DataCheckResult,
    GateResult,
    PublishResult,
    ReportResult,
    StagingResult,
    TrainResult,
)
from trainyard.report.pages import run_url
from trainyard.spec import NodesSpec, PipelineSpec

if TYPE_CHECKING:  # the Kubernetes clients take a second to import: at run time, not at DAG parse time
    from airflow.providers.standard.triggers.temporal import DateTimeTrigger
    from airflow.triggers.base import BaseTrigger

    from trainyard.backends.base import Launcher
    from trainyard.pipeline.run import Run
    from trainyard.pipeline.train import TrainStage
    from trainyard.recovery.deferred import AttemptWatch, Backoff, Deferral
    from trainyard.recovery.observations import BackoffOver, Reported


def launcher_for(nodes: NodesSpec) -> Launcher:
    """The training launcher of ``nodes.backend``; a cluster's through the provider's hook and its connection."""
    from trainyard.backends.registry import backend_for

    return backend_for(nodes, connect=kube_client).launcher()


def trigger_for(run: Run, watch: AttemptWatch) -> BaseTrigger:
    """The trigger watching the attempt ``TrainStage.begin`` / ``resume`` launched or re-attached: the one its
    backend names (``Backend.trigger``), handed the watch and nothing else (no layer asks which backend defers)."""
    from airflow.sdk.module_loading import import_string

    from trainyard.backends.registry import backend_for

    backend = backend_for(run.spec.nodes)
    if backend.trigger is None:
        raise TypeError(f"nodes.backend {backend.name} names no trigger: its train tasks cannot defer")
    trigger: BaseTrigger = import_string(backend.trigger)(watch)
    return trigger


def backoff_trigger(run: Run, backoff: Backoff, now: float | None = None) -> DateTimeTrigger:
    """The time trigger a backoff defers on: until its end, or the next wake (``wake_every_s``) if sooner,
    since every wake renews the run's lease on its lineage (a backoff can last an hour)."""
    from airflow.providers.standard.triggers.temporal import DateTimeTrigger

    from trainyard.pipeline.run import wake_every_s

    wake = wake_every_s(run.spec.nodes)
    until = backoff.until if wake is None else min(backoff.until, (time.time() if now is None else now) + wake)
    return DateTimeTrigger(moment=dt.datetime.fromtimestamp(until, tz=dt.UTC))


class RunPageLink(BaseOperatorLink):
    """The run's page in the training-runs view (the plugin mounts it on the API server).

    Airflow 3 computes the link in the worker when the task ends and keeps it
    as an XCom, so the UI shows it for a failed task too. Without ``[api]
    base_url`` the link is host-relative, which the UI resolves on its own host.
    """

    name = "Training run"

    def get_link(self, operator: BaseOperator, *, ti_key: Any) -> str:
        return run_url(conf.get("api", "base_url", fallback="") or "", ti_key.dag_id, ti_key.run_id)


def allow_results() -> None:
    """Let this process rebuild the stages' results from their XComs (Airflow's serde imports only allowed
    classes). Every task process parses its DAG file, which imports this module, before it runs."""
    for result in RESULTS:
        allow_class(result)


allow_results()


def export_admin_settings() -> None:
    """Make the admin's allow-lists (``[trainyard] spec_variables``, ``pod_service_accounts``, ``notify_connections``) set in
    ``airflow.cfg`` visible to the spec layer, which reads only the environment (it never imports Airflow).
    Airflow's own environment variable wins, as it does in Airflow."""
    from trainyard.spec.admin import OPTIONS, setting_env

    for option in OPTIONS:
        if setting_env(option) not in os.environ:
            os.environ[setting_env(option)] = conf.get("trainyard", option, fallback="") or ""


export_admin_settings()  # before dag_builder validates a spec: it imports this module first


class StageOperator(BaseOperator):
    """A stage of a trainyard pipeline as a task of any DAG.

    :param spec: the spec file's path, or a ``PipelineSpec`` built in Python.
    :param run_file: the run's pinned spec (``pin_spec``'s XCom), rendered at run time; optional.
    """

    template_fields: Sequence[str] = ("run_file",)
    operator_extra_links = (RunPageLink(),)

    def __init__(self, *, spec: SpecSource, run_file: Any = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.spec = spec if isinstance(spec, PipelineSpec) else str(spec)
        self.run_file = run_file
        self.lineage: Lineage | None = None
        """What the stage read and wrote, once it succeeded (``trainyard.airflow.lineage``)."""

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """The OpenLineage provider asks this when the task succeeded (only where OpenLineage is configured)."""
        return operator_lineage(self.lineage)

    def _run(self) -> Run:
        """The run as this task pinned or read it (the snapshot: cheap, and the spec the stage used)."""
        return tasks.open_pinned(self.spec, self.run_file)


class PinSpecOperator(StageOperator):
    """Pin the run's spec (the spec with the trigger's Params, validated) in the run folder; returns the
    snapshot's path, the other stages' ``run_file``. Make it the run's setup and ``ReportOperator`` its
    teardown, and the report is written whatever the stages did."""

    template_fields: Sequence[str] = ()

    def execute(self, context: Any) -> str:
        return tasks.pin_spec(self.spec)


class StageDatasetOperator(StageOperator):
    """Stage the spec's dataset from its cold tier to the hot tier (parallel, verified, incremental)."""

    def execute(self, context: Any) -> StagingResult:
        result = tasks.stage_dataset(self.spec, self.run_file)
        self.lineage = Lineage([self._run().source_uri], [result.hot_dir])
        return result


class CheckDatasetOperator(StageOperator):
    """Check the staged dataset against the spec's expectations (great-expectations)."""

    def execute(self, context: Any) -> DataCheckResult:
        result = tasks.check_dataset(self.spec, self.run_file)
        self.lineage = Lineage([str(self._run().hot_dataset_dir)])
        return result


class PressureTestOperator(StageOperator):
    """Pressure-test the candidate nodes and keep the best healthy ones; its result is ``TrainOperator``'s
    ``nodes``. Give it a pool slot per node it tests (``dag_builder.node_slots``)."""

    def execute(self, context: Any) -> BurnInResult:
        return tasks.burn_in(self.spec, self.run_file)


class CheckpointGateOperator(StageOperator):
    """Validate the final checkpoint of ``trained`` (hashes, tensors, the spec's metric expectations).

    :param trained: ``TrainOperator``'s result (its ``.output``).
    """

    template_fields: Sequence[str] = ("run_file", "trained")

    def __init__(self, *, trained: Any, **kwargs: Any):
        super().__init__(**kwargs)
        self.trained = trained

    def execute(self, context: Any) -> GateResult:
        result = tasks.check_checkpoint(self.spec, self.run_file, _result(self.trained, TrainResult, "trained"))
        self.lineage = Lineage([result.checkpoint])
        return result


class PublishOperator(StageOperator):
    """Publish the checkpoint ``gate`` passed: a write-once cold copy, then the pointer to the latest.

    Its outlet is the pipeline's checkpoint asset (``trainyard://checkpoints/<dag_id>``), whose events carry
    the copy's URI: DAGs scheduled on it start when a checkpoint is published.

    :param gate: ``CheckpointGateOperator``'s result (its ``.output``), or an evaluation's that returns it.
    """

    template_fields: Sequence[str] = ("run_file", "gate")

    def __init__(self, *, gate: Any, **kwargs: Any):
        super().__init__(**kwargs)
        self.gate = gate
        if not self.outlets and self.has_dag():
            self.outlets = [checkpoint_asset(self.dag_id)]

    def execute(self, context: Any) -> PublishResult:
        gate = _result(self.gate, GateResult, "gate")
        result = tasks.publish(self.spec, self.run_file, gate)
        self.lineage = Lineage([gate.checkpoint], [result.uri])
        return result


def _result(value: Any, kind: type[Any], name: str) -> Any:
    """An upstream's result as this stage needs it: rendered from its XCom, the type the upstream returns."""
    if not isinstance(value, kind):
        raise TypeError(f"{name}: expected a {kind.__name__} (the upstream task's .output), got {type(value).__name__}")
    return value


class TrainOperator(StageOperator):
    """Launch and supervise the training attempts on the nodes the pressure test chose.

    The run holds its pipeline's checkpoint lineage while it trains; Airflow's
    state of the run holding it (``tasks.dagrun_state``) lets a run take over
    at once from one that failed or is gone, without waiting for its lease to lapse.

    :param nodes: ``PressureTestOperator``'s result (its ``.output``), or a list of node names; None:
        the backend's candidates, untested (as with ``pressure_test.enabled: false``).
    """

    ui_color = "#ffd27f"
    template_fields: Sequence[str] = ("run_file", "nodes")

    def __init__(self, *, nodes: Any = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.nodes = nodes
        self._launcher: Launcher | None = None

    def execute(self, context: Any) -> TrainResult:
        with stage_run(self.spec, self.run_file, "train") as run:
            stage = self._stage(run)
            if not stage.defers:
                return self._trained(run, stage.run_blocking())
            outcome = stage.begin()
        return self._wait_for(run, outcome)

    def _trained(self, run: Run, result: TrainResult) -> TrainResult:
        self.lineage = Lineage([str(run.hot_dataset_dir)], [result.checkpoint] if result.checkpoint else [])
        return result

    def _stage(self, run: Run) -> TrainStage:
        """The run's train stage on the chosen nodes, with this task's launcher."""
        from trainyard.pipeline.train import TrainStage

        healthy, spare = self._chosen(run)
        self._launcher = launcher_for(run.spec.nodes)
        return TrainStage(run, healthy, self._launcher, spare, run_state=dagrun_state)

    def _chosen(self, run: Run) -> tuple[list[str], list[str]]:
        if isinstance(self.nodes, BurnInResult):
            return list(self.nodes.healthy), list(self.nodes.spare)
        if isinstance(self.nodes, list | tuple) and all(isinstance(n, str) for n in self.nodes):
            return list(self.nodes), []
        if self.nodes is None:
            from trainyard.backends.registry import backend_for

            names = backend_for(run.spec.nodes, connect=kube_client).candidates()
            return names[: run.spec.nodes.count], names[run.spec.nodes.count :]
        raise TypeError(
            f"nodes: expected a BurnInResult (the pressure test's .output) or node names, got {self.nodes!r}"
        )

    def attempt_event(self, context: Any, event: dict[str, Any]) -> TrainResult:
        """Resumed by the attempt trigger: act on its event, then wait on (this attempt, a backoff, the next one)
        or finish.

        Which attempt the event is about comes from the run's ledger, not from
        deferral kwargs (``airflow dags test`` does not pass those back).
        """
        from trainyard.recovery.look import reported

        return self._resumed(reported(event))

    def backoff_over(self, context: Any, event: Any = None) -> TrainResult:
        """Resumed by the backoff's time trigger: launch the next attempt (or wait on, if the backoff is not over)."""
        from trainyard.recovery.observations import BackoffOver

        return self._resumed(BackoffOver(time.time()))

    def _resumed(self, news: Reported | BackoffOver) -> TrainResult:
        with stage_run(self.spec, self.run_file, "train") as run:
            outcome = self._stage(run).resume(news)
        return self._wait_for(run, outcome)

    def _wait_for(self, run: Run, outcome: Deferral | TrainResult) -> TrainResult:
        """Defer on what the deferred driver waits for (the attempt's trigger, or a time), or return the result."""
        from trainyard.recovery.deferred import AttemptWatch, Backoff

        if isinstance(outcome, AttemptWatch):
            self.defer(trigger=trigger_for(run, outcome), method_name="attempt_event")
        if isinstance(outcome, Backoff):
            self.defer(trigger=backoff_trigger(run, outcome), method_name="backoff_over")
        assert isinstance(outcome, TrainResult), outcome
        return self._trained(run, outcome)

    def on_kill(self) -> None:
        if self._launcher is not None:
            self._launcher.cancel_all()


class ReportOperator(StageOperator):
    """Write the run's report from its ledger, release what the run held (``stages.report``) and drop its
    pipeline's expired run folders.

    The built DAG makes it the run's teardown: it runs whatever the stages did, and its own outcome does not
    hide theirs (see ``dag_builder``); a hand-written DAG does the same with ``as_teardown``.
    """

    def execute(self, context: Any) -> ReportResult:
        return tasks.report(self.spec, self.run_file)
