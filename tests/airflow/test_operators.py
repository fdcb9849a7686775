"""The train operator picks its backend from the spec, and can always be killed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainyard.airflow.operators import TrainOperator, launcher_for
from trainyard.launch.kubernetes import KubernetesLauncher
from trainyard.launch.local import LocalLauncher
from trainyard.spec import NodesSpec

KUBECONFIG = {
    "apiVersion": "v1",
    "kind": "Config",
    "current-context": "test",
    "clusters": [{"name": "test", "cluster": {"server": "http://127.0.0.1:6443"}}],
    "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
    "users": [{"name": "test", "user": {"token": "not-a-real-token"}}],
}


def test_local_backend_gets_local_processes() -> None:
    assert isinstance(launcher_for(NodesSpec(count=2)), LocalLauncher)


def test_kubernetes_backend_goes_through_the_airflow_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "kubeconfig"
    config.write_text(json.dumps(KUBECONFIG))
    monkeypatch.setenv(
        "AIRFLOW_CONN_TRAINING_CLUSTER",
        json.dumps({"conn_type": "kubernetes", "extra": {"kube_config_path": str(config), "namespace": "ml"}}),
    )
    nodes = NodesSpec(
        count=2, backend="kubernetes", kubernetes={"image": "trainer:1", "connection": "training_cluster"}
    )
    launcher = launcher_for(nodes)
    assert isinstance(launcher, KubernetesLauncher)
    assert launcher.core.api_client.configuration.host == "http://127.0.0.1:6443"


def test_on_kill_before_launch_is_harmless_and_after_launch_cancels() -> None:
    op = TrainOperator(task_id="train", spec_path="unused.yaml", run_file="unused/spec.json")
    op.on_kill()  # nothing launched yet

    class Recorder(LocalLauncher):
        cancelled = False

        def cancel_all(self) -> None:
            Recorder.cancelled = True

    op._launcher = Recorder()
    op.on_kill()
    assert Recorder.cancelled


def test_a_run_without_a_logical_date_takes_the_day_of_its_run_after() -> None:
    import datetime as dt
    from types import SimpleNamespace

    from trainyard.airflow.tasks import run_date

    late = dt.datetime(2026, 11, 29, 23, 30, tzinfo=dt.timezone(dt.timedelta(hours=-5)))  # 04:30 UTC on the 30th
    assert run_date({"ds": "2026-11-28", "dag_run": SimpleNamespace(run_after=late)}) == "2026-11-28"
    assert run_date({"dag_run": SimpleNamespace(run_after=late)}) == "2026-11-30"  # REST logical_date: null, Assets


class FakeComms:
    """The task runner's channel to its supervisor: answers GetDagRunState as the API server would."""

    def __init__(self, runs: dict[tuple[str, str], str], status: int = 404) -> None:
        self.runs, self.status, self.asked = runs, status, []

    def send(self, msg):
        from airflow.sdk.exceptions import AirflowRuntimeError, ErrorType
        from airflow.sdk.execution_time.comms import DagRunStateResult, ErrorResponse

        self.asked.append((msg.dag_id, msg.run_id))
        if (msg.dag_id, msg.run_id) in self.runs:
            return DagRunStateResult(state=self.runs[(msg.dag_id, msg.run_id)])
        raise AirflowRuntimeError(
            ErrorResponse(error=ErrorType.API_SERVER_ERROR, detail={"status_code": self.status, "message": "no"})
        )


@pytest.mark.parametrize(
    "runs,status,expected",
    [
        ({("nightly", "r1"): "running"}, 404, "running"),
        ({("nightly", "r1"): "failed"}, 404, "failed"),
        ({("nightly", "r1"): "success"}, 404, "success"),
        ({}, 404, "absent"),  # deleted: its claim may go
        ({}, 503, None),  # Airflow cannot say: the lease's expiry decides
    ],
)
def test_the_lease_asks_airflow_for_the_holders_run_state(
    monkeypatch: pytest.MonkeyPatch, runs: dict, status: int, expected: str | None
) -> None:
    from airflow.sdk.execution_time import task_runner

    from trainyard.airflow.tasks import dagrun_state

    comms = FakeComms(runs, status)
    monkeypatch.setattr(task_runner, "SUPERVISOR_COMMS", comms, raising=False)
    assert dagrun_state("nightly", "r1") == expected
    assert comms.asked == [("nightly", "r1")]
