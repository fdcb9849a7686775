"""The backends by name: ``backend_for(nodes)`` is the one place that reads ``nodes.backend``.

Each entry imports its backend when chosen: the local backend must load where
the ``kubernetes`` SDK is not installed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainyard.backends.backend import Backend
from trainyard.errors import SpecError
from trainyard.spec import KubernetesSpec, NodesSpec, models

Connect = Callable[[KubernetesSpec], Any]
"""Makes a ``kubernetes`` ``ApiClient`` for a cluster's settings (the Airflow layer's, from its connection)."""


def _local(nodes: NodesSpec, api_client: Any, connect: Connect | None) -> Backend:
    from trainyard.backends.local.backend import LocalBackend

    return LocalBackend(nodes)


def _kubernetes(nodes: NodesSpec, api_client: Any, connect: Connect | None) -> Backend:
    from trainyard.backends.kubernetes.backend import KubernetesBackend

    if nodes.kubernetes is None:  # the spec's checks require it with this backend
        raise SpecError(["nodes.kubernetes: required when nodes.backend is kubernetes (at least its image)"])
    return KubernetesBackend(nodes, nodes.kubernetes, api_client, connect)


BACKENDS: dict[str, Callable[[NodesSpec, Any, Connect | None], Backend]] = {"local": _local, "kubernetes": _kubernetes}
if set(BACKENDS) != set(models.BACKENDS):  # one vocabulary: a name the spec takes has a backend, and no other
    raise ImportError(
        f"backends {sorted(BACKENDS)} and the spec's nodes.backend names {sorted(models.BACKENDS)} differ"
    )


def backend_for(nodes: NodesSpec, api_client: Any | None = None, *, connect: Connect | None = None) -> Backend:
    """The backend ``nodes.backend`` names. ``api_client``: a ``kubernetes`` ``ApiClient`` for a cluster backend
    (the Airflow layer builds it from the spec's connection), needed once the backend calls the cluster
    (``SpecError`` then without one); ``connect`` makes one then instead. A local backend needs neither."""
    return BACKENDS[nodes.backend](nodes, api_client, connect)
