"""In-place recovery on the kubernetes backend, deferred, against the fake API server with real pod processes.

Each attempt has a coordinator pod serving its store (``trainyard.backends.store``) behind a ClusterIP
Service, and a bare pod per node pinned to its host; a warm spare's pod starts with the attempt. A pod dies
(its container killed) or a host goes (``Kubelet.lose_node``): the deferred task wakes on the trigger's
report, the survivors regroup with the spare as a joiner (the state broadcast to it), and the run finishes
in one attempt, losing at most one step. The driver is the one Airflow drives (``deferred_train``: a fresh
launcher, as a fresh process, at every wake).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from airflow_helpers import wait_until
from fake_k8s import FakeKube, Kubelet, airflow_connection
from test_k8s_training import NODES, NS, SEED, SPARE, deferred_train, run_with, train_events

from trainyard.checkpoint.format import read_manifest
from trainyard.pipeline import stages
from trainyard.pipeline.run import Run
from trainyard.protocol.heartbeat import read_heartbeats
from trainyard.recovery import deferred
from trainyard.recovery.figures import recovery_figures

pytestmark = pytest.mark.integration

NODE_ANNOTATION = "trainyard.io/node"
# No test here is about a hang: a heartbeat timeout far from these runs' pauses (a save, a joiner's state) on a
# machine whose cores other tests share, so a slow step is never taken for a hung node.
QUIET_S = 30
GROW_WAKE_S = 2.0  # a run below its size wakes this often to grow back (15 s in production)


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeKube]:
    server = FakeKube().start()
    for name in [*NODES, SPARE]:
        server.add_node(name)
    monkeypatch.setenv("AIRFLOW_CONN_FAKE_CLUSTER", airflow_connection(server, tmp_path, NS))
    yield server
    server.stop()


def in_place_run(tmp_path: Path) -> Run:
    # Without rejoin: the node left out would start again and wait for a wake to grow the world back.
    return run_with(tmp_path, "[]", in_place="true, rejoin: false", heartbeat_timeout_s=QUIET_S)


def training_pods(fake: FakeKube) -> dict[str, dict[str, Any]]:
    """The training pods by name (not the coordinator)."""
    return {
        p["metadata"]["name"]: p
        for p in fake.items("api/v1", "pods", NS)
        if NODE_ANNOTATION in p["metadata"].get("annotations", {})
    }


def trained_a_few_steps(run: Run) -> None:
    beats = run.dir / "attempt-1" / "heartbeat"
    wait_until(lambda: max((b.get("step", 0) for b in read_heartbeats(beats).values()), default=0) >= 3, 120,
               "attempt 1 to train a few steps", every_s=0.1)  # fmt: skip


def assert_healed_in_place(run: Run, result: Any, culprit: str, kind: str) -> None:
    """One attempt, a regroup with the spare as the joiner, the run whole at its last step, 0-1 steps lost."""
    (survivor,) = [n for n in NODES if n != culprit]
    [path] = train_events(run, "recovery_path")
    assert path["in_place"] is True and path["why_not"] == ""
    [classified] = train_events(run, "failure_classified")
    assert classified["kind"] == kind and classified["culprits"] == [culprit]
    [decision] = train_events(run, "decision")
    assert decision["action"] == "regroup" and decision["path"] == "in_place"
    assert decision["new_nodes"] == [survivor, SPARE] and decision["joiners"] == [SPARE]
    assert [e["attempt"] for e in train_events(run, "attempt_start")] == [1]  # survivors never restarted
    [regrouped] = train_events(run, "regrouped")
    assert regrouped["generation"] == 2 and regrouped["world_size"] == 2
    assert result.attempts == 1 and result.last_step == 20
    manifest = read_manifest(Path(result.checkpoint))
    assert manifest["step"] == 20 and manifest["world_size"] == 2
    assert stages.check_checkpoint(run, result.checkpoint, 20).step == 20
    [failure] = recovery_figures(run.ledger)["failures"]
    assert failure["path"] == "in_place" and failure["lost_steps"] <= 1
    assert not train_events(run, "store_refused")  # every value the honest ranks wrote opened with their keys


def test_a_killed_training_pod_is_healed_in_place_with_the_warm_spare_as_joiner(fake: FakeKube, tmp_path: Path) -> None:
    run = in_place_run(tmp_path)
    killed: dict[str, Any] = {}

    def kill_a_pod(kubelet: Kubelet) -> None:
        trained_a_few_steps(run)
        pods = training_pods(fake)
        members = sorted(n for n, p in pods.items() if p["metadata"]["annotations"][NODE_ANNOTATION] in NODES)
        killed["pod"] = random.Random(SEED).choice(members)
        killed["node"] = pods[killed["pod"]]["metadata"]["annotations"][NODE_ANNOTATION]
        kubelet.kill_pod(killed["pod"])

    with Kubelet(fake, NS, tmp_path / "kubelet", seed=SEED) as kubelet:
        killer = threading.Thread(target=kill_a_pod, args=(kubelet,), daemon=True)
        killer.start()
        result, seen = deferred_train(run, [SPARE])
        killer.join()
        placed = dict(kubelet.placed)
    assert seen[0] in ("failed", "fault") and seen[-1] == "succeeded" and "backoff" not in seen
    assert_healed_in_place(run, result, killed["node"], "node_lost")
    # Every training pod ran on its own node's host: the spare's on the spare.
    for name, host in placed.items():
        if name.startswith(killed["pod"].rsplit("-", 1)[0]) and not name.endswith("-store"):
            assert host in [*NODES, SPARE]
    # The coordinator, its Service and the keys' Secret went with the attempt, as its pods did.
    assert fake.items("api/v1", "pods", NS) == [] and fake.items("api/v1", "services", NS) == []
    assert fake.items("api/v1", "secrets", NS) == []
    # The attempt's secret stayed with the orchestrator: a file only its user reads, outside every pod's mounts.
    [secret] = (run.dir / "store").iterdir()
    assert secret.stat().st_mode & 0o077 == 0 and (run.dir / "store").stat().st_mode & 0o077 == 0


def test_a_lost_host_is_healed_in_place_by_the_spare_pinned_to_its_host(fake: FakeKube, tmp_path: Path) -> None:
    """The host of one training pod goes (NodeLost, chosen by the seed among the hosts that do not run the
    coordinator: losing that one ends the attempt, as losing the task process does locally)."""
    run = in_place_run(tmp_path)
    lost: dict[str, Any] = {}

    def lose_a_host(kubelet: Kubelet) -> None:
        trained_a_few_steps(run)
        pods = fake.items("api/v1", "pods", NS)
        store_hosts = {
            p["spec"].get("nodeName") for p in pods if NODE_ANNOTATION not in p["metadata"].get("annotations", {})
        }
        hosts = sorted(n for n in NODES if n not in store_hosts)
        lost["host"] = random.Random(SEED).choice(hosts)
        lost["pods"] = kubelet.lose_node(lost["host"])

    with Kubelet(fake, NS, tmp_path / "kubelet", seed=SEED) as kubelet:
        loser = threading.Thread(target=lose_a_host, args=(kubelet,), daemon=True)
        loser.start()
        result, seen = deferred_train(run, [SPARE])
        loser.join()
        placed = dict(kubelet.placed)
    assert lost["pods"] and seen[0] in ("failed", "fault") and seen[-1] == "succeeded"
    assert_healed_in_place(run, result, lost["host"], "node_lost")
    spare_pods = [name for name, host in placed.items() if host == SPARE and not name.endswith("-store")]
    assert spare_pods  # the joiner ran on the spare it is pinned to


def test_a_pod_given_notice_leaves_at_a_step_boundary_and_the_trigger_wakes_on_its_report(
    fake: FakeKube, tmp_path: Path
) -> None:
    """gpu-b's pod gets SIGTERM (the ``preempt`` drill signals its torchrun agent, as the kubelet does a pod's
    first process on a deletion with grace); its rank reports the leave on the store, the trigger sees the
    fault counter move and fires at once; the task reads the sealed report (``Coordinator.leaving``) and
    regroups without gpu-b, blamed for nothing: one attempt, nothing lost."""
    run = run_with(
        tmp_path,
        "[{fault: preempt, node: gpu-b, step: 8}]",
        in_place="true, rejoin: false",
        heartbeat_timeout_s=QUIET_S,
    )
    with Kubelet(fake, NS, tmp_path / "kubelet", seed=SEED):
        result, seen = deferred_train(run, [SPARE])
    assert seen[0] == "fault" and seen[-1] == "succeeded" and "backoff" not in seen
    [classified] = train_events(run, "failure_classified")
    assert classified["kind"] == "preempted" and classified["culprits"] == []
    assert "gpu-b given notice (SIGTERM)" in classified["evidence"]
    [decision] = train_events(run, "decision")
    assert decision["action"] == "regroup" and decision["path"] == "in_place" and "gpu-b" not in decision["new_nodes"]
    assert [e["attempt"] for e in train_events(run, "attempt_start")] == [1]
    assert not train_events(run, "nodes_marked")  # notice is not the host's fault
    assert result.attempts == 1 and result.last_step == 20
    [failure] = recovery_figures(run.ledger)["failures"]
    assert failure["path"] == "in_place" and failure["lost_steps"] == 0


def test_a_killed_pod_started_again_on_its_healthy_host_rejoins_at_a_wake(
    fake: FakeKube, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No spare: the survivor trains alone (2 -> 1), the killed node's new pod (pinned to its own host, which is
    healthy) waits ready on the store, and the next wake (``GROW_WAKE_S``, the group being below its size)
    grows the world back with it as the joiner (1 -> 2): one attempt, the last checkpoint of two nodes.
    The wake comes after ``GROW_WAKE_S`` (shortened here): the survivor's steps must outlast it, or it finishes
    alone (what made this test fail on a quiet machine, where 100 steps took 3 s against a 15 s wake)."""
    monkeypatch.setattr(deferred, "GROW_WAKE_S", GROW_WAKE_S)
    run = run_with(tmp_path, "[]", in_place="true", max_steps=250, heartbeat_timeout_s=QUIET_S)
    killed: dict[str, Any] = {}

    def kill_a_pod(kubelet: Kubelet) -> None:
        trained_a_few_steps(run)
        pods = training_pods(fake)
        killed["pod"] = random.Random(SEED).choice(sorted(pods))
        killed["node"] = pods[killed["pod"]]["metadata"]["annotations"][NODE_ANNOTATION]
        kubelet.kill_pod(killed["pod"])

    with Kubelet(fake, NS, tmp_path / "kubelet", seed=SEED) as kubelet:
        killer = threading.Thread(target=kill_a_pod, args=(kubelet,), daemon=True)
        killer.start()
        result, seen = deferred_train(run)
        killer.join(timeout=5)
        placed = dict(kubelet.placed)
    node = killed["node"]
    # The first wake: the pod seen failed, or the survivor's fault report on the store, whichever came first.
    assert seen[0] in ("failed", "fault") and "timeout" in seen and seen[-1] == "succeeded"
    [rejoining] = train_events(run, "rejoining")
    assert rejoining["nodes"] == [node]
    [grown] = train_events(run, "grown")
    assert grown["joiners"] == [node] and sorted(grown["nodes"]) == sorted(NODES)
    assert [e["world_size"] for e in train_events(run, "regrouped")] == [1, 2]
    assert [e["attempt"] for e in train_events(run, "attempt_start")] == [1]
    # The node's new pod ran on its own host: a pod of that node, placed after the killed one.
    assert [host for name, host in placed.items() if name != killed["pod"] and host == node]
    assert result.attempts == 1 and read_manifest(Path(result.checkpoint))["world_size"] == 2
    figures = recovery_figures(run.ledger)
    assert figures["world_path"] == "2 -> 1 -> 2" and figures["lost_steps"] <= 1
