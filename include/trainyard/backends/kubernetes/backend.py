"""The Kubernetes backend: nodes are cluster nodes, run as pods; evicted ones carry a label (and taint).

Its candidates are the schedulable nodes of ``node_selector`` without the
eviction label (``marks.candidate_nodes``); a node trainyard marked is offered
again once its cool-down has passed (``cooldown.due_for_retest``), and the mark
is its record, not the fleet history.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from trainyard.backends.backend import History, Pool
from trainyard.backends.kubernetes.cooldown import due_for_retest
from trainyard.backends.kubernetes.kinds import node_kinds
from trainyard.backends.kubernetes.launcher import KubernetesLauncher
from trainyard.backends.kubernetes.marks import candidate_nodes, label_evicted, unlabel
from trainyard.backends.kubernetes.models import k8s
from trainyard.backends.kubernetes.probes import KubernetesProbes
from trainyard.errors import NodeUnhealthy, SpecError
from trainyard.spec import KubernetesSpec, NodesSpec

TRIGGER = "trainyard.airflow.triggers.KubernetesAttemptTrigger"
"""The trigger of its deferred attempts (in the Airflow layer, above this one: named, not imported)."""


class KubernetesBackend:
    name = "kubernetes"

    def __init__(
        self,
        nodes: NodesSpec,
        spec: KubernetesSpec,
        api_client: Any | None = None,
        connect: Callable[[KubernetesSpec], Any] | None = None,
    ) -> None:
        self.nodes, self.spec, self._client, self._connect = nodes, spec, api_client, connect
        self.defers = spec.deferrable
        self.wake_every_s: float | None = spec.wake_every_s if spec.deferrable else None
        self.trigger: str | None = TRIGGER if spec.deferrable else None
        self.marks: str | None = spec.evicted_label
        self.snapshot_root: Path | None = None  # a relaunch schedules its pods again: their memory is gone

    @property
    def api_client(self) -> Any:
        """The ``kubernetes`` ``ApiClient``; what the backend says of itself (``defers``, ``marks``) needs none."""
        if self._client is None and self._connect is not None:
            self._client = self._connect(self.spec)
        if self._client is None:
            raise SpecError(
                [
                    "nodes.backend: kubernetes needs an API client from the Airflow layer"
                    " (the task builds one from nodes.kubernetes.connection)"
                ]
            )
        return self._client

    @cached_property
    def core(self) -> k8s.CoreV1Api:
        return k8s.CoreV1Api(self.api_client)

    def candidates(self) -> list[str]:
        names = candidate_nodes(self.core, self.spec, self.nodes.count + self.nodes.spare)
        if len(names) < self.nodes.min:
            raise NodeUnhealthy(
                f"the cluster has {len(names)} usable node(s) (node_selector, not evicted); nodes.min is"
                f" {self.nodes.min}"
            )
        return names

    def pool(self, history: History, now: float, cooldown_s: float) -> Pool:
        names = self.candidates()
        retest = due_for_retest(self.core, self.spec, cooldown_s, datetime.fromtimestamp(now, UTC))
        return Pool([*names, *(n for n in retest if n not in names)], retest)

    def kinds(self, nodes: Sequence[str]) -> dict[str, str]:
        return node_kinds(self.core, nodes)

    def probe_site(self) -> KubernetesProbes:
        return KubernetesProbes(self.core, self.spec)

    def launcher(self) -> KubernetesLauncher:
        return KubernetesLauncher(self.api_client, self.spec)

    def exclude(self, nodes: Sequence[str], reasons: Mapping[str, str] | None = None) -> list[str]:
        return label_evicted(self.core, list(nodes), self.spec.evicted_label, self.spec.evict_with, reasons=reasons)

    def readmit(self, nodes: Sequence[str]) -> list[str]:
        return unlabel(self.core, list(nodes), self.spec.evicted_label)
