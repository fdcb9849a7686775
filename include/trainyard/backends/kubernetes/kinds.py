"""A node's kind, for the fleet history: only nodes of one kind are compared.

The kind comes from well-known labels the cluster sets itself: the instance
type (the cloud provider's ``node.kubernetes.io/instance-type``, the deprecated
``beta.kubernetes.io/instance-type`` on older nodes) and the GPU product (NVIDIA
GPU feature discovery's ``nvidia.com/gpu.product``), e.g.
``p5.48xlarge/NVIDIA-H100-80GB-HBM3``. A missing part is ``unknown``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from trainyard.backends.kubernetes.models import k8s

UNKNOWN = "unknown"
INSTANCE_TYPE = "node.kubernetes.io/instance-type"
INSTANCE_TYPE_BETA = "beta.kubernetes.io/instance-type"
GPU_PRODUCT = "nvidia.com/gpu.product"


def node_kind(node: Any) -> str:
    """``<instance type>/<GPU product>`` of a ``V1Node``."""
    labels = node.metadata.labels or {}
    instance = labels.get(INSTANCE_TYPE) or labels.get(INSTANCE_TYPE_BETA) or UNKNOWN
    return f"{instance}/{labels.get(GPU_PRODUCT) or UNKNOWN}"


def node_kinds(core_api: k8s.CoreV1Api, names: Iterable[str]) -> dict[str, str]:
    """Kind of each of ``names`` (one ``list_node`` call); ``unknown`` for a node the cluster no longer has."""
    kinds = {n.metadata.name: node_kind(n) for n in core_api.list_node().items}
    return {name: kinds.get(name, UNKNOWN) for name in names}
