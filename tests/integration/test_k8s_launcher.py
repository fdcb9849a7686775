"""The Kubernetes launcher, burn-in marks and trigger against an API server over HTTP.

The server (``fake_k8s.FakeKube``) is in-memory; the clients are the real
ones (``kubernetes`` for the launcher, ``kubernetes_asyncio`` through the
provider's ``AsyncKubernetesHook`` for the trigger), so requests, bodies,
content types and error codes cross a socket as they would to a cluster. The
test plays the Job controller and the kubelet by setting pod states.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from airflow_helpers import wait_until
from fake_k8s import HOSTNAME, NOW, Call, FakeKube, Kubelet, Scheduler, claim_path, container_env
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from trainyard.airflow.triggers import KubernetesAttemptTrigger
from trainyard.backends.base import LaunchPlan, NodeStatus
from trainyard.backends.kubernetes.cooldown import due_for_retest
from trainyard.backends.kubernetes.kinds import node_kinds
from trainyard.backends.kubernetes.launcher import KubernetesHandle, KubernetesLauncher
from trainyard.backends.kubernetes.marks import evicted_nodes, label_evicted, unlabel
from trainyard.backends.kubernetes.objects import build_objects
from trainyard.backends.kubernetes.paths import hot_mount_path
from trainyard.backends.kubernetes.probes import create_burnin_pods, delete_burnin_pods
from trainyard.burnin.kubernetes import build_burnin_pod
from trainyard.protocol.env import TrainEnv
from trainyard.protocol.records import FailureRecord, write_record
from trainyard.recovery.classify import classify
from trainyard.recovery.deferred import AttemptWatch
from trainyard.recovery.watch import failed
from trainyard.spec import KubernetesSpec, PressureTestSpec

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
NS = "trainyard"
BATCH, CORE, VOLCANO = "apis/batch/v1", "api/v1", "apis/scheduling.volcano.sh/v1beta1"
SPEC = KubernetesSpec(
    image="registry.local/trainer:1", namespace=NS, scheduler="volcano", gpus=1, hot_pvc="trainyard-hot"
)
DEFAULT = KubernetesSpec(image="registry.local/trainer:1", namespace=NS)


@pytest.fixture
def fake() -> Iterator[FakeKube]:
    server = FakeKube().start()
    yield server
    server.stop()


def make_plan(tmp_path: Path, nodes: int = 2, attempt: int = 1) -> LaunchPlan:
    home = tmp_path / "home"
    return LaunchPlan(
        run_id="manual__2026-03-01T02:00:00+00:00",
        attempt=attempt,
        nodes=[f"k8s-{i}" for i in range(nodes)],  # hosts: the pods are pinned to them
        procs_per_node=1,
        entrypoint="trainyard.workload",
        args=["--lr", "0.01"],
        train_env=TrainEnv(
            data_dir=home / "hot" / "tokens",
            checkpoint_dir=home / "checkpoints" / "p",
            max_steps=10,
            events_dir=home / "runs" / "p" / "r" / "events.d",
            attempt=attempt,
        ),
        log_dir=home / "runs" / "p" / "r" / f"attempt-{attempt}",
    )


def host(pods: list[str], i: int) -> str:
    """Where the scheduler put pod ``i``: any host of the pinned set, here the reverse of the index order."""
    return f"k8s-{len(pods) - 1 - i}"


def running(fake: FakeKube, pods: list[str]) -> None:
    for i, name in enumerate(pods):
        fake.set_pod(NS, name, "Running", node=host(pods, i), state={"running": {"startedAt": "2026-03-01T02:00:05Z"}})


def succeed(fake: FakeKube, pods: list[str]) -> None:
    for i, name in enumerate(pods):
        fake.set_pod(
            NS,
            name,
            "Succeeded",
            node=host(pods, i),
            log=f"rank {i} done\n",
            state={"terminated": {"exitCode": 0, "reason": "Completed"}},
        )


def wire(obj: Any) -> Any:
    return json.loads(json.dumps(client.ApiClient().sanitize_for_serialization(obj)))


# ---------------------------------------------------------------- launcher


def test_launch_creates_podgroup_service_and_job_with_the_built_bodies(fake: FakeKube, tmp_path: Path) -> None:
    plan = make_plan(tmp_path, nodes=3)
    handle = KubernetesLauncher(fake.client(), SPEC).launch(plan)
    expected = build_objects(plan, SPEC)
    assert handle.name == expected.name
    # What arrived over HTTP is what the builders made (the server only adds its own metadata).
    job = fake.get(BATCH, "jobs", NS, handle.name)
    assert job is not None and job["spec"] == wire(expected.job)["spec"]
    service = fake.get(CORE, "services", NS, handle.name)
    assert service is not None and service["spec"] == wire(expected.service)["spec"]
    group = fake.get(VOLCANO, "podgroups", NS, handle.name)
    assert group is not None and group["spec"]["minMember"] == 3
    # Gang first, the Job last: its pods must find their PodGroup and DNS name.
    assert [c.resource for c in fake.calls if c.verb == "create"] == ["podgroups", "services", "jobs"]


def test_launch_makes_what_the_pods_mount_before_the_job(fake: FakeKube, tmp_path: Path) -> None:
    # The kubelet would make a missing subPath as root: the pods could not write it.
    plan = make_plan(tmp_path)
    KubernetesLauncher(fake.client(), SPEC).launch(plan)
    assert Path(plan.env["TRAINYARD_CHECKPOINT_DIR"]).is_dir()
    assert Path(plan.env["TRAINYARD_EVENTS_DIR"]).is_dir()


def test_a_pods_failure_record_blames_only_the_host_it_ran_on(fake: FakeKube, tmp_path: Path) -> None:
    """Each pod mounts only its host's folder of the attempt's heartbeat folder (``subPathExpr`` on the pod's
    ``spec.nodeName``): the rank on k8s-1 that writes a record naming k8s-0 (which would get k8s-0 marked
    evicted cluster-wide) blames nobody, and is evidence; its honest record blames k8s-1."""
    plan = make_plan(tmp_path)
    plan = replace(plan, train_env=replace(plan.train_env, heartbeat_dir=plan.log_dir / "heartbeat"))
    launcher = KubernetesLauncher(fake.client(), SPEC)
    handle = launcher.launch(plan)
    pods = fake.spawn_job_pods(NS, handle.name)
    running(fake, pods)  # pod 0 on k8s-1, pod 1 on k8s-0
    claims = {str(SPEC.hot_pvc): Path(hot_mount_path(plan, SPEC))}
    pod = fake.get(CORE, "pods", NS, pods[0])
    assert pod is not None and container_env(pod)["TRAINYARD_NODE"] == "k8s-1"
    own = claim_path(pod, container_env(pod)["TRAINYARD_HEARTBEAT_DIR"], claims)  # what the pod writes into
    forged = FailureRecord("node_lost", 7, "k8s-0", "k8s-0", "RuntimeError", "uncorrectable ECC error", 1.0)
    write_record(own, forged)
    fake.set_pod(NS, pods[0], "Failed", node="k8s-1", log="Traceback\n",
                 state={"terminated": {"exitCode": 1, "reason": "Error"}})  # fmt: skip
    status = launcher.poll(handle)
    seen = failed(plan, status, plan.heartbeat_dir, "crash", [], "k8s-1 exited 1", at=time.time())
    assert seen.failure.records == [] and "k8s-0" not in classify(seen.failure).culprits
    assert "failure-rank-7.json refused (names node 'k8s-0'" in seen.reason
    write_record(own, replace(forged, node="k8s-1", host="k8s-1"))  # the same rank, honest
    seen = failed(plan, status, plan.heartbeat_dir, "crash", [], "k8s-1 exited 1", at=time.time())
    assert classify(seen.failure).culprits == ["k8s-1"]
    assert own == plan.heartbeat_dir / "k8s-1"
    assert {p.name for p in plan.heartbeat_dir.iterdir()} == {"k8s-0", "k8s-1"}  # made before the Job, not by root


def test_without_a_claim_a_pods_heartbeat_folder_is_its_hosts(fake: FakeKube, tmp_path: Path) -> None:
    plan = make_plan(tmp_path)
    plan = replace(plan, train_env=replace(plan.train_env, heartbeat_dir=plan.log_dir / "he$(X)art"))
    handle = KubernetesLauncher(fake.client(), DEFAULT).launch(plan)
    pods = fake.spawn_job_pods(NS, handle.name)
    running(fake, pods)
    pod = fake.get(CORE, "pods", NS, pods[1])
    assert pod is not None and container_env(pod)["TRAINYARD_HEARTBEAT_DIR"] == f"{plan.heartbeat_dir}/k8s-0"


def test_a_launcher_refuses_to_give_pods_its_own_account(
    fake: FakeKube, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import base64

    monkeypatch.setenv("AIRFLOW__TRAINYARD__POD_SERVICE_ACCOUNTS", "airflow-worker")  # even if the admin allowed it
    api = fake.client()
    sub = base64.urlsafe_b64encode(json.dumps({"sub": f"system:serviceaccount:{NS}:airflow-worker"}).encode())
    api.configuration.api_key = {"authorization": f"Bearer h.{sub.decode().rstrip('=')}.s"}
    spec = KubernetesSpec(image="registry.local/trainer:1", namespace=NS, service_account="airflow-worker")
    with pytest.raises(ValueError, match="'airflow-worker' is the launcher's own account"):
        KubernetesLauncher(api, spec).launch(make_plan(tmp_path))
    assert fake.items("apis/batch/v1", "jobs", NS) == []


def test_poll_reports_running_then_succeeded_and_keeps_each_pods_log(fake: FakeKube, tmp_path: Path) -> None:
    plan = make_plan(tmp_path)
    launcher = KubernetesLauncher(fake.client(), DEFAULT)
    handle = launcher.launch(plan)
    # No pods yet (the scheduler is placing them): pending counts as running, under the plan's names.
    assert launcher.poll(handle).nodes == [NodeStatus("k8s-0", "running"), NodeStatus("k8s-1", "running")]
    pods = fake.spawn_job_pods(NS, handle.name)
    running(fake, pods)
    status = launcher.poll(handle)
    # Slots in index order, hosts where the pods landed.
    assert status.state == "running" and [(n.slot, n.host) for n in status.nodes] == [
        ("k8s-0", "k8s-1"),
        ("k8s-1", "k8s-0"),
    ]
    succeed(fake, pods)
    status = launcher.poll(handle)
    assert status.state == "succeeded"
    assert [(n.host, n.exit_code) for n in status.nodes] == [("k8s-1", 0), ("k8s-0", 0)]
    for i, node in enumerate(status.nodes):
        text = Path(node.log).read_text()
        assert Path(node.log).parent == plan.log_dir and text.endswith(f"rank {i} done\n")
    # Logs are fetched once, not on every poll.
    reads = sum(c.resource == "pods/log" for c in fake.calls)
    assert launcher.poll(handle) == status and sum(c.resource == "pods/log" for c in fake.calls) == reads == 2


def test_evicted_and_oom_killed_pods_fail_with_reason_and_exit_code(fake: FakeKube, tmp_path: Path) -> None:
    launcher = KubernetesLauncher(fake.client(), DEFAULT)
    handle = launcher.launch(make_plan(tmp_path, nodes=3))
    pods = fake.spawn_job_pods(NS, handle.name)
    running(fake, pods)
    fake.set_pod(NS, pods[0], "Failed", node="k8s-2", reason="Evicted", message="The node was low on resource: memory.")
    fake.set_pod(
        NS,
        pods[1],
        "Failed",
        node="k8s-1",
        log="torch.OutOfMemoryError\n",
        state={"terminated": {"exitCode": 137, "reason": "OOMKilled"}},
    )
    status = launcher.poll(handle)
    assert status.state == "failed"
    evicted, oom, alive = status.nodes
    assert (evicted.host, evicted.state, evicted.exit_code, evicted.reason) == ("k8s-2", "failed", None, "Evicted")
    assert (oom.host, oom.state, oom.exit_code, oom.reason) == ("k8s-1", "failed", 137, "OOMKilled")
    assert alive == NodeStatus("k8s-2", "running", host="k8s-0")
    # The evidence the supervisor tails: the pod's verdict, and the log where there is one.
    evidence = Path(evicted.log).read_text()
    assert (
        "reason=Evicted" in evidence and "low on resource: memory" in evidence and "no container log: 400" in evidence
    )
    assert Path(oom.log).read_text().splitlines()[-1] == "torch.OutOfMemoryError"


def test_image_pull_backoff_fails_now_and_a_deleted_job_fails_the_rest(fake: FakeKube, tmp_path: Path) -> None:
    launcher = KubernetesLauncher(fake.client(), DEFAULT)
    handle = launcher.launch(make_plan(tmp_path))
    pods = fake.spawn_job_pods(NS, handle.name)
    fake.set_pod(NS, pods[0], "Pending", node="k8s-1", state={"waiting": {"reason": "ImagePullBackOff"}})
    assert launcher.poll(handle).failed() == [
        NodeStatus("k8s-0", "failed", None, launcher.poll(handle).nodes[0].log, "ImagePullBackOff", host="k8s-1")
    ]
    other = launcher.launch(make_plan(tmp_path, attempt=2))
    fake.objects.pop((BATCH, "jobs", NS, other.name))  # someone ran kubectl delete job --cascade=orphan
    assert {n.reason for n in launcher.poll(other).nodes} == {"JobDeleted"}


def test_cancel_deletes_everything_and_is_idempotent(fake: FakeKube, tmp_path: Path) -> None:
    launcher = KubernetesLauncher(fake.client(), SPEC)
    handle = launcher.launch(make_plan(tmp_path))
    running(fake, fake.spawn_job_pods(NS, handle.name))
    assert launcher.active == [handle]
    launcher.cancel(handle)
    assert fake.get(BATCH, "jobs", NS, handle.name) is None
    assert fake.get(CORE, "services", NS, handle.name) is None
    assert fake.get(VOLCANO, "podgroups", NS, handle.name) is None
    assert fake.items(CORE, "pods", NS) == []  # gone with their Job
    (job_delete,) = [d for d in fake.deletes if d[0] == "jobs"]
    assert job_delete[2]["propagationPolicy"] == "Foreground"
    launcher.cancel(handle)  # every object answers 404 now; that is fine
    launcher.cancel_all()
    assert launcher.active == []
    assert sum(c.verb == "delete" for c in fake.calls) == 6


def test_a_failed_launch_leaves_nothing_behind_and_a_repeated_one_adopts(fake: FakeKube, tmp_path: Path) -> None:
    plan = make_plan(tmp_path)
    launcher = KubernetesLauncher(fake.client(), SPEC)
    original = fake._create

    def refuse_jobs(prefix: str, resource: str, ns: str, data: Any) -> tuple[int, Any]:
        if resource == "jobs":
            return 403, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden", "code": 403}
        return original(prefix, resource, ns, data)

    fake._create = refuse_jobs  # type: ignore[method-assign]
    with pytest.raises(ApiException) as err:
        launcher.launch(plan)
    assert err.value.status == 403
    assert fake.objects == {} and launcher.active == []  # the PodGroup and Service made before are deleted
    fake._create = original  # type: ignore[method-assign]
    first = launcher.launch(plan)
    again = launcher.launch(plan)  # 409 on all three: the same plan's objects, adopted
    assert again.name == first.name and len(fake.items(BATCH, "jobs", NS)) == 1


# ---------------------------------------------------------------- placement


@pytest.mark.parametrize("seed", range(8))
def test_pods_land_only_on_the_plans_hosts_of_a_bigger_cluster(fake: FakeKube, tmp_path: Path, seed: int) -> None:
    """The scheduler may put a pod on any node its affinity allows: with more nodes than the plan, only the
    pinning keeps the pods on the hosts the pressure test passed."""
    for i in range(6):
        fake.add_node(f"k8s-{i}")
    plan = LaunchPlan(**{**make_plan(tmp_path, nodes=2).__dict__, "nodes": ["k8s-4", "k8s-1"]})
    handle = KubernetesLauncher(fake.client(), DEFAULT).launch(plan)
    pods = fake.spawn_job_pods(NS, handle.name)
    scheduler = Scheduler(fake, NS, seed)
    scheduler.run_once(everyone=True)
    assert set(scheduler.placed) == set(pods)
    assert sorted(scheduler.placed.values()) == ["k8s-1", "k8s-4"]  # both hosts, one pod each


def test_a_pod_no_host_takes_fails_the_attempt_with_the_schedulers_words(fake: FakeKube, tmp_path: Path) -> None:
    fake.add_node("k8s-0")
    fake.add_node("k8s-1", labels={DEFAULT.evicted_label: "true"})  # marked since the plan was made
    fake.add_node("k8s-2")
    launcher = KubernetesLauncher(fake.client(), DEFAULT)
    plan = make_plan(tmp_path, nodes=2)
    handle = launcher.launch(plan)
    pods = fake.spawn_job_pods(NS, handle.name)
    Scheduler(fake, NS, 0).run_once(everyone=True)
    status = launcher.poll(handle)
    assert status.state == "failed"  # not pending for ever
    (stuck,) = status.failed()
    assert (stuck.reason, stuck.host) == ("Unschedulable", "")
    evidence = Path(stuck.log).read_text()
    assert "not placed" in evidence and "0/3 nodes are available" in evidence, evidence
    assert "didn't match Pod's node affinity/selector" in evidence
    event = first_event(
        KubernetesAttemptTrigger(watching(handle.name, plan.nodes, poll_s=0.05), kubeconfig(tmp_path, fake.url))
    )
    assert event["status"] == "failed" and "Unschedulable" in event["message"]
    assert len(pods) == 2


def test_a_crash_of_the_fake_kubelet_fails_the_test_that_used_it(
    fake: FakeKube, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dead kubelet starts no pod, and the test using it would fail minutes later for another reason (an
    attempt that never beat): its crash is raised where the test leaves it."""
    kubelet = Kubelet(fake, NS)

    def broken(everyone: bool = False) -> None:
        raise KeyError("a pod went missing")

    monkeypatch.setattr(kubelet.scheduler, "run_once", broken)
    with pytest.raises(RuntimeError, match="fake kubelet's loop crashed") as err, kubelet:
        kubelet._thread.join(5)
    assert isinstance(err.value.__cause__, KeyError)


# ---------------------------------------------------------------- trigger


def kubeconfig(tmp_path: Path, url: str) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "fake",
                "clusters": [{"name": "fake", "cluster": {"server": url}}],
                "users": [{"name": "fake", "user": {"token": "t"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": NS}}],
            }
        )
    )
    return str(path)


def watching(name: str, nodes: list[str], poll_s: float = 5.0, wake_s: float = 300.0, **handle: Any) -> AttemptWatch:
    """The watch a deferred task hands the trigger, of attempt 1's Job ``name`` (no heartbeats in sight)."""
    return AttemptWatch(1, 0.0, {"namespace": NS, "name": name, "poll_s": poll_s, **handle}, list(nodes), len(nodes),
                        "", 0, wake_s=wake_s)  # fmt: skip


def first_event(trigger: KubernetesAttemptTrigger) -> dict[str, Any]:
    async def wait() -> dict[str, Any]:
        async for event in trigger.run():
            return event.payload
        raise AssertionError("the trigger ended without an event")

    return asyncio.run(asyncio.wait_for(wait(), timeout=10))


def test_trigger_fires_once_the_attempt_ends_with_the_launchers_records(fake: FakeKube, tmp_path: Path) -> None:
    launcher = KubernetesLauncher(fake.client(), DEFAULT)
    plan = make_plan(tmp_path)
    handle = launcher.launch(plan)
    pods = fake.spawn_job_pods(NS, handle.name)
    running(fake, pods)
    trigger = KubernetesAttemptTrigger(watching(handle.name, plan.nodes, poll_s=0.05), kubeconfig(tmp_path, fake.url))

    # The pods finish once the trigger has polled them running a few times: it waited for the end.
    def jobs_read() -> int:
        return sum(1 for c in fake.calls if (c.verb, c.resource) == ("get", "jobs"))

    def succeed_once_polled() -> None:
        wait_until(lambda: jobs_read() >= 3, 10, "the trigger to poll the running pods", every_s=0.02)
        succeed(fake, pods)

    fake.calls.clear()
    threading.Thread(target=succeed_once_polled, daemon=True).start()
    event = first_event(trigger)
    assert jobs_read() >= 3  # it polled the running pods and waited on rather than firing
    assert event["status"] == "succeeded" and (event["namespace"], event["job_name"]) == (NS, handle.name)
    expected = [{**n.__dict__, "log": ""} for n in launcher.poll(handle).nodes]
    assert event["nodes"] == expected
    assert json.loads(json.dumps(event)) == event


def test_trigger_reports_a_failed_node_and_times_out_and_gives_up_on_an_unreachable_api(
    fake: FakeKube,
    tmp_path: Path,
) -> None:
    launcher = KubernetesLauncher(fake.client(), DEFAULT)
    handle = launcher.launch(make_plan(tmp_path))
    pods = fake.spawn_job_pods(NS, handle.name)
    running(fake, pods)
    config = kubeconfig(tmp_path, fake.url)
    waiting = first_event(
        KubernetesAttemptTrigger(watching(handle.name, ["k8s-0", "k8s-1"], poll_s=0.05, wake_s=0.2), config)
    )
    assert waiting["status"] == "timeout" and {n["state"] for n in waiting["nodes"]} == {"running"}
    fake.set_pod(NS, pods[1], "Failed", node="k8s-0", state={"terminated": {"exitCode": 137, "reason": "OOMKilled"}})
    failed = first_event(KubernetesAttemptTrigger(watching(handle.name, ["k8s-0", "k8s-1"], poll_s=0.05), config))
    assert failed["status"] == "failed" and failed["message"] == "k8s-0: OOMKilled"  # the host, not the slot
    assert failed["nodes"][1] == {
        "slot": "k8s-1",
        "host": "k8s-0",
        "state": "failed",
        "exit_code": 137,
        "log": "",
        "reason": "OOMKilled",
    }
    gone = kubeconfig(tmp_path, "http://127.0.0.1:9")  # nothing listens on the discard port
    error = first_event(KubernetesAttemptTrigger(watching(handle.name, ["k8s-0"], poll_s=0.01), gone, max_api_errors=2))
    assert error["status"] == "error" and error["nodes"] == [] and "unreachable" in error["message"]


def pod_calls(fake: FakeKube, verb: str) -> int:
    return sum(1 for c in fake.calls if (c.verb, c.resource) == (verb, "pods"))


def test_the_trigger_lists_the_pods_once_then_watches_and_wakes_on_a_failed_pod(fake: FakeKube, tmp_path: Path) -> None:
    """Polls read the watched pods, not a list of them all; a pod that fails wakes the trigger before its
    next poll."""
    launcher = KubernetesLauncher(fake.client(), DEFAULT)
    plan = make_plan(tmp_path, nodes=8)
    handle = launcher.launch(plan)
    pods = fake.spawn_job_pods(NS, handle.name)
    running(fake, pods)
    config = kubeconfig(tmp_path, fake.url)
    quiet = first_event(KubernetesAttemptTrigger(watching(handle.name, plan.nodes, poll_s=0.05, wake_s=1.0), config))
    assert quiet["status"] == "timeout" and {n["state"] for n in quiet["nodes"]} == {"running"}
    jobs_read = sum(1 for c in fake.calls if (c.verb, c.resource) == ("get", "jobs"))
    assert jobs_read >= 10, "it polled"  # one small read a poll: why the Job failed, beyond its pods
    assert (pod_calls(fake, "list"), pod_calls(fake, "watch")) == (1, 1), fake.calls

    fake.calls.clear()

    def fails_once_watched() -> None:
        wait_until(lambda: pod_calls(fake, "watch") > 0, 10, "the trigger to watch the pods", every_s=0.02)
        fake.set_pod(
            NS, pods[3], "Failed", node="k8s-4", state={"terminated": {"exitCode": 137, "reason": "OOMKilled"}}
        )

    threading.Thread(target=fails_once_watched, daemon=True).start()
    # Woken by the watch, not by the next poll: that is 30 s away, past ``first_event``'s 10 s bound.
    failed = first_event(KubernetesAttemptTrigger(watching(handle.name, plan.nodes, poll_s=30.0), config))
    assert failed["status"] == "failed" and failed["message"] == "k8s-4: OOMKilled"
    assert (pod_calls(fake, "list"), pod_calls(fake, "watch")) == (1, 1)


def test_a_watch_ended_by_the_server_goes_on_and_one_from_a_forgotten_version_lists_again(
    fake: FakeKube, tmp_path: Path
) -> None:
    launcher = KubernetesLauncher(fake.client(), DEFAULT)
    plan = make_plan(tmp_path, nodes=3)
    handle = launcher.launch(plan)
    pods = fake.spawn_job_pods(NS, handle.name)
    running(fake, pods)
    trigger = KubernetesAttemptTrigger(watching(handle.name, plan.nodes, poll_s=0.05), kubeconfig(tmp_path, fake.url))

    def watches(n: int) -> None:
        wait_until(lambda: pod_calls(fake, "watch") >= n, 10, f"the trigger's watch number {n}", every_s=0.02)

    def server_side() -> None:
        watches(1)
        fake.end_watches()  # its timeout: the trigger watches again from where it was
        watches(2)
        with fake.lock:  # at once, so the open watch cannot pass the change on: the trigger's version is older
            fake.end_watches()
            fake.set_pod(NS, pods[0], "Running", node="k8s-2", state={"running": {"startedAt": NOW}})
            fake.compact()  # the next watch is from a version the server forgot: 410 Gone, a list, a watch
        watches(4)
        succeed(fake, pods)

    changes = threading.Thread(target=server_side)
    changes.start()
    event = first_event(trigger)
    changes.join()
    assert event["status"] == "succeeded"
    assert pod_calls(fake, "list") == 2 and pod_calls(fake, "watch") == 4, fake.calls


def test_without_leave_to_watch_the_trigger_lists_every_poll_and_says_why(
    fake: FakeKube, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Role from before the watch (list, no watch): the trigger still works, as it did, and warns once."""
    launcher = KubernetesLauncher(fake.client(), DEFAULT)
    plan = make_plan(tmp_path)
    handle = launcher.launch(plan)
    pods = fake.spawn_job_pods(NS, handle.name)
    running(fake, pods)
    fake.forbidden.add(("watch", "pods"))
    threading.Timer(0.5, succeed, (fake, pods)).start()
    event = first_event(
        KubernetesAttemptTrigger(watching(handle.name, plan.nodes, poll_s=0.05), kubeconfig(tmp_path, fake.url))
    )
    assert event["status"] == "succeeded"
    assert pod_calls(fake, "list") >= 5 and capsys.readouterr().out.count("may not watch pods") == 1


def test_a_user_kill_of_the_deferred_task_deletes_the_attempt_from_the_triggerer(
    fake: FakeKube, tmp_path: Path
) -> None:
    launcher = KubernetesLauncher(fake.client(), SPEC)  # volcano: a PodGroup too
    handle = launcher.launch(make_plan(tmp_path))
    running(fake, fake.spawn_job_pods(NS, handle.name))
    trigger = KubernetesAttemptTrigger(
        watching(handle.name, ["k8s-0", "k8s-1"], podgroup=True), kubeconfig(tmp_path, fake.url)
    )
    asyncio.run(trigger.on_kill())
    assert fake.items(BATCH, "jobs", NS) == [] and fake.items(CORE, "services", NS) == []
    assert fake.items(VOLCANO, "podgroups", NS) == [] and fake.items(CORE, "pods", NS) == []
    assert ("jobs", handle.name, {"propagationPolicy": "Foreground"}) in [
        (r, n, {k: v for k, v in o.items() if k == "propagationPolicy"}) for r, n, o in fake.deletes
    ]
    asyncio.run(trigger.on_kill())  # twice: everything already gone is fine


# ---------------------------------------------------------------- burn-in pods and node marks


def test_burnin_pods_are_created_and_deleted(fake: FakeKube) -> None:
    core = client.CoreV1Api(fake.client())
    schedule = SimpleNamespace(slot_s=2.0, collective_s=3.0)
    pods = [
        build_burnin_pod(
            node,
            run_id="r1",
            store="10.0.0.5:41000",
            schedule=schedule,
            cfg=PressureTestSpec(),
            spec=DEFAULT,
            scratch="/mnt/scratch",
            timeout_s=20.0,
            key="ab" * 32,
        )
        for node in ("k8s-0", "k8s-1")
    ]
    names = create_burnin_pods(core, pods)
    assert create_burnin_pods(core, pods) == names  # this try's pods exist already: kept, no error
    stored = fake.get(CORE, "pods", NS, names[1])
    assert stored is not None and stored["spec"]["containers"][0]["args"][:2] == ["--node", "k8s-1"]
    delete_burnin_pods(core, NS, names)
    delete_burnin_pods(core, NS, names)
    assert fake.items(CORE, "pods", NS) == []


def test_evicted_nodes_are_labelled_or_tainted_and_cleared(fake: FakeKube) -> None:
    core = client.CoreV1Api(fake.client())
    other_taint = {"key": "gpu-maintenance", "value": "x", "effect": "NoExecute"}
    fake.add_node("k8s-0")
    fake.add_node("k8s-1", labels={"zone": "a"}, taints=[other_taint])
    label = "trainyard.io/evicted"
    assert label_evicted(core, ["k8s-0", "gone"], label) == ["k8s-0"]  # a vanished node is skipped
    assert fake.get(CORE, "nodes", "", "k8s-0")["metadata"]["labels"] == {HOSTNAME: "k8s-0", label: "true"}
    assert label_evicted(core, ["k8s-1"], label, mode="taint") == ["k8s-1"]
    label_evicted(core, ["k8s-1"], label, mode="taint")  # twice: still one taint
    node = fake.get(CORE, "nodes", "", "k8s-1")
    assert node["metadata"]["labels"] == {HOSTNAME: "k8s-1", "zone": "a", label: "true"}
    assert node["spec"]["taints"] == [other_taint, {"key": label, "value": "true", "effect": "NoSchedule"}]
    assert evicted_nodes(core, label) == ["k8s-0", "k8s-1"]
    assert unlabel(core, ["k8s-0", "k8s-1"], label) == ["k8s-0", "k8s-1"]
    node = fake.get(CORE, "nodes", "", "k8s-1")
    assert node["metadata"]["labels"] == {HOSTNAME: "k8s-1", "zone": "a"} and node["spec"]["taints"] == [other_taint]
    assert evicted_nodes(core, label) == []


def test_a_taint_written_concurrently_is_not_lost(fake: FakeKube, monkeypatch: pytest.MonkeyPatch) -> None:
    core = client.CoreV1Api(fake.client())
    fake.add_node("k8s-0")
    read_node = core.read_node
    raced = []

    def read_then_race(name: str, **kwargs: Any) -> Any:
        node = read_node(name, **kwargs)
        if not raced:  # another controller adds its taint between our read and our write
            raced.append(True)
            fake.objects[(CORE, "nodes", "", name)]["spec"]["taints"] = [{"key": "other", "effect": "NoSchedule"}]
            fake.objects[(CORE, "nodes", "", name)]["metadata"]["resourceVersion"] = "999"
        return node

    monkeypatch.setattr(core, "read_node", read_then_race)
    label_evicted(core, ["k8s-0"], "trainyard.io/evicted", mode="taint")
    assert [t["key"] for t in fake.get(CORE, "nodes", "", "k8s-0")["spec"]["taints"]] == [
        "other",
        "trainyard.io/evicted",
    ]


# ---------------------------------------------------------------- RBAC


def granted(name: str) -> set[Call]:
    out = set()
    for doc in yaml.safe_load_all((ROOT / "docker" / "k8s" / name).read_text()):
        if doc and doc["kind"] in ("Role", "ClusterRole"):
            for rule in doc["rules"]:
                out |= {
                    Call(v, g, r, doc["kind"] == "Role")
                    for g in rule["apiGroups"]
                    for r in rule["resources"]
                    for v in rule["verbs"]
                }
    return out


def test_rbac_grants_exactly_the_calls_trainyard_makes(fake: FakeKube, tmp_path: Path) -> None:
    """Every call of a full scenario is allowed by docker/k8s, and every grant there is used."""
    api = fake.client()
    core = client.CoreV1Api(api)
    launcher = KubernetesLauncher(api, SPEC)
    plan = make_plan(tmp_path)
    handle: KubernetesHandle = launcher.launch(plan)
    pods = fake.spawn_job_pods(NS, handle.name)
    running(fake, pods)

    def once_watched() -> None:  # the pods end while the trigger watches them: its list, then its watch
        wait_until(lambda: pod_calls(fake, "watch") > 0, 10, "the trigger to watch the pods", every_s=0.02)
        succeed(fake, pods)

    threading.Thread(target=once_watched, daemon=True).start()
    event = first_event(
        KubernetesAttemptTrigger(watching(handle.name, plan.nodes, poll_s=0.05), kubeconfig(tmp_path, fake.url))
    )
    assert event["status"] == "succeeded" and launcher.poll(handle).state == "succeeded"
    launcher.cancel(handle)
    # In place: the store's objects, the nodes' pods, one killed and one added, all deleted with the attempt.
    in_place = replace(
        make_plan(tmp_path, attempt=2),
        store_keys={"k8s-0": "a" * 64, "k8s-1": "b" * 64, "k8s-2": "c" * 64},
    )
    in_place = replace(in_place, train_env=replace(in_place.train_env, store=launcher.store_endpoint(in_place)))
    assert launcher.serve_store(in_place).endswith(":29500")
    regrouping = launcher.launch(in_place)
    launcher.kill_nodes(regrouping, ["k8s-1"])
    launcher.add_nodes(regrouping, ["k8s-2"])
    assert launcher.poll(regrouping).nodes[1].reason == "PodDeleted"
    launcher.cancel(regrouping)
    assert fake.items(CORE, "pods", NS) == [] and fake.items(CORE, "secrets", NS) == []
    burnin = build_burnin_pod(
        "k8s-0",
        run_id="r",
        store="10.0.0.5:1",
        schedule=SimpleNamespace(slot_s=1, collective_s=1),
        cfg=PressureTestSpec(),
        spec=SPEC,
        scratch="/mnt/s",
        timeout_s=5,
        key="ab" * 32,
    )
    delete_burnin_pods(core, NS, create_burnin_pods(core, [burnin]))
    fake.add_node("k8s-0")
    label_evicted(core, ["k8s-0"], SPEC.evicted_label, mode="taint", reasons={"k8s-0": "dead"})
    evicted_nodes(core, SPEC.evicted_label)
    due_for_retest(core, SPEC, 0.0, datetime.now(UTC))
    node_kinds(core, ["k8s-0"])
    unlabel(core, ["k8s-0"], SPEC.evicted_label)

    grants = granted("launcher-rbac.yaml") | granted("node-eviction-rbac.yaml")
    used = set(fake.calls)
    assert used - grants == set(), "calls the manifests do not allow"
    assert grants - used == set(), "grants nothing uses"


def test_only_a_pod_that_ends_wakes_the_trigger_before_its_poll() -> None:
    """Hundreds of pods starting are changes too: they wait for the next poll, not a status each."""
    trigger = KubernetesAttemptTrigger(watching("job", ["k8s-0"]))

    def pod(phase: str) -> client.V1Pod:
        return client.V1Pod(metadata=client.V1ObjectMeta(name="p"), status=client.V1PodStatus(phase=phase))

    for kind, phase, wakes in [
        ("ADDED", "Pending", False), ("MODIFIED", "Running", False), ("MODIFIED", "Failed", True),
        ("MODIFIED", "Succeeded", True), ("DELETED", "Running", True),
    ]:  # fmt: skip
        trigger._changed.clear()
        trigger._pod_changed(kind, pod(phase))
        assert trigger._changed.is_set() == wakes, (kind, phase)
