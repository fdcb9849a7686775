"""The pressure test on Kubernetes: one burn-in pod per candidate node, and marking the nodes it evicts.

Each pod is pinned to its candidate (required node affinity on the node's
``metadata.name``, which goes through the scheduler, unlike ``nodeName``, so
resources are still accounted) and runs the same ``trainyard.burnin.node``
protocol as a local candidate, against the store the orchestrator hosts at an
address the pods can reach, with its own per-run key in its environment
(``trainyard.burnin.sealing``). Pods run as the training pods do: same image,
resources, non-root read-only security context and hot-tier claim, so a node
is measured the way it will be used; of the hot tier they see only the
scratch folder of the disk probe.

A node the verdict evicts is marked with ``trainyard.backends.kubernetes.marks`` (the
``evicted_label``, and with ``evict_with: taint`` a NoSchedule taint of the
same key); the training Job's required node affinity keeps its pods off
labelled nodes. Its pod pieces are ``trainyard.backends.kubernetes.pods``, the same the
training pods have.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from trainyard.backends.kubernetes.marks import candidate_nodes, evicted_nodes, label_evicted, unlabel
from trainyard.backends.kubernetes.names import dns_label, label_value
from trainyard.backends.kubernetes.pods import (
    CONTAINER,
    PathMount,
    container_security_context,
    node_affinity,
    on_hosts,
    pod_account,
    pod_security_context,
    resources,
    scratch_env,
    token_account,
    tolerations,
    volumes,
)
from trainyard.burnin.args import NO_DRILL, Drill, node_args
from trainyard.burnin.sealing import KEY_ENV, node_key, run_secret
from trainyard.spec import KubernetesSpec, PressureTestSpec

if TYPE_CHECKING:  # burnin.protocol imports torch; the orchestrator has it, this module's callers may not
    from trainyard.burnin.protocol import BurnInRun, Schedule
    from trainyard.burnin.verdict import Recheck

__all__ = [  # the marks moved to trainyard.backends.kubernetes.marks; named here for callers from before
    "Drill",
    "PodCandidate",
    "build_burnin_pod",
    "burnin_pod_name",
    "candidate_nodes",
    "create_burnin_pods",
    "delete_burnin_pods",
    "evicted_nodes",
    "label_evicted",
    "node_args",
    "run_burn_in_k8s",
    "unlabel",
]

log = logging.getLogger(__name__)

LABEL_BURNIN = "trainyard.io/burnin"
LABEL_CANDIDATE = "trainyard.io/candidate"
# The pod deletes itself (activeDeadlineSeconds) this long after its own protocol timeout,
# so a pod the orchestrator forgot (its process died) never holds a node for long.
DEADLINE_SLACK_S = 60


def burnin_pod_name(run_id: str, node: str, store: str) -> str:
    """Unique per run, node and store: a retried pressure test hosts a new store, and a pod of the
    old try (pointing at the old store) must not be mistaken for the new one."""
    return dns_label(f"burnin-{run_id}-{node}", f"{run_id}|{node}|{store}")


def scratch_root(spec: KubernetesSpec, scratch: str) -> str:
    """Where the orchestrator sees the root of ``hot_pvc``: ``hot_mount`` (which must hold ``scratch``); without
    it, the scratch's parent (the pod then gets the folder of that name at the claim's root)."""
    if ".." in PurePosixPath(scratch).parts or not scratch.startswith("/"):
        raise ValueError(f"burn-in scratch {scratch!r}: must be an absolute path without '..'")
    if spec.hot_mount is None:
        return str(PurePosixPath(scratch).parent)
    if not PurePosixPath(scratch).is_relative_to(spec.hot_mount) or scratch.rstrip("/") == spec.hot_mount.rstrip("/"):
        raise ValueError(f"nodes.kubernetes.hot_mount: {spec.hot_mount} does not hold the burn-in scratch {scratch}")
    return spec.hot_mount


def eviction_toleration(spec: KubernetesSpec) -> k8s.V1Toleration:
    """Burn-in pods tolerate the eviction taint: re-testing a node is how it earns its way back."""
    return k8s.V1Toleration(key=spec.evicted_label, operator="Exists", effect="NoSchedule")


def build_burnin_pod(
    node: str,
    *,
    run_id: str,
    store: str,
    schedule: Schedule,
    cfg: PressureTestSpec,
    spec: KubernetesSpec,
    scratch: str,
    timeout_s: float,
    key: str,
    drill: Drill = NO_DRILL,
    launcher: tuple[str, str] | None = None,
) -> k8s.V1Pod:
    """The burn-in pod of candidate ``node`` (a Kubernetes node name); ``store`` is the orchestrator's host:port.

    ``run_id`` names the pod, so it must be unique across pipelines (``Run.holder``,
    ``dag_id/run_id``); ``timeout_s`` is the node's protocol timeout (``--timeout``);
    ``key`` the node's per-run key, in its environment (never in its arguments);
    ``launcher`` the account no pod may run as (see ``pod_account``).
    """
    account = pod_account(spec, launcher)
    vols, mounts = volumes(spec, scratch_root(spec, scratch) if spec.hot_pvc else None, [PathMount(scratch, False)])
    labels = {
        "app.kubernetes.io/name": "trainyard",
        "app.kubernetes.io/component": "burnin",
        LABEL_BURNIN: label_value(run_id),
        LABEL_CANDIDATE: label_value(node),
    }
    container = k8s.V1Container(
        name=CONTAINER,
        image=spec.image,
        # Explicit: the trainer image's entrypoint is torchrun.
        command=["python", "-m", "trainyard.burnin.node"],
        args=[a.replace("$", "$$") for a in node_args(node, store, schedule, cfg, scratch, timeout_s, drill)],
        env=[
            k8s.V1EnvVar(name="TRAINYARD_NODE", value=node.replace("$", "$$")),
            k8s.V1EnvVar(name="PYTHONUNBUFFERED", value="1"),
            *scratch_env(),
            # Per node and per run, worthless once the test ends (see trainyard.burnin.sealing).
            k8s.V1EnvVar(name=KEY_ENV, value=key),
        ],
        resources=resources(spec),
        volume_mounts=mounts,
        security_context=container_security_context(),
    )
    return k8s.V1Pod(
        api_version="v1",
        kind="Pod",
        metadata=k8s.V1ObjectMeta(
            name=burnin_pod_name(run_id, node, store),
            namespace=spec.namespace,
            labels=labels,
            annotations={"trainyard.io/run-id": run_id, "trainyard.io/node": node},
        ),
        spec=k8s.V1PodSpec(
            containers=[container],
            restart_policy="Never",
            active_deadline_seconds=math.ceil(timeout_s) + DEADLINE_SLACK_S,
            scheduler_name="volcano" if spec.scheduler == "volcano" else None,
            service_account_name=account,
            automount_service_account_token=None if account else False,
            enable_service_links=False,
            node_selector=dict(spec.node_selector) or None,
            tolerations=tolerations(spec, [eviction_toleration(spec)]),
            affinity=k8s.V1Affinity(node_affinity=node_affinity(match_fields=[on_hosts([node])])),
            security_context=pod_security_context(),
            volumes=vols,
        ),
    )


def create_burnin_pods(core_api: k8s.CoreV1Api, pods: Iterable[k8s.V1Pod]) -> list[str]:
    """Create the pods; one that exists already is this very try's (the name hashes the store) and is kept."""
    names = []
    for pod in pods:
        try:
            core_api.create_namespaced_pod(pod.metadata.namespace, pod)
        except ApiException as exc:
            if exc.status != 409:
                raise
            log.info("burn-in pod %s already exists; reusing it", pod.metadata.name)
        names.append(pod.metadata.name)
    return names


def delete_burnin_pods(core_api: k8s.CoreV1Api, namespace: str, names: Iterable[str]) -> None:
    """Delete the pods at once (grace 0: a hung probe must not hold the node); gone already is fine."""
    for name in names:
        try:
            core_api.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
        except ApiException as exc:
            if exc.status != 404:
                raise


class PodCandidate:
    """A burn-in pod, as the orchestrator's protocol sees a candidate."""

    def __init__(self, core_api: k8s.CoreV1Api, namespace: str, name: str):
        self.core, self.namespace, self.name = core_api, namespace, name

    def _pod(self) -> Any:
        try:
            return self.core.read_namespaced_pod(self.name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def alive(self) -> bool:
        pod = self._pod()  # a pod with no status yet is still being scheduled
        return pod is not None and (pod.status is None or pod.status.phase in ("Pending", "Running", None))

    def kill(self) -> None:
        delete_burnin_pods(self.core, self.namespace, [self.name])

    def why(self, default: str) -> str:
        pod = self._pod()
        if pod is None:
            return f"pod {self.name} is gone"
        status = pod.status
        for container in (status.container_statuses or []) if status else []:
            done = container.state and container.state.terminated
            if done and done.exit_code:
                return f"pod exited {done.exit_code}: {done.reason or ''} {(done.message or '').strip()[-200:]}".strip()
            waiting = container.state and container.state.waiting
            if waiting and waiting.reason:
                return f"pod waiting: {waiting.reason}"
        if status and status.phase == "Failed":
            return f"pod failed: {status.reason or 'no reason given'}"
        return default


def run_burn_in_k8s(
    core_api: k8s.CoreV1Api,
    nodes: list[str],
    cfg: PressureTestSpec,
    spec: KubernetesSpec,
    run_id: str,
    scratch: str,
    drills: dict[str, tuple[str, float]],
    store_host: str,
    recheck: Callable[[BurnInRun], Recheck] | None = None,
) -> BurnInRun:
    """One pinned pod per candidate node, driven through the same protocol as local candidates."""
    from trainyard.burnin.protocol import STARTUP_S, Schedule, host_store, run_protocol

    plan = Schedule.of(cfg, len(nodes))
    store = host_store("0.0.0.0")  # the pods reach it over the cluster network
    endpoint = f"{store_host}:{store.port}"
    secret = run_secret()
    keys = {node: node_key(secret, node) for node in nodes}
    launcher = token_account(core_api.api_client)
    if spec.hot_pvc and spec.hot_mount:  # the orchestrator's path is the pods' folder: make it, not the kubelet (root)
        Path(scratch).mkdir(parents=True, exist_ok=True)
    pods = [
        build_burnin_pod(
            node,
            run_id=run_id,
            store=endpoint,
            schedule=plan,
            cfg=cfg,
            spec=spec,
            scratch=scratch,
            timeout_s=plan.budget(cfg),
            key=keys[node],
            drill=Drill(*drills.get(node, ("none", 0.0))),
            launcher=launcher,
        )
        for node in nodes
    ]
    names = create_burnin_pods(core_api, pods)
    candidates = {node: PodCandidate(core_api, spec.namespace, name) for node, name in zip(nodes, names)}
    # Pods may pull an image and wait for the scheduler: give them the spec's timeout to start, at least.
    return run_protocol(store, candidates, cfg, max(STARTUP_S, cfg.timeout_s), keys, recheck)
