"""Cluster nodes as trainyard sees them: the candidates, and the marks that keep pods off a bad one.

A node the pressure test or recovery leaves out is marked with
``evicted_label`` (and, with ``evict_with: taint``, a NoSchedule taint of the
same key); training pods require the label's absence. Marks name *hosts*
(Kubernetes node names), the names pods report in ``spec.nodeName``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Literal

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from trainyard.kube.names import equality_selector
from trainyard.spec import KubernetesSpec

log = logging.getLogger(__name__)

EVICTED_VALUE = "true"
MERGE_PATCH = "application/merge-patch+json"
_PATCH_TRIES = 5

EvictWith = Literal["label", "taint"]


def candidate_nodes(core_api: k8s.CoreV1Api, spec: KubernetesSpec, count: int) -> list[str]:
    """The first ``count`` schedulable nodes matching ``node_selector`` that are not marked evicted.

    A node stays out of the pool until someone clears the label after repairing it.
    """
    nodes = core_api.list_node(label_selector=equality_selector(dict(spec.node_selector))).items
    usable = sorted(
        n.metadata.name
        for n in nodes
        if not (n.spec and n.spec.unschedulable) and spec.evicted_label not in (n.metadata.labels or {})
    )
    return usable[:count]


def label_evicted(core_api: k8s.CoreV1Api, nodes: Iterable[str], label: str, mode: EvictWith = "label") -> list[str]:
    """Mark ``nodes`` evicted (label; with ``taint`` also a NoSchedule taint); returns the nodes marked.

    Idempotent: marking a marked node changes nothing. A node that no longer
    exists is skipped (there is nothing left to keep pods off).
    """
    return [n for n in nodes if _mark(core_api, n, label, mode, on=True)]


def unlabel(core_api: k8s.CoreV1Api, nodes: Iterable[str], label: str) -> list[str]:
    """Take the eviction marks off ``nodes`` (a node that passed a new pressure test); returns the nodes cleared.

    Clears the taint too whatever ``evict_with`` says now: the node may have
    been marked while the spec said ``taint``.
    """
    return [n for n in nodes if _mark(core_api, n, label, "taint", on=False)]


def evicted_nodes(core_api: k8s.CoreV1Api, label: str) -> list[str]:
    """Nodes carrying the eviction label now."""
    return sorted(n.metadata.name for n in core_api.list_node(label_selector=label).items)


def _mark(core_api: k8s.CoreV1Api, node: str, label: str, mode: EvictWith, on: bool) -> bool:
    try:
        _patch(core_api, node, {"metadata": {"labels": {label: EVICTED_VALUE if on else None}}})
        if mode == "taint":
            _set_taint(core_api, node, label, on)
    except ApiException as exc:
        if exc.status == 404:
            log.warning("node %s is gone; nothing to %s", node, "mark" if on else "clear")
            return False
        raise
    return True


def _patch(core_api: k8s.CoreV1Api, node: str, body: dict[str, Any]) -> None:
    # A JSON merge patch (RFC 7386) means exactly what these bodies say: maps merge, a list
    # (taints) is replaced whole, null deletes a key; no per-field strategic-merge rules apply.
    core_api.patch_node(node, body, _content_type=MERGE_PATCH)


def _set_taint(core_api: k8s.CoreV1Api, node: str, key: str, on: bool) -> None:
    """Add or remove the NoSchedule taint ``key``, keeping every other taint.

    Taints are a list a patch replaces whole, so read, change and write with the
    read resourceVersion: a concurrent change (another controller's taint) makes
    the write fail with 409 instead of being lost, and we try again.
    """
    for _ in range(_PATCH_TRIES):
        current = core_api.read_node(node)
        if _has_taint(current, key) == on:
            return  # already as wanted
        taints = [t for t in (current.spec.taints or []) if not (t.key == key and t.effect == "NoSchedule")]
        if on:
            taints.append(k8s.V1Taint(key=key, value=EVICTED_VALUE, effect="NoSchedule"))
        body = {
            "metadata": {"resourceVersion": current.metadata.resource_version},
            "spec": {"taints": core_api.api_client.sanitize_for_serialization(taints)},
        }
        try:
            _patch(core_api, node, body)
            return
        except ApiException as exc:
            if exc.status != 409:
                raise
    raise RuntimeError(f"node {node}: taints kept changing under us ({_PATCH_TRIES} tries)")


def _has_taint(node: Any, key: str) -> bool:
    return any(t.key == key and t.effect == "NoSchedule" for t in (node.spec.taints or []))
