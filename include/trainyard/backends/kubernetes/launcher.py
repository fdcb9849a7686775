"""The Kubernetes training launcher: create, watch and delete an attempt's objects (``KubernetesLauncher``).

The objects are ``trainyard.backends.kubernetes.objects``'s; every API call is
a request of ``trainyard.backends.kubernetes.api``, the same ones the
deferrable trigger (``trainyard.airflow.triggers.KubernetesAttemptTrigger``,
the counterpart of the provider's ``KubernetesJobTrigger``) sends with the
async client. Pods are read as ``NodeStatus`` records with
``trainyard.backends.kubernetes.status``, so the supervisor reads the same
records whichever backend or waiter produced them; recovery blames, marks and
replaces the hosts they name.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

from kubernetes import client as k8s

from trainyard.atomic import write_text_atomic
from trainyard.backends.base import AttemptStatus, LaunchPlan, NodeStatus
from trainyard.backends.kubernetes import api
from trainyard.backends.kubernetes.marks import label_evicted
from trainyard.backends.kubernetes.names import object_name, rendezvous_endpoint
from trainyard.backends.kubernetes.objects import build_objects
from trainyard.backends.kubernetes.paths import prepare_paths
from trainyard.backends.kubernetes.pods import CONTAINER, token_account
from trainyard.backends.kubernetes.status import attempt_status, pod_message, pods_by_index
from trainyard.spec import KubernetesSpec

log = logging.getLogger(__name__)


@dataclass
class KubernetesHandle:
    plan: LaunchPlan
    namespace: str
    name: str
    podgroup: bool
    logs: dict[int, str] = field(default_factory=dict)
    """Evidence file written per completion index, once its pod finished."""


class KubernetesLauncher:
    """``launch`` / ``poll`` / ``cancel`` over the Kubernetes API, with a ``kubernetes.client.ApiClient``.

    Its ``core``, ``batch`` and ``custom`` API objects make it the ``api.Apis`` its requests are sent to.
    """

    reattaches = True
    """An attempt's Job outlives the task process that created it; its name comes from the plan."""

    def __init__(self, api_client: k8s.ApiClient, spec: KubernetesSpec, log_lines: int = 200) -> None:
        self.account = token_account(api_client)
        """The launcher's own service account, if it calls the API as one: no pod may run as it."""
        self.core: Any = k8s.CoreV1Api(api_client)
        self.batch: Any = k8s.BatchV1Api(api_client)
        self.custom: Any = k8s.CustomObjectsApi(api_client)
        self.spec = spec
        self.log_lines = log_lines
        self.active: list[KubernetesHandle] = []
        """Attempts launched and not yet cancelled, so ``cancel_all`` can end them on a kill."""

    def launch(self, plan: LaunchPlan) -> KubernetesHandle:
        """Create the attempt's objects (``api.create``: the Job last, so its pods find the others).

        An object that already exists is adopted: names are derived from the plan,
        so it is this attempt's own, left by a launch interrupted half-way.
        """
        objects = build_objects(plan, self.spec, self.account)
        ns = self.spec.namespace
        handle = KubernetesHandle(plan, ns, objects.name, podgroup=objects.podgroup is not None)
        plan.log_dir.mkdir(parents=True, exist_ok=True)
        if self.spec.hot_pvc:
            prepare_paths(plan)
        self.active.append(handle)
        try:
            adopted = api.drive(self, api.create(ns, objects.job, objects.service, objects.podgroup))
        except Exception:
            self.cancel(handle)  # leave nothing half-made behind
            raise
        for kind in adopted:
            log.info("%s %s already exists; adopted it", kind, objects.name)
        log.info(
            "attempt %d: Job %s/%s with %d pod(s), rendezvous on %s",
            plan.attempt,
            ns,
            objects.name,
            len(plan.nodes),
            rendezvous_endpoint(objects.name, ns, self.spec.cluster_domain),
        )
        return handle

    def attach(self, plan: LaunchPlan) -> KubernetesHandle:
        """The handle of ``plan``'s attempt, launched earlier (by another process: a task resumed after deferring)."""
        name = object_name(plan)
        known = next((h for h in self.active if (h.namespace, h.name) == (self.spec.namespace, name)), None)
        if known is not None:
            return known
        handle = KubernetesHandle(plan, self.spec.namespace, name, podgroup=self.spec.scheduler == "volcano")
        self.active.append(handle)
        return handle

    def poll(self, handle: KubernetesHandle) -> AttemptStatus:
        pods, job_reason = api.drive(self, api.look(handle.namespace, handle.name))
        now = time.time()  # one clock for every pod of this look
        best = pods_by_index(pods, handle.plan.nodes, now)
        status = attempt_status([pod for pod, _ in best.values()], handle.plan.nodes, job_reason, now)
        nodes = [self._with_evidence(handle, i, best.get(i, (None, None))[0], s) for i, s in enumerate(status.nodes)]
        return AttemptStatus(nodes)

    def _with_evidence(self, handle: KubernetesHandle, index: int, pod: Any, status: NodeStatus) -> NodeStatus:
        """Save a finished pod's log once into the attempt's log folder, as the local backend's node logs are.

        Fetched when the pod ends, because cancel deletes the Job and its pods' logs with it.
        """
        if status.state == "running" or pod is None:
            return status
        if index not in handle.logs:
            path = handle.plan.log_dir / f"{pod.metadata.name}.log"
            write_text_atomic(path, self._evidence(pod, status))  # never through a link a pod planted
            handle.logs[index] = str(path)
        return replace(status, log=handle.logs[index])

    def _evidence(self, pod: Any, status: NodeStatus) -> str:
        head = (
            f"# pod {pod.metadata.name} on node {status.host or '(not placed)'}: {status.state}"
            f" exit={status.exit_code} reason={status.reason or '-'} {pod_message(pod)}".rstrip()
        )
        text = api.call(self, api.pod_log(pod.metadata.name, pod.metadata.namespace, CONTAINER, self.log_lines))
        return f"{head}\n{text}" if text.endswith("\n") else f"{head}\n{text}\n"

    def cancel(self, handle: KubernetesHandle) -> None:
        """Delete the attempt's Job (with its pods), Service and PodGroup (``api.delete``); safe to call twice."""
        api.drive(self, api.delete(handle.namespace, handle.name, handle.podgroup))
        if handle in self.active:
            self.active.remove(handle)

    def exclude(self, nodes: list[str]) -> list[str]:
        """Mark the hosts ``nodes`` evicted, as the pressure test marks a weak node: later attempts are pinned
        to other hosts anyway, and the mark (``not_evicted`` affinity) keeps every other run of trainyard
        off them too. A later burn-in re-tests it after the cool-down (``trainyard.backends.kubernetes.cooldown``)
        and clears the mark when it passes; a person may clear it sooner
        (``kubectl label node NODE trainyard.io/evicted-``)."""
        return label_evicted(self.core, nodes, self.spec.evicted_label, self.spec.evict_with)

    def cancel_all(self) -> None:
        for handle in list(self.active):
            self.cancel(handle)
