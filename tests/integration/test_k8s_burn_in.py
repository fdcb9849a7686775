"""The pressure test on the kubernetes backend, end to end against an API server over HTTP.

The test plays the kubelet (``fake_k8s.Kubelet``): for each burn-in pod the
stage creates, it runs the pod's command (``python -m trainyard.burnin.node``
with the pod's args) as a local process and reports its phase, so the orchestration, the pod specs and
the node protocol are all exercised for real; only the cluster is simulated.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_k8s import FakeKube, Kubelet

from trainyard.errors import NodeUnhealthy
from trainyard.pipeline.run import open_run
from trainyard.pipeline.stages import burn_in

pytestmark = [pytest.mark.integration, pytest.mark.alone]  # measures this machine: see pyproject
NS = "ml"
SPEC = """\
dataset: {{source: "file:///unused", name: tokens, hot: "file://{root}/hot"}}
runs_root: file://{root}/runs
nodes:
  count: 2
  min: {min}
  spare: 1
  backend: kubernetes
  kubernetes: {{image: "trainer:1", namespace: {ns}, node_selector: {{pool: train}}, store_host: 127.0.0.1}}
pressure_test:
  duration_s: 4
  matmul_size: 128
  membw_mb: 16
  disk_mb: 32
  # This VM's shared disk swings 2-3x between back-to-back probes; these tests are about
  # compute stragglers and dead nodes, so the disk probes only need to stay within 10x.
  ratio_overrides: {{disk_write_mbps: 0.1, disk_read_mbps: 0.1}}
  collective_sizes_kb: [64]
  drills: {drills}
training: {{max_steps: 1, global_batch: 4, micro_batch: 1, checkpoint_every: 1}}
"""


@pytest.fixture(autouse=True)
def one_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake cluster's nodes are processes of this one 2-core host: they share its cores, so its probes
    take turns as local nodes do. A real cluster's nodes probe at once; that path is
    tests/integration/test_burnin_protocol.py's (light candidates, no CPU to share)."""
    from trainyard.backends.kubernetes.probes import KubernetesProbes

    monkeypatch.setattr(KubernetesProbes, "shared", True)


@pytest.fixture
def fake() -> Iterator[FakeKube]:
    server = FakeKube().start()
    for name in ("gpu-a", "gpu-b", "gpu-c"):
        server.add_node(name, {"pool": "train"})
    server.add_node("gpu-d", {"pool": "train", "trainyard.io/evicted": "true"})  # evicted earlier: not a candidate
    server.add_node("cpu-e", {"pool": "other"})
    yield server
    server.stop()


def run_for(tmp_path: Path, drills: str, minimum: int = 1):
    spec = tmp_path / "p.yaml"
    spec.write_text(SPEC.format(root=tmp_path, ns=NS, drills=drills, min=minimum))
    return open_run(spec, "p", f"run-{time.monotonic_ns()}", "2026-11-28")


def test_a_throttled_cluster_node_is_evicted_and_labelled(fake: FakeKube, tmp_path: Path) -> None:
    run = run_for(tmp_path, "[{node: gpu-b, fault: throttle, factor: 0.5}]")
    with Kubelet(fake, NS):
        result = burn_in(run, fake.client())
    assert sorted(result.healthy) == ["gpu-a", "gpu-c"]
    # Three probes share two cores here, so the throttled node's sleeps hand the others CPU:
    # which of its throttled probes falls furthest below the median varies from run to run.
    assert re.match(r"straggler: (matmul_gflops|membw_gbps) ", result.evicted["gpu-b"])
    labels = {n["metadata"]["name"]: n["metadata"]["labels"] for n in fake.items("api/v1", "nodes")}
    assert labels["gpu-b"].get("trainyard.io/evicted") == "true"
    assert "trainyard.io/evicted" not in labels["gpu-a"] and "trainyard.io/evicted" not in labels["gpu-c"]
    assert fake.items("api/v1", "pods", NS) == []  # every burn-in pod was deleted
    verdicts = {e["node"] for e in run.ledger.events("burn_in", "node_verdict")}
    assert verdicts == {"gpu-a", "gpu-b", "gpu-c"}  # not the evicted gpu-d, not the other pool's cpu-e


def test_a_crashing_pod_is_dead_and_too_few_healthy_fails(fake: FakeKube, tmp_path: Path) -> None:
    run = run_for(tmp_path, "[{node: gpu-a, fault: crash}, {node: gpu-c, fault: crash}]", minimum=2)
    with Kubelet(fake, NS), pytest.raises(NodeUnhealthy, match=r"only 1 healthy node\(s\), nodes.min is 2") as err:
        burn_in(run, fake.client())
    assert "gpu-a" in str(err.value) and "evicted: dead: pod exited 1" in str(err.value)


def test_without_a_pressure_test_the_candidates_are_real_cluster_nodes_with_the_spares(
    fake: FakeKube, tmp_path: Path
) -> None:
    """Untested, the pods are still pinned to real hosts (never ``node-0``...), and the spare is there to
    replace a lost one: the cluster's usable nodes (selector matched, not evicted), none of them probed."""
    spec = tmp_path / "p.yaml"
    text = SPEC.format(root=tmp_path, ns=NS, drills="[]", min=1)
    spec.write_text(
        text[: text.index("pressure_test:")] + "pressure_test: {enabled: false}\n" + text[text.index("training:") :]
    )
    result = burn_in(open_run(spec, "p", "run-untested", "2026-11-28"), fake.client())
    assert result.skipped and len(result.healthy) == 2 and len(result.spare) == 1
    assert sorted(result.healthy + result.spare) == ["gpu-a", "gpu-b", "gpu-c"]
    assert fake.items("api/v1", "pods", NS) == []  # nothing was probed


def test_an_evicted_cluster_node_is_retested_after_its_cool_down_and_its_marks_removed(
    fake: FakeKube, tmp_path: Path
) -> None:
    from datetime import UTC, datetime, timedelta

    from trainyard.backends.kubernetes.marks import label_evicted

    core = __import__("kubernetes").client.CoreV1Api(fake.client())
    label_evicted(
        core,
        ["gpu-d"],
        "trainyard.io/evicted",
        reasons={"gpu-d": "straggler"},
        at=datetime.now(UTC) - timedelta(hours=25),
    )
    run = run_for(tmp_path, "[]")
    with Kubelet(fake, NS):
        result = burn_in(run, fake.client())
    assert result.readmitted == ["gpu-d"] and result.evicted == {}, result
    meta = {n["metadata"]["name"]: n["metadata"] for n in fake.items("api/v1", "nodes")}
    assert "trainyard.io/evicted" not in meta["gpu-d"].get("labels", {})
    assert "trainyard.io/evicted-at" not in meta["gpu-d"].get("annotations", {})
    [retested] = run.ledger.events("burn_in", "nodes_retested")
    assert retested["readmitted"] == ["gpu-d"]
    kinds = {e["node"]: e["kind"] for e in run.ledger.events("burn_in", "node_verdict")}
    assert set(kinds) == {"gpu-a", "gpu-b", "gpu-c", "gpu-d"}
