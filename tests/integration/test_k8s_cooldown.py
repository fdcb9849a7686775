"""An evicted node earns its way back, and nodes have kinds: against the fake API server over HTTP.

The marks carry when and why a node was evicted (annotations, in the label's
own merge patch); ``due_for_retest`` offers the nodes trainyard marked once
their cool-down has passed, never one a person marked; ``node_kinds`` names a
node's instance type and GPU product from the labels the cluster sets.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from fake_k8s import HOSTNAME, Call, FakeKube
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from trainyard.backends.kubernetes.cooldown import due_for_retest
from trainyard.backends.kubernetes.kinds import node_kinds
from trainyard.backends.kubernetes.marks import EVICTED_AT, EVICTED_REASON, label_evicted, unlabel
from trainyard.spec import KubernetesSpec

pytestmark = pytest.mark.integration

CORE = "api/v1"
LABEL = "trainyard.io/evicted"
NOW = datetime(2026, 12, 2, 5, 0, 0, tzinfo=UTC)
DAY_S = 24 * 3600.0
SPEC = KubernetesSpec(image="registry.local/trainer:1", namespace="trainyard", node_selector={"pool": "gpu"})


@pytest.fixture
def fake() -> Iterator[FakeKube]:
    server = FakeKube().start()
    yield server
    server.stop()


def node(fake: FakeKube, name: str) -> dict[str, Any]:
    found = fake.get(CORE, "nodes", "", name)
    assert found is not None, name
    return found


def annotations(fake: FakeKube, name: str) -> dict[str, str]:
    return node(fake, name)["metadata"].get("annotations", {})


def node_patches(fake: FakeKube) -> int:
    return fake.calls.count(Call("patch", "", "nodes", False))


def test_marking_records_when_and_why_in_the_labels_own_patch(fake: FakeKube) -> None:
    core = client.CoreV1Api(fake.client())
    for name in ("k8s-0", "k8s-1", "k8s-2"):
        fake.add_node(name)
    reasons = {
        "k8s-0": "matmul_gflops 80.12 < 0.90 x median 127.89\nconfirmed: 79.40 < 0.90 x reference 126.10",
        "k8s-1": "gpu0: uncorrected ECC errors 3 > 0 " * 40,
    }
    at = datetime(2026, 12, 1, 4, 37, 8, 912_000, tzinfo=UTC)
    assert label_evicted(core, ["k8s-0", "k8s-1", "gone"], LABEL, reasons=reasons, at=at) == ["k8s-0", "k8s-1"]
    assert node_patches(fake) == 3  # one merge patch per node (and one for the vanished one): label and both notes

    for name in ("k8s-0", "k8s-1"):
        assert node(fake, name)["metadata"]["labels"] == {HOSTNAME: name, LABEL: "true"}
        assert annotations(fake, name)[EVICTED_AT] == "2026-12-01T04:37:08Z"
    assert annotations(fake, "k8s-0")[EVICTED_REASON] == (
        "matmul_gflops 80.12 < 0.90 x median 127.89 confirmed: 79.40 < 0.90 x reference 126.10"
    )
    long = annotations(fake, "k8s-1")[EVICTED_REASON]
    assert len(long) == 512 and "\n" not in long and long.startswith("gpu0: uncorrected ECC errors 3 > 0 gpu0:")

    # Another time zone is written as UTC; a mark without reasons (recovery's) takes the old reason off:
    # it would describe an eviction that is not this one.
    label_evicted(core, ["k8s-1"], LABEL, at=datetime(2026, 12, 3, 9, 0, tzinfo=timezone(timedelta(hours=2))))
    assert annotations(fake, "k8s-1") == {EVICTED_AT: "2026-12-03T07:00:00Z"}

    # The default time is now, in UTC.
    before = datetime.now(UTC).replace(microsecond=0)
    label_evicted(core, ["k8s-2"], LABEL, reasons={"k8s-2": "dead: never reported"})
    stamped = datetime.fromisoformat(annotations(fake, "k8s-2")[EVICTED_AT])
    assert stamped.tzinfo == UTC and before <= stamped <= datetime.now(UTC)
    assert annotations(fake, "k8s-2")[EVICTED_REASON] == "dead: never reported"


def test_unmarking_takes_off_label_taint_and_both_annotations(fake: FakeKube) -> None:
    core = client.CoreV1Api(fake.client())
    other_taint = {"key": "gpu-maintenance", "value": "x", "effect": "NoExecute"}
    fake.add_node("k8s-0", labels={"pool": "gpu"}, taints=[other_taint])
    fake.add_node("k8s-1")
    # Someone else's annotation on the node is not ours to remove.
    core.patch_node("k8s-0", {"metadata": {"annotations": {"team.example/owner": "infra"}}})
    label_evicted(core, ["k8s-0", "k8s-1"], LABEL, mode="taint", reasons={"k8s-0": "disk_mbps 40 < 0.5 x 120"}, at=NOW)
    assert node(fake, "k8s-0")["spec"]["taints"][-1] == {"key": LABEL, "value": "true", "effect": "NoSchedule"}

    assert unlabel(core, ["k8s-0", "k8s-1", "gone"], LABEL) == ["k8s-0", "k8s-1"]
    cleared = node(fake, "k8s-0")
    assert cleared["metadata"]["labels"] == {HOSTNAME: "k8s-0", "pool": "gpu"}
    assert cleared["spec"]["taints"] == [other_taint]
    assert cleared["metadata"]["annotations"] == {"team.example/owner": "infra"}
    assert client.CoreV1Api(fake.client()).read_node("k8s-1").metadata.annotations is None  # none left at all


def test_due_for_retest_offers_only_trainyards_marks_past_the_cool_down(
    fake: FakeKube, caplog: pytest.LogCaptureFixture
) -> None:
    core = client.CoreV1Api(fake.client())
    gpu = {"pool": "gpu"}
    for name in ("a-25h", "b-1h", "c-by-hand", "d-cordoned", "e-bad-stamp", "f-exactly-24h", "g-healthy", "h-tainted"):
        fake.add_node(name, labels=gpu)
    fake.add_node("z-other-pool", labels={"pool": "cpu"})
    label_evicted(core, ["a-25h", "d-cordoned", "z-other-pool"], LABEL, at=NOW - timedelta(hours=25))
    label_evicted(core, ["h-tainted"], LABEL, mode="taint", at=NOW - timedelta(hours=25))
    label_evicted(core, ["b-1h"], LABEL, at=NOW - timedelta(hours=1))
    label_evicted(core, ["f-exactly-24h"], LABEL, at=NOW - timedelta(hours=24))
    core.patch_node("c-by-hand", {"metadata": {"labels": {LABEL: "true"}}})  # kubectl label node c-by-hand ...
    core.patch_node("d-cordoned", {"spec": {"unschedulable": True}})  # kubectl cordon d-cordoned
    core.patch_node("e-bad-stamp", {"metadata": {"labels": {LABEL: "true"}, "annotations": {EVICTED_AT: "yesterday"}}})
    lists_before = fake.calls.count(Call("list", "", "nodes", False))

    with caplog.at_level(logging.INFO, logger="trainyard.backends.kubernetes.cooldown"):
        due = due_for_retest(core, SPEC, DAY_S, NOW)

    assert due == ["a-25h", "f-exactly-24h", "h-tainted"]
    assert fake.calls.count(Call("list", "", "nodes", False)) == lists_before + 1
    by_hand = [r for r in caplog.records if "c-by-hand" in r.getMessage()]
    assert [r.levelno for r in by_hand] == [logging.INFO] and "person" in by_hand[0].getMessage()
    bad = [r for r in caplog.records if "e-bad-stamp" in r.getMessage()]
    assert [r.levelno for r in bad] == [logging.WARNING] and "'yesterday'" in bad[0].getMessage()
    # Nothing else was worth a word: the nodes not yet due, cordoned or elsewhere are simply not offered.
    assert {r.levelno for r in caplog.records} <= {logging.INFO, logging.WARNING} and len(caplog.records) == 2

    # A longer cool-down, a later now: the answer moves with them.
    assert due_for_retest(core, SPEC, 25 * 3600.0, NOW) == ["a-25h", "h-tainted"]
    assert due_for_retest(core, SPEC, DAY_S, NOW + timedelta(hours=23)) == [
        "a-25h",
        "b-1h",
        "f-exactly-24h",
        "h-tainted",
    ]
    # Re-admitted (unlabelled): no longer evicted, so no longer due.
    unlabel(core, ["a-25h"], LABEL)
    assert due_for_retest(core, SPEC, DAY_S, NOW) == ["f-exactly-24h", "h-tainted"]


def test_due_for_retest_without_a_node_selector_looks_at_the_whole_cluster(fake: FakeKube) -> None:
    core = client.CoreV1Api(fake.client())
    fake.add_node("k8s-0", labels={"pool": "cpu"})
    fake.add_node("k8s-1")
    label_evicted(core, ["k8s-0", "k8s-1"], LABEL, at=NOW - timedelta(days=2))
    anywhere = KubernetesSpec(image="registry.local/trainer:1", namespace="trainyard")
    assert due_for_retest(core, anywhere, DAY_S, NOW) == ["k8s-0", "k8s-1"]


def test_node_kinds_come_from_instance_type_and_gpu_product_labels(fake: FakeKube) -> None:
    core = client.CoreV1Api(fake.client())
    h100 = {
        "node.kubernetes.io/instance-type": "p5.48xlarge",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
        "nvidia.com/gpu.count": "8",
        "topology.kubernetes.io/zone": "us-east-1a",
    }
    fake.add_node("ip-10-0-1-17.ec2.internal", labels=h100)
    fake.add_node("ip-10-0-1-18.ec2.internal", labels=h100)
    fake.add_node("ip-10-0-7-3.ec2.internal", labels={"node.kubernetes.io/instance-type": "m7i.4xlarge"})
    old = {"beta.kubernetes.io/instance-type": "p4d.24xlarge", "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"}
    fake.add_node("old-a100", labels=old)
    fake.add_node("kind-worker")
    lists_before = fake.calls.count(Call("list", "", "nodes", False))

    names = ["ip-10-0-1-17.ec2.internal", "ip-10-0-1-18.ec2.internal", "ip-10-0-7-3.ec2.internal"]
    kinds = node_kinds(core, [*names, "old-a100", "kind-worker", "ip-10-0-9-9.ec2.internal"])

    assert kinds == {
        "ip-10-0-1-17.ec2.internal": "p5.48xlarge/NVIDIA-H100-80GB-HBM3",
        "ip-10-0-1-18.ec2.internal": "p5.48xlarge/NVIDIA-H100-80GB-HBM3",
        "ip-10-0-7-3.ec2.internal": "m7i.4xlarge/unknown",  # no GPU feature discovery labels
        "old-a100": "p4d.24xlarge/NVIDIA-A100-SXM4-40GB",  # only the deprecated beta label
        "kind-worker": "unknown/unknown",
        "ip-10-0-9-9.ec2.internal": "unknown",  # gone: scaled away since its last burn-in
    }
    assert fake.calls.count(Call("list", "", "nodes", False)) == lists_before + 1
    assert Call("get", "", "nodes", False) not in fake.calls  # no read per node


def test_the_api_server_refuses_a_label_or_annotation_that_is_not_a_string(fake: FakeKube) -> None:
    """Labels and annotations are Go map[string]string: a number is a decoding error (400), not stored."""
    core = client.CoreV1Api(fake.client())
    fake.add_node("k8s-0")
    with pytest.raises(ApiException) as refused:
        core.patch_node("k8s-0", {"metadata": {"annotations": {EVICTED_AT: 1764563828}}})
    assert refused.value.status == 400 and "metadata.annotations of type string" in str(refused.value.body)
    assert "annotations" not in node(fake, "k8s-0")["metadata"]
