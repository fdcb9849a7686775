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
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from trainyard.atomic import write_text_atomic
from trainyard.backends.base import AttemptStatus, LaunchPlan, NodeStatus
from trainyard.backends.kubernetes import api
from trainyard.backends.kubernetes.marks import label_evicted
from trainyard.backends.kubernetes.models import k8s
from trainyard.backends.kubernetes.names import (
    LABEL_NODE,
    STORE_PORT,
    label_value,
    object_name,
    rendezvous_endpoint,
    store_endpoint,
    store_name,
)
from trainyard.backends.kubernetes.objects import build_objects
from trainyard.backends.kubernetes.paths import prepare_paths
from trainyard.backends.kubernetes.pods import CONTAINER, token_account
from trainyard.backends.kubernetes.regroup import build_in_place, node_pod
from trainyard.backends.kubernetes.status import attempt_status, pod_message, pods_by_index
from trainyard.backends.kubernetes.store import PodStore
from trainyard.spec import KubernetesSpec

log = logging.getLogger(__name__)


@dataclass
class KubernetesHandle:
    plan: LaunchPlan
    namespace: str
    name: str
    podgroup: bool
    in_place: bool = False
    """Bare pods per node and a coordinator pod (``regroup``), not a Job: nodes can leave and join."""
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
        ns, in_place = self.spec.namespace, bool(plan.train_env.store)
        handle = KubernetesHandle(plan, ns, object_name(plan), podgroup=self.spec.scheduler == "volcano",
                                  in_place=in_place)  # fmt: skip
        plan.log_dir.mkdir(parents=True, exist_ok=True)
        if self.spec.hot_pvc:
            prepare_paths(plan)
        self.active.append(handle)
        try:
            if in_place:
                self.serve_store(plan)  # served before the first generation was published: kept
                whole = build_in_place(plan, self.spec, self.account)
                nodes_only = replace(whole, coordinator=None, service=None, secret=None)
                adopted = api.drive(self, api.create_in_place(ns, nodes_only))
            else:
                objects = build_objects(plan, self.spec, self.account)
                adopted = api.drive(self, api.create(ns, objects.job, objects.service, objects.podgroup))
        except Exception:
            self.cancel(handle)  # leave nothing half-made behind
            raise
        for kind in adopted:
            log.info("a %s of %s already exists; adopted it", kind, handle.name)
        if in_place:
            log.info("attempt %d: %d pod(s) in place, grouping on the store at %s",
                     plan.attempt, len(plan.nodes), plan.train_env.store)  # fmt: skip
            return handle
        log.info(
            "attempt %d: Job %s/%s with %d pod(s), rendezvous on %s",
            plan.attempt,
            ns,
            handle.name,
            len(plan.nodes),
            rendezvous_endpoint(handle.name, ns, self.spec.cluster_domain),
        )
        return handle

    def describe(self, handle: KubernetesHandle) -> dict[str, Any]:
        """What the attempt trigger (``airflow.triggers.KubernetesAttemptTrigger``) needs of the handle, and of
        the cluster: how often it polls, and the Airflow connection it calls the API through."""
        return {"namespace": handle.namespace, "name": handle.name, "podgroup": handle.podgroup,
                "poll_s": self.spec.poll_s, "connection": self.spec.connection}  # fmt: skip

    def attach(self, plan: LaunchPlan) -> KubernetesHandle:
        """The handle of ``plan``'s attempt, launched earlier (by another process: a task resumed after deferring)."""
        name = object_name(plan)
        known = next((h for h in self.active if (h.namespace, h.name) == (self.spec.namespace, name)), None)
        if known is not None:
            known.plan = plan  # in place, the group's nodes change while the attempt runs: the latest plan's
            return known
        handle = KubernetesHandle(plan, self.spec.namespace, name, podgroup=self.spec.scheduler == "volcano",
                                  in_place=bool(plan.train_env.store))  # fmt: skip
        self.active.append(handle)
        return handle

    def poll(self, handle: KubernetesHandle) -> AttemptStatus:
        pods, job_reason = api.drive(self, api.look(handle.namespace, handle.name, handle.in_place))
        now = time.time()  # one clock for every pod of this look
        best = pods_by_index(pods, handle.plan.nodes, now)
        status = attempt_status([p for p, _ in best.values()], handle.plan.nodes, job_reason, now, handle.in_place)
        nodes = [self._with_evidence(handle, i, best.get(i, (None, None))[0], s) for i, s in enumerate(status.nodes)]
        return AttemptStatus(nodes)

    def _with_evidence(self, handle: KubernetesHandle, index: int, pod: Any, status: NodeStatus) -> NodeStatus:
        """Save a finished pod's log once into the attempt's log folder, as the local backend's node logs are.

        Fetched when the pod ends, because cancel deletes the Job and its pods' logs with it.
        """
        if status.state == "running" or pod is None:
            return status
        if index not in handle.logs:
            head = (
                f"# pod {pod.metadata.name} on node {status.host or '(not placed)'}: {status.state}"
                f" exit={status.exit_code} reason={status.reason or '-'} {pod_message(pod)}".rstrip()
            )
            handle.logs[index] = str(self._save_log(handle, pod, head))
        return replace(status, log=handle.logs[index])

    def _keep_logs(self, handle: KubernetesHandle) -> None:
        """Save the log so far of every pod of the attempt whose log is not saved yet, before the delete takes it.

        An attempt ends on its first failed pod; the others are often still running, and one of them may be
        the node whose fault it was (an OOM still tearing down, its traceback already written): without this
        its evidence went with the pod. One list and a log read per such pod, once per attempt.
        """
        pods, _ = api.drive(self, api.look(handle.namespace, handle.name, handle.in_place))
        for pod in pods:
            if self._log_path(handle, pod).exists():  # saved when the pod ended (``_with_evidence``)
                continue
            phase = (pod.status.phase if pod.status is not None else None) or "Pending"
            where = pod.spec.node_name or "(not placed)"
            self._save_log(handle, pod, f"# pod {pod.metadata.name} on node {where}: {phase} when the attempt ended")

    @staticmethod
    def _log_path(handle: KubernetesHandle, pod: Any) -> Path:
        return handle.plan.log_dir / f"{pod.metadata.name}.log"

    def _save_log(self, handle: KubernetesHandle, pod: Any, head: str) -> Path:
        """The pod's container log (its last ``log_lines``) under ``head``, written whole into the attempt's log
        folder (never through a link a pod planted); its path."""
        text = api.call(self, api.pod_log(pod.metadata.name, pod.metadata.namespace, CONTAINER, self.log_lines))
        path = self._log_path(handle, pod)
        write_text_atomic(path, f"{head}\n{text}" if text.endswith("\n") else f"{head}\n{text}\n")
        return path

    def cancel(self, handle: KubernetesHandle, grace_s: float | None = None) -> None:
        """Delete the attempt's Job (with its pods), Service and PodGroup, or its in-place pods, store and keys
        (``api.delete``); safe to call twice. The logs of pods still running go first (``_keep_logs``). The pods
        get their own termination grace whatever ``grace_s`` says: the next attempt's pods need not wait for them."""
        self._keep_logs(handle)
        api.drive(self, api.delete(handle.namespace, handle.name, handle.podgroup, handle.in_place))
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

    # ------------------------------------------------------------ in place (a ``RegroupingLauncher``)

    def kill_nodes(self, handle: KubernetesHandle, nodes: list[str]) -> None:
        """Delete these nodes' pods with no grace (a hung rank must close its sockets); the others run on."""
        gone = api.drive(self, api.kill_pods(handle.namespace, handle.name, nodes))
        log.info("attempt %d: deleted %s", handle.plan.attempt, ", ".join(gone) or "no pod (gone already)")

    def add_nodes(self, handle: KubernetesHandle, nodes: list[str]) -> None:
        """A new pod for each of ``nodes`` in the running attempt, pinned to its host (a joiner: it waits on the
        store); a node whose pod still runs is left alone (``kill_nodes`` it first)."""
        pods = api.call(self, api.list_pods(handle.namespace, handle.name))
        live = {
            (p.metadata.labels or {}).get(LABEL_NODE)
            for p in pods
            if p.metadata.deletion_timestamp is None
            and (p.status is None or p.status.phase in (None, "Pending", "Running"))
        }
        for node in nodes:
            if label_value(node) in live:
                continue
            pod = node_pod(handle.plan, self.spec, node, self.account, fresh=True)
            api.drive(self, api.create_pod(handle.namespace, pod))
            log.info("attempt %d: pod %s for %s", handle.plan.attempt, pod.metadata.name, node)

    def coordination_store(
        self,
        secrets_dir: Path,
        nodes: list[str],
        plan_for: Callable[[int], LaunchPlan],
        on_refused: Callable[[int, str, str], None] | None = None,
    ) -> PodStore:
        """The stores of a run's in-place attempts: a coordinator pod each (``base.ServesStores``)."""
        return PodStore(self, secrets_dir, nodes, plan_for, on_refused)

    def store_endpoint(self, plan: LaunchPlan) -> str:
        """``host:port`` the ranks of ``plan``'s attempt dial: its store's Service by DNS name."""
        return store_endpoint(object_name(plan), self.spec.namespace, self.spec.cluster_domain)

    def serve_store(self, plan: LaunchPlan) -> str:
        """Make sure ``plan``'s attempt has its store (keys' Secret, Service, coordinator pod; kept if there) and
        return the address this process dials: the Service's cluster IP (no cluster DNS needed here)."""
        ns, name = self.spec.namespace, object_name(plan)
        address = api.call(self, api.service_address(ns, store_name(name), STORE_PORT))
        if address is None:
            whole = build_in_place(replace(plan, nodes=[]), self.spec, self.account)
            api.drive(self, api.create_in_place(ns, replace(whole, podgroup=None)))  # the store's objects only
            address = api.call(self, api.service_address(ns, store_name(name), STORE_PORT))
        if address is None:
            raise RuntimeError(f"Service {ns}/{store_name(name)} has no cluster IP; in-place recovery needs one")
        return address
