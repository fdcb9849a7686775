"""The objects of an in-place Kubernetes attempt, checked against the official schema and for what they promise.

A pod per node pinned to its host and holding only its own key (from the attempt's Secret), the coordinator
pod serving the store on its pod IP (non-root, no API token), the ClusterIP Service that selects it alone,
the Secret of the nodes' keys; a replacement pod for a joiner; and how pods of an in-place attempt read as
node statuses (by their node, a deleted one failed, a lost coordinator fails them all).
"""

from __future__ import annotations

import base64
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
from test_k8s_objects import SETTINGS, make_plan, validate, wire

from trainyard.backends.base import LaunchPlan
from trainyard.backends.kubernetes.api import STORE_LOST, look
from trainyard.backends.kubernetes.names import (
    LABEL_JOB,
    NODE_ANNOTATION,
    STORE_PORT,
    object_name,
    store_endpoint,
    store_name,
)
from trainyard.backends.kubernetes.regroup import build_in_place, node_pod
from trainyard.backends.kubernetes.status import attempt_status

KEYS = {f"node-{i}": f"{i}" * 64 for i in range(3)} | {"spare-0": "e" * 64}


def in_place_plan() -> LaunchPlan:
    plan = make_plan(nodes=3)
    address = store_endpoint(object_name(plan), "ml")
    return replace(plan, train_env=replace(plan.train_env, store=address), store_keys=KEYS)


def env_of(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}


@pytest.mark.parametrize("setting", SETTINGS)
def test_every_object_of_an_in_place_attempt_is_a_valid_kubernetes_object(setting: str) -> None:
    objects = build_in_place(in_place_plan(), SETTINGS[setting])
    for obj in [*objects.pods, objects.coordinator, objects.service, objects.secret]:
        validate(wire(obj))
    assert (objects.podgroup is not None) == (setting == "volcano")


def test_each_node_pod_is_pinned_to_its_host_and_holds_only_its_own_key() -> None:
    plan = in_place_plan()
    objects = build_in_place(plan, SETTINGS["default-cpu"])
    assert len(objects.pods) == 3
    for node, pod in zip(plan.nodes, map(wire, objects.pods), strict=True):
        spec = pod["spec"]
        [term] = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert term["matchFields"] == [{"key": "metadata.name", "operator": "In", "values": [node]}]
        assert term["matchExpressions"] == [{"key": "trainyard.io/evicted", "operator": "DoesNotExist"}]
        assert pod["metadata"]["annotations"][NODE_ANNOTATION] == node
        assert LABEL_JOB in pod["metadata"]["labels"] and "subdomain" not in spec
        env = env_of(pod)
        ref = env["TRAINYARD_STORE_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": store_name(objects.name), "key": node} and "value" not in env["TRAINYARD_STORE_KEY"]
        assert env["TRAINYARD_STORE"]["value"] == f"{store_name(objects.name)}.ml.svc.cluster.local:{STORE_PORT}"
        assert "JOB_COMPLETION_INDEX" not in env
        text = str(pod)
        assert not any(key in text for key in KEYS.values())  # no key's value in any pod
        trainer = spec["containers"][0]
        assert trainer["command"] == ["python", "-m", "torch.distributed.run"]
        assert trainer["args"][:4] == ["--standalone", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=0"]
        assert spec["restartPolicy"] == "Never" and spec["automountServiceAccountToken"] is False


def test_a_replacement_pod_is_a_new_pod_pinned_to_the_joiners_host() -> None:
    plan = in_place_plan()
    first = wire(node_pod(plan, SETTINGS["default-cpu"], "node-1"))
    again = wire(node_pod(plan, SETTINGS["default-cpu"], "node-1", fresh=True))
    spare = wire(node_pod(plan, SETTINGS["default-cpu"], "spare-0", fresh=True))
    assert again["metadata"]["name"] != first["metadata"]["name"]  # the old one may still be terminating
    for pod, host in ((again, "node-1"), (spare, "spare-0")):
        validate(pod)
        [term] = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"
        ]
        assert term["matchFields"][0]["values"] == [host]
        assert env_of(pod)["TRAINYARD_STORE_KEY"]["valueFrom"]["secretKeyRef"]["key"] == host
        assert pod["metadata"]["annotations"][NODE_ANNOTATION] == host


def test_the_coordinator_serves_on_its_pod_ip_behind_a_cluster_ip_service_that_selects_it_alone() -> None:
    plan = in_place_plan()
    objects = build_in_place(plan, SETTINGS["default-gpu"])
    pod, service = wire(objects.coordinator), wire(objects.service)
    store = store_name(objects.name)
    assert pod["metadata"]["name"] == store and service["metadata"]["name"] == store
    [c] = pod["spec"]["containers"]
    assert c["command"] == ["python", "-m", "trainyard.backends.store", f"--port={STORE_PORT}"]
    assert env_of(pod)["TRAINYARD_STORE_BIND"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert c["securityContext"]["runAsNonRoot"] is True and c["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["spec"]["automountServiceAccountToken"] is False and "serviceAccountName" not in pod["spec"]
    assert "nvidia.com/gpu" not in c["resources"]["limits"]  # it trains nothing
    assert service["spec"]["type"] == "ClusterIP" and service["spec"]["ports"][0]["targetPort"] == STORE_PORT
    assert service["spec"]["selector"] == {LABEL_JOB: store} == {LABEL_JOB: pod["metadata"]["labels"][LABEL_JOB]}
    assert all(p.metadata.labels[LABEL_JOB] != store for p in objects.pods)  # no training pod behind it


def test_the_secret_holds_each_nodes_key_and_no_secret_of_the_attempt() -> None:
    objects = build_in_place(in_place_plan(), SETTINGS["default-cpu"])
    secret = wire(objects.secret)
    assert {k: base64.b64decode(v).decode() for k, v in secret["data"].items()} == KEYS
    assert secret["immutable"] is True
    with pytest.raises(ValueError, match="store_keys"):
        build_in_place(replace(in_place_plan(), store_keys={}), SETTINGS["default-cpu"])


def pod(node: str | None, phase: str = "Running", deleting: bool = False) -> Any:
    return SimpleNamespace(
        metadata=SimpleNamespace(
            name=f"p-{node}", annotations={NODE_ANNOTATION: node} if node else {}, labels={},
            deletion_timestamp="now" if deleting else None, namespace="ml",
        ),
        spec=SimpleNamespace(node_name=node),
        status=SimpleNamespace(phase=phase, reason=None, message=None, conditions=None, container_statuses=None),
    )  # fmt: skip


@pytest.mark.parametrize(
    "pods,in_place,expected",
    [
        # by their node, whatever order the API lists them in; a spare's pod is not a slot
        ([pod("b"), pod("spare"), pod("a")], True, [("a", "running"), ("b", "running")]),
        # a pod deleted by hand: failed, since the launcher made each pod itself
        ([pod("a")], True, [("a", "running"), ("b", "failed")]),
        # a Job's pod not there yet is only pending
        ([], False, [("a", "running"), ("b", "running")]),
    ],
)
def test_pods_of_an_in_place_attempt_read_as_node_statuses(pods: list[Any], in_place: bool, expected: list) -> None:
    status = attempt_status(pods, ["a", "b"], in_place=in_place)
    assert [(n.slot, n.state) for n in status.nodes] == expected
    if ("b", "failed") in expected:
        assert status.nodes[1].reason == "PodDeleted"


def test_a_lost_coordinator_fails_every_node() -> None:
    operation = look("ml", "job", in_place=True)
    assert next(operation).kwargs["label_selector"] == "trainyard.io/job=job"
    request = operation.send([pod("a"), pod("b")])
    assert request.kwargs["label_selector"] == f"trainyard.io/job={store_name('job')}"
    with pytest.raises(StopIteration) as done:
        operation.send([pod(None, deleting=True)])  # terminating: gone for the ranks
    pods, reason = done.value.value
    assert reason == STORE_LOST
    assert {n.state for n in attempt_status(pods, ["a", "b"], reason, in_place=True).nodes} == {"failed"}
