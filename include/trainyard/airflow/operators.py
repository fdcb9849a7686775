"""Operators for the stages that need more than a function: ``train`` must be killable, and may defer;
``train`` and ``report`` carry the "Training run" link to the run's page in the training-runs view.

Airflow calls ``on_kill`` when the task is stopped (marked failed in the UI, a
timeout, a SIGTERM); a TaskFlow function has no such hook, and torchrun agents
run in sessions of their own, so without it they would outlive the task.

Where the run defers (``pipeline.run.defers``: the Kubernetes backend) the task
defers while an attempt runs (the pods need no babysitter in the worker):
``TrainStage.begin`` launches, the ``KubernetesAttemptTrigger`` watches from
the triggerer, and each of its events resumes the task in ``attempt_event``,
whose ``TrainStage.resume`` decides and launches again or returns the result. A retry's backoff is a deferral too, on the
provider's ``DateTimeTrigger`` (resumed in ``backoff_over``): no worker slot
sleeps through it.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator, BaseOperatorLink, conf

from trainyard.airflow import tasks
from trainyard.airflow.tasks import dagrun_state, kube_client, stage_run
from trainyard.pipeline.results import BurnInResult, ReportResult, TrainResult
from trainyard.report.pages import run_url
from trainyard.spec import NodesSpec

if TYPE_CHECKING:  # the Kubernetes clients take a second to import: at run time, not at DAG parse time
    from airflow.providers.standard.triggers.temporal import DateTimeTrigger

    from trainyard.airflow.triggers import KubernetesAttemptTrigger
    from trainyard.backends.base import Launcher
    from trainyard.pipeline.run import Run
    from trainyard.pipeline.train import TrainStage
    from trainyard.recovery.deferred import AttemptWatch, Backoff, Deferral
    from trainyard.recovery.observations import BackoffOver, Reported


def launcher_for(nodes: NodesSpec) -> Launcher:
    """The training launcher of ``nodes.backend``; a cluster's through the provider's hook and its connection."""
    from trainyard.backends.registry import backend_for

    return backend_for(nodes, connect=kube_client).launcher()


def trigger_for(run: Run, watch: AttemptWatch) -> KubernetesAttemptTrigger:
    """The trigger watching the attempt ``TrainStage.begin`` / ``resume`` launched or re-attached."""
    from trainyard.airflow.triggers import KubernetesAttemptTrigger
    from trainyard.recovery.progress import tokens_per_step

    k8s = run.spec.nodes.kubernetes
    assert k8s is not None
    training = run.spec.training
    return KubernetesAttemptTrigger(
        namespace=watch.namespace,
        job_name=watch.job_name,
        nodes=list(watch.nodes),
        poll_interval=k8s.poll_s,
        kubernetes_conn_id=k8s.connection,
        timeout_s=min(k8s.wake_every_s, watch.wake_s) if watch.wake_s else k8s.wake_every_s,
        heartbeat_dir=watch.heartbeat_dir,
        heartbeat_timeout_s=run.spec.training.heartbeat_timeout_s,
        world_size=watch.world_size,
        started=watch.started,
        podgroup=k8s.scheduler == "volcano",
        attempt=watch.attempt,
        target_step=watch.target_step,
        tokens_per_step=tokens_per_step(training.global_batch, training.args),
        progress_every_s=training.progress_every_s,
        checkpoint_dir=str(run.checkpoint_root),
        in_place=watch.in_place,
        regrouped=watch.regrouped,
        store=watch.store,
        generation=watch.generation,
        faults_seen=watch.faults_seen,
    )


def backoff_trigger(run: Run, backoff: Backoff, now: float | None = None) -> DateTimeTrigger:
    """The time trigger a backoff defers on: until its end, or the next wake (``wake_every_s``) if sooner,
    since every wake renews the run's lease on its lineage (a backoff can last an hour)."""
    from airflow.providers.standard.triggers.temporal import DateTimeTrigger

    k8s = run.spec.nodes.kubernetes
    wake = (time.time() if now is None else now) + (k8s.wake_every_s if k8s is not None else 0.0)
    until = min(backoff.until, wake) if k8s is not None else backoff.until
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


class TrainOperator(BaseOperator):
    """Launch and supervise the training attempts on the nodes ``burn_in`` chose.

    The run holds its pipeline's checkpoint lineage while it trains; Airflow's
    state of the run holding it (``tasks.dagrun_state``) lets a run take over
    at once from one that failed or is gone, without waiting for its lease to lapse.

    :param spec_path: the spec file, read only where the run was never pinned (``airflow tasks test``).
    :param run_file: the run's pinned spec (``pin_spec``'s XCom), rendered at run time.
    """

    ui_color = "#ffd27f"
    template_fields = ("run_file",)
    operator_extra_links = (RunPageLink(),)

    def __init__(self, *, spec_path: str, run_file: Any, burn_in_task_id: str = "burn_in", **kwargs: Any):
        super().__init__(**kwargs)
        self.spec_path = spec_path
        self.run_file = run_file
        self.burn_in_task_id = burn_in_task_id
        self._launcher: Launcher | None = None

    def execute(self, context: Any) -> TrainResult:
        with stage_run(self.spec_path, self.run_file, "train") as run:
            stage = self._stage(context, run)
            if not stage.defers:
                return stage.run_blocking()
            outcome = stage.begin()
        return self._wait_for(run, outcome)

    def _stage(self, context: Any, run: Run) -> TrainStage:
        """The run's train stage on the nodes burn-in chose (its XCom), with this task's launcher."""
        from trainyard.pipeline.train import TrainStage

        chosen: BurnInResult = context["ti"].xcom_pull(task_ids=self.burn_in_task_id)
        self._launcher = launcher_for(run.spec.nodes)
        return TrainStage(run, list(chosen.healthy), self._launcher, list(chosen.spare), run_state=dagrun_state)

    def attempt_event(self, context: Any, event: dict[str, Any]) -> TrainResult:
        """Resumed by the attempt trigger: act on its event, then wait on (this attempt, a backoff, the next one)
        or finish.

        Which attempt the event is about comes from the run's ledger, not from
        deferral kwargs (``airflow dags test`` does not pass those back).
        """
        from trainyard.airflow.triggers import reported

        return self._resumed(context, reported(event))

    def backoff_over(self, context: Any, event: Any = None) -> TrainResult:
        """Resumed by the backoff's time trigger: launch the next attempt (or wait on, if the backoff is not over)."""
        from trainyard.recovery.observations import BackoffOver

        return self._resumed(context, BackoffOver(time.time()))

    def _resumed(self, context: Any, news: Reported | BackoffOver) -> TrainResult:
        with stage_run(self.spec_path, self.run_file, "train") as run:
            outcome = self._stage(context, run).resume(news)
        return self._wait_for(run, outcome)

    def _wait_for(self, run: Run, outcome: Deferral | TrainResult) -> TrainResult:
        """Defer on what the deferred driver waits for (the attempt's trigger, or a time), or return the result."""
        from trainyard.recovery.deferred import AttemptWatch, Backoff

        if isinstance(outcome, AttemptWatch):
            self.defer(trigger=trigger_for(run, outcome), method_name="attempt_event")
        if isinstance(outcome, Backoff):
            self.defer(trigger=backoff_trigger(run, outcome), method_name="backoff_over")
        assert isinstance(outcome, TrainResult), outcome
        return outcome

    def on_kill(self) -> None:
        if self._launcher is not None:
            self._launcher.cancel_all()


class ReportOperator(BaseOperator):
    """Write the run's report from its ledger and release what the run held (``stages.report``).

    The DAG makes it the run's teardown: it runs whatever the stages did, and
    its own outcome does not hide theirs (see ``dag_builder``).

    :param spec_path: the spec file, read only where the run was never pinned (``airflow tasks test``).
    :param run_file: the run's pinned spec (``pin_spec``'s XCom), rendered at run time.
    """

    template_fields = ("run_file",)
    operator_extra_links = (RunPageLink(),)

    def __init__(self, *, spec_path: str, run_file: Any, **kwargs: Any):
        super().__init__(**kwargs)
        self.spec_path = spec_path
        self.run_file = run_file

    def execute(self, context: Any) -> ReportResult:
        return tasks.report(self.spec_path, self.run_file)
