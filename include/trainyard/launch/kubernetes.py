"""Kubernetes backend: one attempt is an Indexed Job, a headless Service and (with Volcano) a PodGroup.

This module owns two things:

* the **objects** of an attempt, built by pure functions from a ``LaunchPlan``
  and the spec's ``KubernetesSpec`` (``build_objects``), as ``kubernetes``
  client models, so they can be checked against the official schema with no
  cluster;
* the **launcher** (``KubernetesLauncher``) that creates, watches and deletes
  them, and the pure mapping from pods to ``NodeStatus`` records
  (``attempt_status``) that the deferrable trigger shares, so the supervisor
  reads the same records whichever backend or waiter produced them.

Pod *i* of the Job is node *i* of the attempt: it runs one torchrun agent
(``python -m torch.distributed.run``) with ``--node-rank=$(JOB_COMPLETION_INDEX)``
and meets the others through c10d rendezvous on pod 0, reached by its stable
DNS name ``<job>-0.<service>.<namespace>.svc.<domain>`` (an Indexed Job gives
pod *i* the hostname ``<job>-<i>``; the headless Service and the pods'
``subdomain`` give that hostname a DNS record).

How this lines up with the cncf-kubernetes provider: its ``KubernetesJobOperator``
builds the same ``kubernetes.client.V1Job`` from ``parallelism``,
``completions``, ``completion_mode="Indexed"`` and ``backoff_limit``; we set
exactly those (parallelism = completions = nodes, Indexed, backoffLimit 0)
but build the Job here, because the library never imports Airflow (DESIGN
rule 2) and because the operator owns one pod per task and renames the Job
(``job-`` prefix, random suffix), while the rendezvous endpoint needs a name
known before the Job exists. The Airflow layer waits for the attempt with
``trainyard.airflow.triggers.KubernetesAttemptTrigger``, the counterpart of
the provider's ``KubernetesJobTrigger``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from kubernetes.utils import parse_quantity

from trainyard.atomic import write_text_atomic
from trainyard.launch.base import AttemptStatus, LaunchPlan, NodeStatus
from trainyard.spec import LAUNCHER_SERVICE_ACCOUNT, KubernetesSpec

log = logging.getLogger(__name__)

RDZV_PORT = 29400
CONTAINER = "trainer"
GPU_RESOURCE = "nvidia.com/gpu"
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
GROUP_NAME_ANNOTATION = "scheduling.k8s.io/group-name"
RUN_ID_ANNOTATION = "trainyard.io/run-id"
LABEL_APP = "app.kubernetes.io/name"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_JOB = "trainyard.io/job"
LABEL_RUN = "trainyard.io/run"
LABEL_ATTEMPT = "trainyard.io/attempt"
PODGROUP_GROUP, PODGROUP_VERSION, PODGROUP_PLURAL = "scheduling.volcano.sh", "v1beta1", "podgroups"
HOT_VOLUME, SHM_VOLUME, TMP_VOLUME = "hot", "dshm", "tmp"
RUN_AS_USER = 1000  # the trainer image's user (docker/Dockerfile.trainer)
# The launcher's own service account (docker/k8s/launcher-rbac.yaml): it may create pods and
# mark nodes, so no pod it creates may run as it.
LAUNCHER_ACCOUNT = LAUNCHER_SERVICE_ACCOUNT  # the one name, in the spec models: the spec refuses it too
# What each path of the training contract is to a pod: only these are mounted, each at the
# orchestrator's own path (so a path in the ledger means the same file everywhere).
WRITABLE_DIRS = ("TRAINYARD_CHECKPOINT_DIR", "TRAINYARD_HEARTBEAT_DIR")  # checkpoints (LATEST too), heartbeats
WRITABLE_FILES = ("TRAINYARD_LEDGER",)  # rank 0 appends train events; the run folder itself is not mounted
READ_ONLY_DIRS = ("TRAINYARD_DATA_DIR",)  # the staged dataset
# Pod hostnames are "<job>-<index>" and must fit a 63-character DNS label; an index
# has at most 3 digits (nodes.count <= 512), and pod names add a 6-character suffix.
MAX_JOB_NAME = 52
# A finished Job the supervisor did not delete (its process died) cleans itself up
# after a day; long enough for a deferred waiter to read the pods' final states.
TTL_AFTER_FINISHED_S = 24 * 3600

# Reasons a pod carries in status.reason when Kubernetes itself ended it.
POD_FAILURE_REASONS = frozenset(
    {
        "Evicted",
        "NodeLost",
        "DeadlineExceeded",
        "UnexpectedAdmissionError",
        "Shutdown",
        "NodeShutdown",
        "Terminated",
        "Preempting",
    }
)
# Container waiting reasons that will not resolve by waiting: with backoffLimit 0 and
# restartPolicy Never the attempt is lost, so it is reported now instead of after a timeout.
FAILED_WAITING_REASONS = frozenset(
    {
        "ImagePullBackOff",
        "ErrImageNeverPull",
        "InvalidImageName",
        "CrashLoopBackOff",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)
_STATE_RANK = {"running": 0, "succeeded": 1, "failed": 2}
_TOLERATION_KEYS = {
    "key": "key",
    "operator": "operator",
    "value": "value",
    "effect": "effect",
    "tolerationSeconds": "toleration_seconds",
}


# ---------------------------------------------------------------- names


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


def rendezvous_endpoint(name: str, namespace: str, cluster_domain: str = "cluster.local") -> str:
    """``host:port`` of pod 0, which hosts the c10d store: its per-pod DNS name under the headless Service."""
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


# ---------------------------------------------------------------- pod pieces


def _literal(text: str) -> str:
    # Kubernetes expands $(VAR) in command, args and env values, and "$$" to "$":
    # doubling every "$" keeps the plan's text exactly as the local backend passes it.
    return text.replace("$", "$$")


def torchrun_args(plan: LaunchPlan, endpoint: str) -> list[str]:
    """Arguments after ``python -m torch.distributed.run``; the same on every pod (the index varies)."""
    return [
        f"--nnodes={len(plan.nodes)}",
        f"--nproc-per-node={plan.procs_per_node}",
        "--node-rank=$(JOB_COMPLETION_INDEX)",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        _literal(f"--rdzv-id={plan.run_id}-a{plan.attempt}"),
        "--max-restarts=0",  # restarts are the supervisor's decision, not torchrun's
        *(_literal(arg) for arg in plan.entry_argv()),
    ]


def training_env(plan: LaunchPlan) -> list[k8s.V1EnvVar]:
    """The plan's TRAINYARD_* contract, plus the node identity and index from the pod itself."""
    return [
        # Declared here so "$(JOB_COMPLETION_INDEX)" in args expands (the Job controller
        # injects the same variable, and leaves a declared one alone).
        k8s.V1EnvVar(
            name="JOB_COMPLETION_INDEX",
            value_from=k8s.V1EnvVarSource(
                field_ref=k8s.V1ObjectFieldSelector(field_path=f"metadata.annotations['{INDEX_ANNOTATION}']")
            ),
        ),
        # The node is only known once scheduled: the downward API gives the Kubernetes node name.
        k8s.V1EnvVar(
            name="TRAINYARD_NODE",
            value_from=k8s.V1EnvVarSource(field_ref=k8s.V1ObjectFieldSelector(field_path="spec.nodeName")),
        ),
        k8s.V1EnvVar(name="PYTHONUNBUFFERED", value="1"),  # pod logs are the node's evidence
        *(k8s.V1EnvVar(name=key, value=_literal(value)) for key, value in plan.env.items() if key != "TRAINYARD_NODE"),
    ]


@dataclass(frozen=True)
class PathMount:
    """One path of the plan a pod sees: a folder (or the ledger file) of the hot tier."""

    path: str
    read_only: bool


def attempt_paths(plan: LaunchPlan) -> list[PathMount]:
    """What an attempt's pods may see of the hot tier, and which of it they may write.

    Its heartbeat folder, its lineage's checkpoint folder and the run's ledger
    file read-write; its dataset (and a ``resume_from`` path outside the
    checkpoint folder) read-only. Nothing else: not the run folder (its pinned
    spec and report), not other pipelines' checkpoints or locks.
    """
    env = plan.env
    mounts = [PathMount(env[k], False) for k in (*WRITABLE_DIRS, *WRITABLE_FILES) if k in env]
    mounts += [PathMount(env[k], True) for k in READ_ONLY_DIRS if k in env]
    if env.get("TRAINYARD_RESUME_FROM", "").startswith("/"):
        mounts.append(PathMount(env["TRAINYARD_RESUME_FROM"], True))
    for m in mounts:
        if not m.path.startswith("/") or ".." in PurePosixPath(m.path).parts:
            raise ValueError(f"launch plan: {m.path!r} must be an absolute path without '..' to be mounted in a pod")
    return _covering(mounts)


def _covering(mounts: list[PathMount]) -> list[PathMount]:
    """Drop a mount another one already grants (inside a writable one, or read-only inside a read-only one)."""
    keep: list[PathMount] = []
    for m in sorted(mounts, key=lambda m: (len(PurePosixPath(m.path).parts), m.read_only, m.path)):
        if not any(PurePosixPath(m.path).is_relative_to(k.path) and (m.read_only or not k.read_only) for k in keep):
            keep.append(m)
    return keep


def hot_mount_path(plan: LaunchPlan, spec: KubernetesSpec) -> str:
    """Where the orchestrator sees the root of ``hot_pvc``: ``spec.hot_mount``, else the deepest folder the
    plan's paths share. Pods mount folders of the claim (``subPath``) at the same paths, so they mean the
    same thing there.
    """
    folders = [
        PurePosixPath(m.path) if m.path != plan.env.get("TRAINYARD_LEDGER") else PurePosixPath(m.path).parent
        for m in attempt_paths(plan)
    ]
    if spec.hot_mount:
        outside = [str(f) for f in folders if not f.is_relative_to(spec.hot_mount)]
        if outside:
            raise ValueError(f"nodes.kubernetes.hot_mount: {spec.hot_mount} does not hold {', '.join(outside)}")
        return spec.hot_mount
    if not folders:
        raise ValueError("nodes.kubernetes.hot_mount: the plan names no paths; set where hot_pvc is mounted")
    root = PurePosixPath(*_common_parts([f.parts for f in folders]))
    if str(root) == "/":
        raise ValueError(
            "nodes.kubernetes.hot_mount: the run's paths share no folder but '/'; "
            "set where hot_pvc is mounted (e.g. $TRAINYARD_HOME)"
        )
    return str(root)


def _common_parts(parts: list[tuple[str, ...]]) -> tuple[str, ...]:
    common = parts[0]
    for other in parts[1:]:
        n = 0
        while n < min(len(common), len(other)) and common[n] == other[n]:
            n += 1
        common = common[:n]
    return common


def resources(spec: KubernetesSpec) -> k8s.V1ResourceRequirements:
    """Requests equal limits (Guaranteed QoS): a training node is the last thing the kubelet should evict."""
    amounts = {"cpu": spec.cpu, "memory": spec.memory}
    if spec.gpus:
        amounts[GPU_RESOURCE] = str(spec.gpus)
    return k8s.V1ResourceRequirements(requests=dict(amounts), limits=dict(amounts))


def tolerations(spec: KubernetesSpec, extra: Iterable[k8s.V1Toleration] = ()) -> list[k8s.V1Toleration] | None:
    out = []
    for i, item in enumerate(spec.tolerations):
        unknown = sorted(set(item) - set(_TOLERATION_KEYS))
        if unknown:
            raise ValueError(
                f"nodes.kubernetes.tolerations[{i}]: unknown key(s) {', '.join(unknown)}; "
                f"allowed: {', '.join(_TOLERATION_KEYS)}"
            )
        kwargs: dict[str, Any] = {_TOLERATION_KEYS[k]: v for k, v in item.items()}
        if "toleration_seconds" in kwargs:
            kwargs["toleration_seconds"] = int(kwargs["toleration_seconds"])
        out.append(k8s.V1Toleration(**kwargs))
    out.extend(extra)
    return out or None


def pod_security_context() -> k8s.V1PodSecurityContext:
    # fsGroup makes the hot-tier volume writable by the non-root user.
    return k8s.V1PodSecurityContext(
        run_as_non_root=True,
        run_as_user=RUN_AS_USER,
        run_as_group=RUN_AS_USER,
        fs_group=RUN_AS_USER,
        seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault"),
    )


def container_security_context() -> k8s.V1SecurityContext:
    """What the "restricted" Pod Security Standard asks of every container, and a read-only image:
    code that runs there can change nothing but its mounts (/tmp, /dev/shm, its hot-tier folders)."""
    return k8s.V1SecurityContext(
        run_as_non_root=True,
        run_as_user=RUN_AS_USER,
        allow_privilege_escalation=False,
        capabilities=k8s.V1Capabilities(drop=["ALL"]),
        read_only_root_filesystem=True,
        seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault"),
    )


def scratch_env() -> list[k8s.V1EnvVar]:
    """The root file system is read-only: temporary files and caches (~/.cache) go to the /tmp emptyDir."""
    return [k8s.V1EnvVar(name="TMPDIR", value="/tmp"), k8s.V1EnvVar(name="HOME", value="/tmp")]


def pod_account(spec: KubernetesSpec, launcher: tuple[str, str] | None = None) -> str | None:
    """The spec's ``service_account``, refused when it is the launcher's own (defence in depth: the spec
    check refuses it too). ``launcher``: (namespace, name) of the account the launcher calls the API as."""
    account = spec.service_account
    own = {LAUNCHER_ACCOUNT} | ({launcher[1]} if launcher and launcher[0] == spec.namespace else set())
    if account in own:
        raise ValueError(
            f"nodes.kubernetes.service_account: {account!r} is the launcher's own account, which may "
            "create pods and mark nodes; give the pods an account of their own, or none"
        )
    return account


def volumes(
    spec: KubernetesSpec, root: str | None, paths: list[PathMount]
) -> tuple[list[k8s.V1Volume], list[k8s.V1VolumeMount]]:
    """Memory-backed /dev/shm, an emptyDir /tmp, and (when ``hot_pvc`` is set) ``paths`` of the hot tier.

    Each path is its own ``subPath`` mount of the claim, whose root the
    orchestrator sees at ``root``: a pod never sees the rest of the tier.
    A container's default /dev/shm is 64 MiB; NCCL and data-loader workers
    pass tensors through it and fail with a bus error when it is full.
    """
    vols = [
        k8s.V1Volume(name=SHM_VOLUME, empty_dir=k8s.V1EmptyDirVolumeSource(medium="Memory")),
        k8s.V1Volume(name=TMP_VOLUME, empty_dir=k8s.V1EmptyDirVolumeSource()),
    ]
    mounts = [
        k8s.V1VolumeMount(name=SHM_VOLUME, mount_path="/dev/shm"),
        k8s.V1VolumeMount(name=TMP_VOLUME, mount_path="/tmp"),
    ]
    if spec.hot_pvc and root:
        vols.append(
            k8s.V1Volume(
                name=HOT_VOLUME,
                persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(claim_name=spec.hot_pvc),
            )
        )
        for m in paths:
            sub = str(PurePosixPath(m.path).relative_to(root))
            mounts.append(
                k8s.V1VolumeMount(
                    name=HOT_VOLUME,
                    mount_path=m.path,
                    sub_path=None if sub == "." else sub,
                    read_only=True if m.read_only else None,
                )
            )
    return vols, mounts


def not_evicted(spec: KubernetesSpec) -> k8s.V1NodeAffinity:
    """Required node affinity: never schedule on a node carrying the evicted label."""
    term = k8s.V1NodeSelectorTerm(
        match_expressions=[k8s.V1NodeSelectorRequirement(key=spec.evicted_label, operator="DoesNotExist")]
    )
    return k8s.V1NodeAffinity(
        required_during_scheduling_ignored_during_execution=k8s.V1NodeSelector(node_selector_terms=[term])
    )


def training_affinity(spec: KubernetesSpec, name: str) -> k8s.V1Affinity:
    """Off evicted nodes, and one training pod per node (a node lost must cost one rank group, not two)."""
    spread = k8s.V1PodAffinityTerm(
        label_selector=k8s.V1LabelSelector(match_labels={LABEL_JOB: name}), topology_key="kubernetes.io/hostname"
    )
    return k8s.V1Affinity(
        node_affinity=not_evicted(spec),
        pod_anti_affinity=k8s.V1PodAntiAffinity(required_during_scheduling_ignored_during_execution=[spread]),
    )


def training_pod_template(
    plan: LaunchPlan, spec: KubernetesSpec, name: str, launcher: tuple[str, str] | None = None
) -> k8s.V1PodTemplateSpec:
    account = pod_account(spec, launcher)
    vols, mounts = volumes(spec, hot_mount_path(plan, spec) if spec.hot_pvc else None, attempt_paths(plan))
    annotations = {RUN_ID_ANNOTATION: plan.run_id}
    if spec.scheduler == "volcano":
        annotations[GROUP_NAME_ANNOTATION] = name
    container = k8s.V1Container(
        name=CONTAINER,
        image=spec.image,
        command=["python", "-m", "torch.distributed.run"],
        args=torchrun_args(plan, rendezvous_endpoint(name, spec.namespace, spec.cluster_domain)),
        env=[*training_env(plan), *scratch_env()],
        resources=resources(spec),
        volume_mounts=mounts,
        ports=[k8s.V1ContainerPort(name="rdzv", container_port=RDZV_PORT, protocol="TCP")],
        security_context=container_security_context(),
    )
    return k8s.V1PodTemplateSpec(
        metadata=k8s.V1ObjectMeta(labels=attempt_labels(plan, name), annotations=annotations),
        spec=k8s.V1PodSpec(
            containers=[container],
            restart_policy="Never",
            subdomain=name,
            scheduler_name="volcano" if spec.scheduler == "volcano" else None,
            service_account_name=account,
            # Training code has no business with the API server unless an account was chosen for it.
            automount_service_account_token=None if account else False,
            enable_service_links=False,
            node_selector=dict(spec.node_selector) or None,
            tolerations=tolerations(spec),
            affinity=training_affinity(spec, name),
            security_context=pod_security_context(),
            volumes=vols,
        ),
    )


# ---------------------------------------------------------------- objects


@dataclass(frozen=True)
class AttemptObjects:
    name: str
    job: k8s.V1Job
    service: k8s.V1Service
    podgroup: dict[str, Any] | None
    """Volcano PodGroup (a custom resource, so a plain dict); None with the default scheduler."""


def build_job(plan: LaunchPlan, spec: KubernetesSpec, launcher: tuple[str, str] | None = None) -> k8s.V1Job:
    name = object_name(plan)
    n = len(plan.nodes)
    return k8s.V1Job(
        api_version="batch/v1",
        kind="Job",
        metadata=k8s.V1ObjectMeta(
            name=name,
            namespace=spec.namespace,
            labels=attempt_labels(plan, name),
            annotations={RUN_ID_ANNOTATION: plan.run_id},
        ),
        spec=k8s.V1JobSpec(
            completions=n,
            parallelism=n,
            completion_mode="Indexed",
            backoff_limit=0,  # a failed pod ends the attempt; retrying is the supervisor's decision
            ttl_seconds_after_finished=TTL_AFTER_FINISHED_S,
            template=training_pod_template(plan, spec, name, launcher),
        ),
    )


def build_service(plan: LaunchPlan, spec: KubernetesSpec) -> k8s.V1Service:
    """Headless Service selecting the attempt's pods, so pod 0 has a DNS name before anyone joins it."""
    name = object_name(plan)
    return k8s.V1Service(
        api_version="v1",
        kind="Service",
        metadata=k8s.V1ObjectMeta(name=name, namespace=spec.namespace, labels=attempt_labels(plan, name)),
        spec=k8s.V1ServiceSpec(
            cluster_ip="None",
            selector={LABEL_JOB: name},
            # The other agents dial pod 0 while it starts, before any readiness.
            publish_not_ready_addresses=True,
            ports=[k8s.V1ServicePort(name="rdzv", port=RDZV_PORT, target_port=RDZV_PORT, protocol="TCP")],
        ),
    )


def build_podgroup(plan: LaunchPlan, spec: KubernetesSpec) -> dict[str, Any]:
    """Volcano gang: no pod starts until all ``nodes`` fit, so a half-placed attempt never holds GPUs idle."""
    name = object_name(plan)
    n = len(plan.nodes)
    return {
        "apiVersion": f"{PODGROUP_GROUP}/{PODGROUP_VERSION}",
        "kind": "PodGroup",
        "metadata": {"name": name, "namespace": spec.namespace, "labels": attempt_labels(plan, name)},
        "spec": {"minMember": n, "minResources": {k: _times(v, n) for k, v in resources(spec).limits.items()}},
    }


def _times(quantity: str, n: int) -> str:
    total = parse_quantity(quantity) * n
    if total == total.to_integral_value():
        return str(int(total))
    return f"{int(total * 1000)}m"  # fractional CPUs


def build_objects(plan: LaunchPlan, spec: KubernetesSpec, launcher: tuple[str, str] | None = None) -> AttemptObjects:
    """Every object of one attempt; pure, so the same plan always yields the same names and bodies.

    ``launcher``: the (namespace, name) of the account the launcher calls the API as, which no pod may run as.
    """
    return AttemptObjects(
        name=object_name(plan),
        job=build_job(plan, spec, launcher),
        service=build_service(plan, spec),
        podgroup=build_podgroup(plan, spec) if spec.scheduler == "volcano" else None,
    )


# ---------------------------------------------------------------- statuses


def pod_index(pod: Any) -> int | None:
    meta = pod.metadata
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


def _disruption(status: Any) -> str | None:
    """The reason of a DisruptionTarget condition (preemption, taint eviction, pod GC), if any."""
    for cond in (status.conditions or []) if status else []:
        if cond.type == "DisruptionTarget" and cond.status == "True":
            return cond.reason or "DisruptionTarget"
    return None


def _failure_reason(pod: Any, container: Any, terminated: Any) -> str | None:
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
        return pod_reason
    waiting = container.state.waiting.reason if container and container.state and container.state.waiting else None
    if waiting in FAILED_WAITING_REASONS:
        return waiting
    if terminated is not None and terminated.exit_code != 0:
        return terminated.reason or "Error"  # exited; the phase has not caught up yet
    if pod.metadata.deletion_timestamp is not None and _disruption(status):
        return _disruption(status)  # e.g. DeletionByTaintManager: its node went NotReady
    return None


def pod_node_status(pod: Any, fallback_node: str) -> NodeStatus:
    """One pod as a ``NodeStatus``; ``node`` is the Kubernetes node it runs on (``TRAINYARD_NODE`` inside it).

    Works on models of ``kubernetes`` and ``kubernetes_asyncio`` alike (same attribute names).
    """
    node = (pod.spec.node_name if pod.spec is not None else None) or fallback_node
    container = _main_container(pod.status)
    terminated = _terminated(container)
    code = terminated.exit_code if terminated is not None else None
    if pod.status is not None and pod.status.phase == "Succeeded":
        return NodeStatus(node, "succeeded", 0 if code is None else code)
    reason = _failure_reason(pod, container, terminated) if pod.status is not None else None
    if reason is None:
        return NodeStatus(node, "running")
    return NodeStatus(node, "failed", code, reason=reason)


def pods_by_index(pods: Iterable[Any], nodes: list[str]) -> dict[int, tuple[Any, NodeStatus]]:
    """The telling pod of each completion index: a failed one over a succeeded one over a running one."""
    best: dict[int, tuple[Any, NodeStatus]] = {}
    for pod in pods:
        index = pod_index(pod)
        if index is None or not 0 <= index < len(nodes):
            continue
        status = pod_node_status(pod, nodes[index])
        if index not in best or _STATE_RANK[status.state] > _STATE_RANK[best[index][1].state]:
            best[index] = (pod, status)
    return best


def job_failure_reason(job: Any) -> str | None:
    """The reason of the Job's Failed condition (BackoffLimitExceeded, DeadlineExceeded, ...), if it failed."""
    for cond in (job.status.conditions or []) if job is not None and job.status is not None else []:
        if cond.type == "Failed" and cond.status == "True":
            return cond.reason or "JobFailed"
    return None


def attempt_status(pods: Iterable[Any], nodes: list[str], job_reason: str | None = None) -> AttemptStatus:
    """Statuses in node order (completion index); a node without a pod yet is running (pending).

    ``job_reason`` (the Job failed, or is gone) fails every unfinished node, but
    only when no pod says why: the pod that failed first is the evidence, and
    the survivors the Job controller then kills are not to blame.
    """
    best = pods_by_index(pods, nodes)
    statuses = [best[i][1] if i in best else NodeStatus(node, "running") for i, node in enumerate(nodes)]
    if job_reason and not any(s.state == "failed" for s in statuses):
        statuses = [s if s.state == "succeeded" else replace(s, state="failed", reason=job_reason) for s in statuses]
    return AttemptStatus(statuses)


def status_to_dicts(status: AttemptStatus) -> list[dict[str, Any]]:
    """JSON-safe records (a trigger event's payload)."""
    return [asdict(n) for n in status.nodes]


def status_from_dicts(items: Iterable[Mapping[str, Any]]) -> AttemptStatus:
    return AttemptStatus([NodeStatus(**dict(item)) for item in items])


# ---------------------------------------------------------------- launcher


@dataclass
class KubernetesHandle:
    plan: LaunchPlan
    namespace: str
    name: str
    podgroup: bool
    logs: dict[int, str] = field(default_factory=dict)
    """Evidence file written per completion index, once its pod finished."""


def _ignore(status: int, call: Callable[[], Any]) -> bool:
    """Run ``call``; True if it answered ``status`` (404 on delete, 409 on create), which is fine here."""
    try:
        call()
        return False
    except ApiException as exc:
        if exc.status != status:
            raise
        return True


def token_account(api_client: Any) -> tuple[str, str] | None:
    """(namespace, name) of the service account whose token ``api_client`` sends, if it sends one.

    Read from the token's ``sub`` claim (``system:serviceaccount:<ns>:<name>``) without checking its
    signature: it is our own credential, read only to know which account no pod may be given.
    """
    try:
        auth = api_client.configuration.api_key.get("authorization", "") or ""
        token = auth.split()[-1] if auth else ""
        payload = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        kind, _, rest = str(claims.get("sub", "")).partition(":serviceaccount:")
        namespace, _, name = rest.partition(":")
    except (AttributeError, IndexError, ValueError, TypeError):
        return None
    return (namespace, name) if kind == "system" and namespace and name else None


def prepare_paths(plan: LaunchPlan) -> None:
    """Create the folders and the ledger file the pods mount, as the orchestrator's user, before the Job.

    The kubelet would create a missing ``subPath`` itself, owned by root (not
    writable by the pods' user), and a missing file ``subPath`` as a folder.
    """
    for key in WRITABLE_DIRS:
        if key in plan.env:
            Path(plan.env[key]).mkdir(parents=True, exist_ok=True)
    for key in WRITABLE_FILES:
        if key in plan.env:
            Path(plan.env[key]).parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(plan.env[key], os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644))


class KubernetesLauncher:
    """``launch`` / ``poll`` / ``cancel`` over the Kubernetes API, with a ``kubernetes.client.ApiClient``."""

    reattaches = True
    """An attempt's Job outlives the task process that created it; its name comes from the plan."""

    def __init__(self, api_client: k8s.ApiClient, spec: KubernetesSpec, log_lines: int = 200) -> None:
        self.account = token_account(api_client)
        """The launcher's own service account, if it calls the API as one: no pod may run as it."""
        self.core = k8s.CoreV1Api(api_client)
        self.batch = k8s.BatchV1Api(api_client)
        self.custom = k8s.CustomObjectsApi(api_client)
        self.spec = spec
        self.log_lines = log_lines
        self.active: list[KubernetesHandle] = []
        """Attempts launched and not yet cancelled, so ``cancel_all`` can end them on a kill."""

    def launch(self, plan: LaunchPlan) -> KubernetesHandle:
        """Create PodGroup (Volcano), Service, then Job: the Job last, so its pods find both.

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
            if objects.podgroup is not None:
                self._create(
                    "PodGroup",
                    objects.name,
                    lambda: self.custom.create_namespaced_custom_object(
                        PODGROUP_GROUP, PODGROUP_VERSION, ns, PODGROUP_PLURAL, objects.podgroup
                    ),
                )
            self._create("Service", objects.name, lambda: self.core.create_namespaced_service(ns, objects.service))
            self._create("Job", objects.name, lambda: self.batch.create_namespaced_job(ns, objects.job))
        except Exception:
            self.cancel(handle)  # leave nothing half-made behind
            raise
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

    @staticmethod
    def _create(kind: str, name: str, call: Callable[[], Any]) -> None:
        if _ignore(409, call):
            log.info("%s %s already exists; adopting it", kind, name)

    def poll(self, handle: KubernetesHandle) -> AttemptStatus:
        pods = self.core.list_namespaced_pod(handle.namespace, label_selector=selector(handle.name)).items
        best = pods_by_index(pods, handle.plan.nodes)
        status = attempt_status([pod for pod, _ in best.values()], handle.plan.nodes, self._job_reason(handle))
        nodes = [self._with_evidence(handle, i, best.get(i, (None, None))[0], s) for i, s in enumerate(status.nodes)]
        return AttemptStatus(nodes)

    def _job_reason(self, handle: KubernetesHandle) -> str | None:
        try:
            return job_failure_reason(self.batch.read_namespaced_job(handle.name, handle.namespace))
        except ApiException as exc:
            if exc.status == 404:
                return "JobDeleted"  # by someone else, or by its TTL: no pod will report again
            raise

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
            f"# pod {pod.metadata.name} on node {status.node}: {status.state}"
            f" exit={status.exit_code} reason={status.reason or '-'} {pod.status.message or ''}".rstrip()
        )
        try:
            # Raw bytes: the client's "str" deserializer would hand back "b'...'" (or parse a log
            # that happens to be JSON), so the response is read and decoded here.
            raw = self.core.read_namespaced_pod_log(
                pod.metadata.name,
                pod.metadata.namespace,
                container=CONTAINER,
                tail_lines=self.log_lines,
                _preload_content=False,
            )
            text = raw.data.decode("utf-8", errors="replace")
        except ApiException as exc:
            text = f"# no container log: {exc.status} {exc.reason}"  # never started (image pull, eviction)
        return f"{head}\n{text}" if text.endswith("\n") else f"{head}\n{text}\n"

    def cancel(self, handle: KubernetesHandle) -> None:
        """Delete Job (with its pods), Service and PodGroup; anything already gone is fine.

        Foreground propagation keeps the Job visible, marked for deletion, until
        its pods are gone, so nobody mistakes a still-draining attempt for none.
        """
        ns, name = handle.namespace, handle.name
        _ignore(404, lambda: self.batch.delete_namespaced_job(name, ns, propagation_policy="Foreground"))
        _ignore(404, lambda: self.core.delete_namespaced_service(name, ns))
        if handle.podgroup:
            _ignore(
                404,
                lambda: self.custom.delete_namespaced_custom_object(
                    PODGROUP_GROUP, PODGROUP_VERSION, ns, PODGROUP_PLURAL, name
                ),
            )
        if handle in self.active:
            self.active.remove(handle)

    def exclude(self, nodes: list[str]) -> list[str]:
        """Mark ``nodes`` evicted, as the pressure test marks a weak node: the next attempt's pods
        land where the scheduler puts them, and only the mark (``not_evicted`` affinity) keeps
        them off a node that just failed. Clear it once the node is fixed
        (``kubectl label node NODE trainyard.io/evicted-``)."""
        from trainyard.burnin.kubernetes import label_evicted  # that module builds on this one

        return label_evicted(self.core, nodes, self.spec.evicted_label, self.spec.evict_with)

    def cancel_all(self) -> None:
        for handle in list(self.active):
            self.cancel(handle)
