"""Operators for the stages that need more than a function: ``train`` must be killable.

Airflow calls ``on_kill`` when the task is stopped (marked failed in the UI, a
timeout, a SIGTERM); a TaskFlow function has no such hook, and torchrun agents
run in sessions of their own, so without it they would outlive the task.
"""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseOperator

from trainyard import stages
from trainyard.airflow.tasks import kube_client, mapped_errors, open_from_context
from trainyard.launch.kubernetes import KubernetesLauncher
from trainyard.launch.local import LocalLauncher
from trainyard.spec import NodesSpec


def launcher_for(nodes: NodesSpec) -> LocalLauncher | KubernetesLauncher:
    """The backend of ``nodes.backend``; Kubernetes through the provider's hook and its connection."""
    if nodes.backend == "local" or nodes.kubernetes is None:
        return LocalLauncher()
    return KubernetesLauncher(kube_client(nodes.kubernetes), nodes.kubernetes)


class TrainOperator(BaseOperator):
    """Launch and supervise the training attempt on the nodes ``burn_in`` chose."""

    ui_color = "#ffd27f"

    def __init__(self, *, spec_path: str, burn_in_task_id: str = "burn_in", **kwargs: Any):
        super().__init__(**kwargs)
        self.spec_path = spec_path
        self.burn_in_task_id = burn_in_task_id
        self._launcher: LocalLauncher | KubernetesLauncher | None = None

    def execute(self, context: Any) -> dict[str, Any]:
        chosen = context["ti"].xcom_pull(task_ids=self.burn_in_task_id)
        with mapped_errors():
            run = open_from_context(self.spec_path)
            self._launcher = launcher_for(run.spec.nodes)
            return stages.train(run, chosen["healthy"], launcher=self._launcher, spares=chosen.get("spare", []))

    def on_kill(self) -> None:
        if self._launcher is not None:
            self._launcher.cancel_all()
