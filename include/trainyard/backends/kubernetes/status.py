"""A pod as a ``NodeStatus``, and an attempt's pods as an ``AttemptStatus``.

Works on pod models of ``kubernetes`` and ``kubernetes_asyncio`` alike (same
attribute names), so the launcher and the deferrable trigger read the same
records; imports neither. A status's ``slot`` is the plan's node name at the
pod's completion index, its ``host`` the node the scheduler put the pod on.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import replace
from datetime import datetime
from typing import Any

from trainyard.backends.base import AttemptStatus, NodeStatus
from trainyard.backends.kubernetes.names import INDEX_ANNOTATION, NODE_ANNOTATION
from trainyard.backends.kubernetes.reasons import (
    FAILED_WAITING_REASONS,
    POD_FAILURE_REASONS,
    SHORTAGE_MARKERS,
    UNSCHEDULABLE,
    UNSCHEDULABLE_GRACE_S,
)

CONTAINER = "trainer"
_STATE_RANK = {"running": 0, "succeeded": 1, "failed": 2}


PodDeleted = "PodDeleted"
"""An in-place node whose pod is gone: the launcher made every one itself, so someone deleted it."""


def pod_index(pod: Any, nodes: list[str] | None = None) -> int | None:
    """The pod's slot: its node's place in ``nodes`` (an in-place pod, by its node), else its completion index."""
    meta = pod.metadata
    node = (meta.annotations or {}).get(NODE_ANNOTATION)
    if node is not None:
        return nodes.index(node) if nodes is not None and node in nodes else None
    raw = (meta.annotations or {}).get(INDEX_ANNOTATION) or (meta.labels or {}).get(INDEX_ANNOTATION)
    return int(raw) if raw is not None and str(raw).isdigit() else None


def _main_container(status: Any) -> Any:
    containers = (status.container_statuses or []) if status else []
    return next((c for c in containers if c.name == CONTAINER), containers[0] if containers else None)


def _terminated(container: Any) -> Any:
    if container is None:
        return None
    for state in (container.state, container.last_state):
        if state is not None and state.terminated is not None:
            return state.terminated
    return None


def _condition(status: Any, kind: str, value: str) -> Any:
    for cond in (status.conditions or []) if status else []:
        if cond.type == kind and cond.status == value:
            return cond
    return None


def _disruption(status: Any) -> str | None:
    """The reason of a DisruptionTarget condition (preemption, taint eviction, pod GC), if any."""
    cond = _condition(status, "DisruptionTarget", "True")
    return (cond.reason or "DisruptionTarget") if cond is not None else None


def _seconds(stamp: Any) -> float | None:
    if isinstance(stamp, datetime):
        return stamp.timestamp()
    if isinstance(stamp, str):  # a model built without deserialization
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    return None


def unschedulable(pod: Any, now: float | None = None) -> str | None:
    """The scheduler's message when ``pod`` fits no node and waiting will not change that; else None.

    A shortage of resources ("Insufficient nvidia.com/gpu": the last attempt's
    pods still draining) gets ``UNSCHEDULABLE_GRACE_S`` from the condition's
    transition; anything else ("didn't match Pod's node affinity/selector",
    "had untolerated taint") fails at once: the pods are pinned to named hosts.
    """
    status = pod.status
    if status is None or status.phase not in (None, "Pending") or pod.spec is None or pod.spec.node_name:
        return None
    cond = _condition(status, "PodScheduled", "False")
    if cond is None or cond.reason != UNSCHEDULABLE:
        return None
    message = cond.message or "no node fits the pod"
    if any(marker in message for marker in SHORTAGE_MARKERS):
        since = _seconds(cond.last_transition_time)
        waited = (time.time() if now is None else now) - since if since is not None else 0.0
        if waited < UNSCHEDULABLE_GRACE_S:
            return None
    return message


def _failure_reason(pod: Any, container: Any, terminated: Any, now: float | None) -> str | None:
    """Why the pod failed, or None while it still counts as running."""
    status = pod.status
    phase, pod_reason = status.phase, status.reason
    if phase == "Failed":
        # Kubernetes' own verdict on the pod (Evicted, NodeLost, DeadlineExceeded) says more than an
        # exit code; OOMKilled says more than a disruption; "Error" says least.
        oom = terminated.reason if terminated is not None and terminated.reason == "OOMKilled" else None
        return pod_reason or oom or _disruption(status) or (terminated.reason if terminated else None) or "Failed"
    if phase == "Unknown":
        return pod_reason or "NodeLost"  # the kubelet stopped reporting
    if pod_reason in POD_FAILURE_REASONS:
        return str(pod_reason)
    waiting = container.state.waiting.reason if container and container.state and container.state.waiting else None
    if waiting in FAILED_WAITING_REASONS:
        return str(waiting)
    if terminated is not None and terminated.exit_code != 0:
        return terminated.reason or "Error"  # exited; the phase has not caught up yet
    if pod.metadata.deletion_timestamp is not None and _disruption(status):
        return _disruption(status)  # e.g. DeletionByTaintManager: its node went NotReady
    if unschedulable(pod, now) is not None:
        return UNSCHEDULABLE
    return None


def pod_node_status(pod: Any, slot: str, now: float | None = None) -> NodeStatus:
    """One pod as a ``NodeStatus`` of ``slot``; its host is the node it runs on (``TRAINYARD_NODE`` inside it)."""
    host = (pod.spec.node_name if pod.spec is not None else None) or ""
    container = _main_container(pod.status)
    terminated = _terminated(container)
    code = terminated.exit_code if terminated is not None else None
    if pod.status is not None and pod.status.phase == "Succeeded":
        return NodeStatus(slot, "succeeded", 0 if code is None else code, host=host)
    reason = _failure_reason(pod, container, terminated, now) if pod.status is not None else None
    if reason is None:
        return NodeStatus(slot, "running", host=host)
    return NodeStatus(slot, "failed", code, reason=reason, host=host)


def pod_message(pod: Any) -> str:
    """What Kubernetes said about the pod, for the evidence: its message, or the scheduler's."""
    status = pod.status
    if status is None:
        return ""
    cond = _condition(status, "PodScheduled", "False")
    return status.message or (cond.message if cond is not None and cond.message else "") or ""


def pods_by_index(pods: Iterable[Any], nodes: list[str], now: float | None = None) -> dict[int, tuple[Any, NodeStatus]]:
    """The telling pod of each completion index: a failed one over a succeeded one over a running one."""
    best: dict[int, tuple[Any, NodeStatus]] = {}
    for pod in pods:
        index = pod_index(pod, nodes)
        if index is None or not 0 <= index < len(nodes):
            continue
        status = pod_node_status(pod, nodes[index], now)
        if index not in best or _STATE_RANK[status.state] > _STATE_RANK[best[index][1].state]:
            best[index] = (pod, status)
    return best


def job_failure_reason(job: Any) -> str | None:
    """The reason of the Job's Failed condition (BackoffLimitExceeded, DeadlineExceeded, ...), if it failed.

    Not the provider's ``KubernetesHook.is_job_failed``: that one needs Airflow (this library
    never imports it, docs/architecture.md, rule 2), takes a condition whose status is the string "False" for
    a failure, and answers None (not failed) for a Failed condition without a reason.
    """
    if job is None or job.status is None:
        return None
    cond = _condition(job.status, "Failed", "True")
    return (cond.reason or "JobFailed") if cond is not None else None


def attempt_status(
    pods: Iterable[Any],
    nodes: list[str],
    job_reason: str | None = None,
    now: float | None = None,
    in_place: bool = False,
) -> AttemptStatus:
    """Statuses in slot order (completion index); a slot without a pod yet is running (pending, no host).
    ``in_place``: a slot without a pod has failed (``PodDeleted``): the launcher made each before it watched.

    ``job_reason`` (the Job failed, or is gone) fails every unfinished node, but
    only when no pod says why: the pod that failed first is the evidence, and
    the survivors the Job controller then kills are not to blame.
    """
    best = pods_by_index(pods, nodes, now)
    missing = NodeStatus("", "failed", reason=PodDeleted) if in_place else NodeStatus("", "running")
    statuses = [best[i][1] if i in best else replace(missing, slot=node) for i, node in enumerate(nodes)]
    if job_reason and not any(s.state == "failed" for s in statuses):
        statuses = [s if s.state == "succeeded" else replace(s, state="failed", reason=job_reason) for s in statuses]
    return AttemptStatus(statuses)
