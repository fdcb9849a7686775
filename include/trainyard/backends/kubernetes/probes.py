"""The pressure test's probes on Kubernetes: one burn-in pod per candidate node (``KubernetesProbes``).

Each pod is pinned to its candidate (required node affinity on the node's
``metadata.name``, which goes through the scheduler, unlike ``nodeName``, so
resources are still accounted) and runs the ``trainyard.burnin.node`` protocol
the pressure test gives it, against the store the orchestrator hosts at an
address the pods can reach, with its per-run key in its environment. Pods run
as the training pods do: same image, resources, non-root read-only security
context and hot-tier claim (``trainyard.backends.kubernetes.pods``), so a node
is measured the way it will be used; of the hot tier they see only the scratch
folder of the disk probe. They tolerate the eviction taint: re-testing a
marked node is how it earns its way back.
"""

from __future__ import annotations

import logging
import math
import socket
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from kubernetes.client.exceptions import ApiException

from trainyard.backends.backend import Candidate, Probe, ProbeRun
from trainyard.backends.kubernetes.models import k8s
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
from trainyard.spec import KubernetesSpec

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


def probe_pod(
    node: str,
    args: list[str],
    env: Mapping[str, str],
    *,
    run: ProbeRun,
    spec: KubernetesSpec,
    launcher: tuple[str, str] | None = None,
) -> k8s.V1Pod:
    """The burn-in pod of candidate ``node`` (a Kubernetes node name): ``python -m trainyard.burnin.node ARGS``.

    ``run.run_id`` names the pod, so it must be unique across pipelines (``Run.holder``,
    ``dag_id/run_id``); ``run.timeout_s`` is the node's protocol timeout; ``env`` its
    secrets (the per-run key: in its environment, never in its arguments);
    ``launcher`` the account no pod may run as (see ``pod_account``).
    """
    account = pod_account(spec, launcher)
    scratch = run.scratch
    vols, mounts = volumes(spec, scratch_root(spec, scratch) if spec.hot_pvc else None, [PathMount(scratch, False)])
    labels = {
        "app.kubernetes.io/name": "trainyard",
        "app.kubernetes.io/component": "burnin",
        LABEL_BURNIN: label_value(run.run_id),
        LABEL_CANDIDATE: label_value(node),
    }
    container = k8s.V1Container(
        name=CONTAINER,
        image=spec.image,
        # Explicit: the trainer image's entrypoint is torchrun.
        command=["python", "-m", "trainyard.burnin.node"],
        args=[_literal(a) for a in args],
        env=[
            k8s.V1EnvVar(name="TRAINYARD_NODE", value=_literal(node)),
            k8s.V1EnvVar(name="PYTHONUNBUFFERED", value="1"),
            *scratch_env(),
            *(k8s.V1EnvVar(name=k, value=_literal(v)) for k, v in env.items()),
        ],
        resources=resources(spec),
        volume_mounts=mounts,
        security_context=container_security_context(),
    )
    return k8s.V1Pod(
        api_version="v1",
        kind="Pod",
        metadata=k8s.V1ObjectMeta(
            name=burnin_pod_name(run.run_id, node, run.store),
            namespace=spec.namespace,
            labels=labels,
            annotations={"trainyard.io/run-id": run.run_id, "trainyard.io/node": node},
        ),
        spec=k8s.V1PodSpec(
            containers=[container],
            restart_policy="Never",
            active_deadline_seconds=math.ceil(run.timeout_s) + DEADLINE_SLACK_S,
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


def _literal(text: str) -> str:
    # Kubernetes expands $(VAR) in args and env values, and "$$" to "$": doubling keeps the text as given.
    return text.replace("$", "$$")


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


class KubernetesProbes:
    """Pods reach the orchestrator's store over the cluster network, and may wait for an image and the scheduler."""

    bind = "0.0.0.0"
    shared = False

    def __init__(self, core_api: k8s.CoreV1Api, spec: KubernetesSpec) -> None:
        self.core, self.spec = core_api, spec

    def reach(self) -> str:
        return self.spec.store_host or socket.gethostbyname(socket.gethostname())

    def scratch(self, hot_root: Path) -> str:
        return str(hot_root / ".burnin")

    def startup_s(self, default_s: float, timeout_s: float) -> float:
        return max(default_s, timeout_s)  # give the pods the spec's timeout to start, at least

    def start(self, probes: Sequence[Probe], run: ProbeRun) -> dict[str, Candidate]:
        launcher = token_account(self.core.api_client)
        if self.spec.hot_pvc and self.spec.hot_mount:  # the orchestrator's path is the pods' folder: make it, not
            Path(run.scratch).mkdir(parents=True, exist_ok=True)  # the kubelet (root)
        pods = [probe_pod(p.node, p.args, p.env, run=run, spec=self.spec, launcher=launcher) for p in probes]
        names = create_burnin_pods(self.core, pods)
        return {p.node: PodCandidate(self.core, self.spec.namespace, name) for p, name in zip(probes, names)}
