"""Cluster nodes as trainyard sees them: the candidates, and the marks that keep pods off a bad one.

A node the pressure test or recovery leaves out is marked with
``evicted_label`` (and, with ``evict_with: taint``, a NoSchedule taint of the
same key); training pods require the label's absence. Marks name *hosts*
(Kubernetes node names), the names pods report in ``spec.nodeName``.

With the label trainyard writes when (``trainyard.io/evicted-at``) and why
(``trainyard.io/evicted-reason``): the annotation is what makes the mark
trainyard's own, so ``trainyard.backends.kubernetes.cooldown`` may re-test the node after a
cool-down; a label a person set has none and stays until the person removes it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, Literal

from kubernetes.client.exceptions import ApiException

from trainyard.backends.kubernetes.models import k8s
from trainyard.backends.kubernetes.names import equality_selector
from trainyard.spec import KubernetesSpec

log = logging.getLogger(__name__)

EVICTED_VALUE = "true"
EVICTED_AT = "trainyard.io/evicted-at"
EVICTED_REASON = "trainyard.io/evicted-reason"
REASON_MAX = 512
MERGE_PATCH = "application/merge-patch+json"
_PATCH_TRIES = 5

EvictWith = Literal["label", "taint"]


def candidate_nodes(core_api: k8s.CoreV1Api, spec: KubernetesSpec, count: int) -> list[str]:
    """The first ``count`` schedulable nodes matching ``node_selector`` that are not marked evicted.

    A marked node stays out of this pool: ``trainyard.backends.kubernetes.cooldown.due_for_retest``
    offers one trainyard marked again after the cool-down; one a person marked
    stays out until the person clears the label.
    """
    nodes = core_api.list_node(label_selector=equality_selector(dict(spec.node_selector))).items
    usable = sorted(
        n.metadata.name
        for n in nodes
        if not (n.spec and n.spec.unschedulable) and spec.evicted_label not in (n.metadata.labels or {})
    )
    return usable[:count]


def label_evicted(
    core_api: k8s.CoreV1Api,
    nodes: Iterable[str],
    label: str,
    mode: EvictWith = "label",
    reasons: Mapping[str, str] | None = None,
    at: datetime | None = None,
) -> list[str]:
    """Mark ``nodes`` evicted (label; with ``taint`` also a NoSchedule taint); returns the nodes marked.

    The label comes with the annotations ``evicted-at`` (``at``, default now)
    and ``evicted-reason`` (``reasons[node]``; none given removes an older one,
    which would name another eviction), in one merge patch so no reader sees
    the label without its time. Marking a marked node again keeps one label and
    one taint and restarts its cool-down. A node that no longer exists is
    skipped (there is nothing left to keep pods off).
    """
    stamp = rfc3339(at or datetime.now(UTC))
    return [
        n
        for n in nodes
        if _mark(core_api, n, label, mode, {EVICTED_AT: stamp, EVICTED_REASON: _reason((reasons or {}).get(n))})
    ]


def unlabel(core_api: k8s.CoreV1Api, nodes: Iterable[str], label: str) -> list[str]:
    """Take the eviction marks off ``nodes`` (a node that passed a new pressure test); returns the nodes cleared.

    Clears the taint and both annotations too, whatever ``evict_with`` says
    now: the node may have been marked while the spec said ``taint``.
    """
    return [n for n in nodes if _mark(core_api, n, label, "taint", None)]


def rfc3339(at: datetime) -> str:
    """``at`` as RFC 3339 UTC to the second (``2026-12-01T04:37:08Z``), as Kubernetes writes times."""
    if at.tzinfo is None:
        raise ValueError(f"eviction time {at.isoformat()} has no time zone; pass an aware datetime (UTC)")
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _reason(text: str | None) -> str | None:
    """One line of at most ``REASON_MAX`` characters (``kubectl get`` prints annotations as they are)."""
    line = " ".join((text or "").split())
    return (line[: REASON_MAX - 1] + "…" if len(line) > REASON_MAX else line) or None


def evicted_nodes(core_api: k8s.CoreV1Api, label: str) -> list[str]:
    """Nodes carrying the eviction label now."""
    return sorted(n.metadata.name for n in core_api.list_node(label_selector=label).items)


def _mark(
    core_api: k8s.CoreV1Api, node: str, label: str, mode: EvictWith, annotations: dict[str, str | None] | None
) -> bool:
    """Set the marks (``annotations`` given: these, None values deleted) or clear them all (None)."""
    on = annotations is not None
    metadata = {
        "labels": {label: EVICTED_VALUE if on else None},
        "annotations": annotations if on else dict.fromkeys((EVICTED_AT, EVICTED_REASON)),
    }
    try:
        _patch(core_api, node, {"metadata": metadata})
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
