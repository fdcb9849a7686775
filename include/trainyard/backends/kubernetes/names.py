"""Names of trainyard's Kubernetes objects: DNS labels, label values, labels and selectors.

Pure text functions; no ``kubernetes`` SDK.
"""

from __future__ import annotations

import hashlib
import re

from trainyard.backends.base import LaunchPlan

RDZV_PORT = 29400
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
GROUP_NAME_ANNOTATION = "scheduling.k8s.io/group-name"
RUN_ID_ANNOTATION = "trainyard.io/run-id"
LABEL_APP = "app.kubernetes.io/name"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_JOB = "trainyard.io/job"
LABEL_RUN = "trainyard.io/run"
LABEL_ATTEMPT = "trainyard.io/attempt"
LABEL_NODE = "trainyard.io/node"
"""An in-place pod's node (its host too: each is pinned to its own): its slot in the attempt's group."""
NODE_ANNOTATION = "trainyard.io/node"
"""An in-place pod's node by its exact name (the label's value may be shortened): its slot."""
STORE_PORT = 29500
"""Where an in-place attempt's coordinator pod serves the coordination store (its Service's port too)."""
HOSTNAME_KEY = "kubernetes.io/hostname"
# Pod hostnames are "<job>-<index>" and must fit a 63-character DNS label; an index
# has at most 3 digits (nodes.count <= 512), and pod names add a 6-character suffix.
MAX_JOB_NAME = 52


def _digest(text: str, length: int = 8) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def dns_label(readable: str, unique: str, max_len: int = 63) -> str:
    """A DNS-1035 label (lowercase, starts with a letter, <= ``max_len``) for ``readable``.

    A hash of ``unique`` always ends the name: sanitizing is lossy (two run ids
    can map to the same text) and truncation more so, and a name must never
    point at another run's objects.
    """
    base = re.sub(r"-{2,}", "-", re.sub(r"[^a-z0-9-]+", "-", readable.lower())).strip("-")
    suffix = _digest(unique)
    room = max_len - len("ty--") - len(suffix)
    return "-".join(filter(None, ("ty", base[:room].rstrip("-"), suffix)))


def label_value(text: str) -> str:
    """``text`` as a label value (<= 63 of ``[A-Za-z0-9._-]``, alphanumeric at both ends)."""
    value = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._")
    if value == text and len(value) <= 63:
        return value
    return f"{value[:54].rstrip('-._')}-{_digest(text)}".lstrip("-")


def object_name(plan: LaunchPlan) -> str:
    """Name of the attempt's Job, Service and PodGroup: run id and attempt, unique per run folder."""
    return dns_label(f"{plan.run_id}-a{plan.attempt}", f"{plan.log_dir}|{plan.run_id}|{plan.attempt}", MAX_JOB_NAME)


def store_name(name: str) -> str:
    """The coordinator pod, its Service and the node keys' Secret of attempt ``name`` (a Job name is <= 52)."""
    return f"{name}-store"


def store_endpoint(name: str, namespace: str, cluster_domain: str = "cluster.local") -> str:
    """``host:port`` the ranks of attempt ``name`` dial: its coordinator's ClusterIP Service, by DNS name."""
    return f"{store_name(name)}.{namespace}.svc.{cluster_domain}:{STORE_PORT}"


def rendezvous_endpoint(name: str, namespace: str, cluster_domain: str = "cluster.local") -> str:
    """``host:port`` of pod 0, which hosts the rendezvous store: its per-pod DNS name under the headless Service."""
    return f"{name}-0.{name}.{namespace}.svc.{cluster_domain}:{RDZV_PORT}"


def attempt_labels(plan: LaunchPlan, name: str) -> dict[str, str]:
    return {
        LABEL_APP: "trainyard",
        LABEL_COMPONENT: "training",
        LABEL_JOB: name,
        LABEL_RUN: label_value(plan.run_id),
        LABEL_ATTEMPT: str(plan.attempt),
    }


def selector(name: str) -> str:
    """Label selector of the attempt's pods."""
    return f"{LABEL_JOB}={name}"


def equality_selector(labels: dict[str, str]) -> str | None:
    """``k=v,k2=v2`` (sorted) for a label map; None for an empty one (select everything)."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or None
