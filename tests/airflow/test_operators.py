"""The train operator picks its backend from the spec, and can always be killed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainyard.airflow.operators import TrainOperator, launcher_for
from trainyard.backends.kubernetes.launcher import KubernetesLauncher
from trainyard.backends.local.launcher import LocalLauncher
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
    op = TrainOperator(task_id="train", spec="unused.yaml", run_file="unused/spec.json")
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


def test_the_attempt_triggers_event_is_read_back_typed_in_one_place() -> None:
    from trainyard.airflow.triggers import KubernetesAttemptTrigger
    from trainyard.backends.base import AttemptStatus, NodeStatus
    from trainyard.recovery.deferred import AttemptWatch
    from trainyard.recovery.look import reported
    from trainyard.recovery.observations import Reported

    trigger = KubernetesAttemptTrigger(AttemptWatch(3, 0.0, {"namespace": "ml", "name": "j"}, ["a", "b"], 2, "", 10))
    status = AttemptStatus([NodeStatus("a", "running"), NodeStatus("b", "failed", 137, reason="OOMKilled")])
    payload = json.loads(json.dumps(trigger._event("hang", status, "no progress", ["a"]).payload))
    assert reported(payload) == Reported("hang", "no progress", 3, status.nodes, ["a"])
    assert reported({"status": "error", "message": "503"}) == Reported("error", "503")  # a trigger not told its attempt
    with pytest.raises(ValueError, match="status 'exploded' is not one of"):
        reported({"status": "exploded"})


def test_a_watch_travels_as_json() -> None:
    from trainyard.recovery.deferred import AttemptWatch

    watch = AttemptWatch(
        2, 1700000000.5, {"namespace": "ml", "name": "job-a2"}, ["gpu-a", "gpu-b"], 2, "/hot/attempt-2/heartbeat", 40
    )
    assert AttemptWatch.from_json(json.loads(json.dumps(watch.to_json()))) == watch


def test_a_backoff_waits_on_a_time_trigger_at_most_until_the_next_wake() -> None:
    """Each wake renews the run's lease on its lineage, so an hour's backoff is cut into ``wake_every_s`` waits."""
    import datetime as dt
    from types import SimpleNamespace

    from airflow.providers.standard.triggers.temporal import DateTimeTrigger

    from trainyard.airflow.operators import backoff_trigger
    from trainyard.recovery.deferred import Backoff

    nodes = NodesSpec(count=2, backend="kubernetes", kubernetes={"image": "trainer:1", "wake_every_s": 60})
    run = SimpleNamespace(spec=SimpleNamespace(nodes=nodes))
    far, near = (
        backoff_trigger(run, Backoff(10_000.0), now=1_000.0),
        backoff_trigger(run, Backoff(1_030.0), now=1_000.0),
    )
    assert isinstance(far, DateTimeTrigger) and far.moment == dt.datetime.fromtimestamp(1_060.0, tz=dt.UTC)
    assert near.moment == dt.datetime.fromtimestamp(1_030.0, tz=dt.UTC)


def test_the_kubernetes_trigger_judges_a_first_beat_by_the_specs_startup_grace(tmp_path: Path) -> None:
    """``training.startup_grace_s: 600`` reaches the trigger a deferred Kubernetes task waits on, in the watch the
    deferred driver hands it (``trigger_for`` adds nothing): a rank that has not beaten 200 s after the start (its
    peer has) is within the grace, not hung. The constant (120 s) would call it hung."""
    import asyncio
    import time
    from dataclasses import replace
    from types import SimpleNamespace

    from trainyard.airflow.operators import trigger_for
    from trainyard.backends.base import AttemptStatus, NodeStatus
    from trainyard.protocol.heartbeat import write_beat
    from trainyard.recovery.deferred import AttemptWatch
    from trainyard.spec import TrainingSpec

    hb = tmp_path / "hb"
    (hb / "gpu-a").mkdir(parents=True)
    write_beat(
        hb / "gpu-a",
        0,
        {"rank": 0, "node": "gpu-a", "host": "gpu-a", "step": 3, "time": time.time(), "status": "running"},
    )
    (hb / "gpu-a" / "rank-0.alive").touch()
    nodes = NodesSpec(count=2, backend="kubernetes", kubernetes={"image": "trainer:1"})
    training = TrainingSpec(
        max_steps=10, global_batch=4, micro_batch=2, checkpoint_every=5, heartbeat_timeout_s=10, startup_grace_s=600
    )
    run = SimpleNamespace(spec=SimpleNamespace(nodes=nodes, training=training), checkpoint_root=tmp_path / "ckpt")
    watch = AttemptWatch.from_json(
        {"attempt": 1, "started": time.time() - 200, "handle": {"namespace": "ml", "name": "j"}, "nodes": ["gpu-a", "gpu-b"],
         "world_size": 2, "heartbeat_dir": str(hb), "target_step": 10,
         "heartbeat_timeout_s": training.heartbeat_timeout_s, "startup_grace_s": training.startup_grace_s}
    )  # fmt: skip
    trigger = trigger_for(run, watch)
    assert trigger.watch == watch
    running = AttemptStatus([NodeStatus(n, "running", host=n) for n in ("gpu-a", "gpu-b")])
    assert asyncio.run(trigger.hang(running)) is None
    hung = asyncio.run(trigger_for(run, replace(watch, startup_grace_s=100.0)).hang(running))
    assert hung is not None and "no first heartbeat 100 s after the start from rank-1" in hung.reason, hung


def test_any_deferring_backend_sets_how_often_the_task_wakes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wake comes from the backend (``Backend.wake_every_s``), not from ``nodes.kubernetes``: a backend that
    defers cuts a backoff to its wake and stretches the run's lease past two of them; one that does not, neither."""
    import datetime as dt
    from types import SimpleNamespace

    from trainyard.airflow.operators import backoff_trigger
    from trainyard.backends import registry
    from trainyard.pipeline.lineage import lease_ttl
    from trainyard.recovery.deferred import Backoff

    run = SimpleNamespace(spec=SimpleNamespace(nodes=NodesSpec(count=2)))
    blocking = backoff_trigger(run, Backoff(10_000.0), now=1_000.0).moment
    assert blocking == dt.datetime.fromtimestamp(10_000.0, tz=dt.UTC)
    deferring = SimpleNamespace(defers=True, wake_every_s=2_000.0, trigger=None)
    monkeypatch.setitem(registry.BACKENDS, "local", lambda nodes, client, connect: deferring)
    assert backoff_trigger(run, Backoff(10_000.0), now=1_000.0).moment == dt.datetime.fromtimestamp(3_000.0, tz=dt.UTC)
    assert lease_ttl(run) == 2 * 2_000.0 + 60
