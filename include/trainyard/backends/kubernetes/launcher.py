"""Kubernetes backend: one attempt is an Indexed Job, a headless Service and (with Volcano) a PodGroup.

This module owns two things:

* the **objects** of an attempt, built by pure functions from a ``LaunchPlan``
  and the spec's ``KubernetesSpec`` (``build_objects``), as ``kubernetes``
  client models, so they can be checked against the official schema with no
  cluster;
* the **launcher** (``KubernetesLauncher``) that creates, watches and deletes
  them, reading the pods as ``NodeStatus`` records with ``trainyard.backends.kubernetes.status``
  (which the deferrable trigger shares), so the supervisor reads the same
  records whichever backend or waiter produced them.

The pieces every pod has (security context, volumes, affinity), the names and
the node marks are ``trainyard.backends.kubernetes``'s, shared with the pressure test.

Where pods run: the plan's ``nodes`` are hosts (Kubernetes node names, those
the pressure test passed), and every pod of the attempt is pinned to that set
(required node affinity on ``metadata.name``) with one pod per host. The
scheduler puts pod *i* on *any* host of the set, so a status names both its
slot (``plan.nodes[i]``) and its host (``spec.nodeName``); recovery blames,
marks and replaces hosts.

Pod *i* of the Job is rank group *i* of the attempt: it runs one torchrun agent
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

import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from kubernetes.utils import parse_quantity

from trainyard.atomic import write_text_atomic
from trainyard.backends.base import AttemptStatus, LaunchPlan, NodeStatus
from trainyard.backends.kubernetes.marks import label_evicted
from trainyard.backends.kubernetes.names import (
    GROUP_NAME_ANNOTATION,
    INDEX_ANNOTATION,
    LABEL_JOB,
    MAX_JOB_NAME,
    RDZV_PORT,
    RUN_ID_ANNOTATION,
    attempt_labels,
    dns_label,
    label_value,
    object_name,
    rendezvous_endpoint,
    selector,
)
from trainyard.backends.kubernetes.pods import (
    CONTAINER,
    GPU_RESOURCE,
    LAUNCHER_ACCOUNT,
    RUN_AS_USER,
    PathMount,
    container_security_context,
    pod_account,
    pod_security_context,
    resources,
    scratch_env,
    token_account,
    tolerations,
    training_affinity,
    volumes,
)
from trainyard.backends.kubernetes.status import (
    attempt_status,
    job_failure_reason,
    pod_message,
    pod_node_status,
    pods_by_index,
    status_from_dicts,
    status_to_dicts,
)
from trainyard.protocol.env import NODE_VARIABLES
from trainyard.spec import KubernetesSpec

__all__ = [  # what callers imported from here before trainyard.backends.kubernetes held it
    "CONTAINER",
    "GPU_RESOURCE",
    "GROUP_NAME_ANNOTATION",
    "INDEX_ANNOTATION",
    "LABEL_JOB",
    "LAUNCHER_ACCOUNT",
    "MAX_JOB_NAME",
    "RUN_AS_USER",
    "AttemptObjects",
    "KubernetesHandle",
    "KubernetesLauncher",
    "PathMount",
    "attempt_paths",
    "attempt_status",
    "build_objects",
    "container_security_context",
    "dns_label",
    "hot_mount_path",
    "job_failure_reason",
    "label_value",
    "object_name",
    "pod_node_status",
    "pod_security_context",
    "prepare_paths",
    "rendezvous_endpoint",
    "selector",
    "status_from_dicts",
    "status_to_dicts",
    "token_account",
]

log = logging.getLogger(__name__)

PODGROUP_GROUP, PODGROUP_VERSION, PODGROUP_PLURAL = "scheduling.volcano.sh", "v1beta1", "podgroups"
# Folders the orchestrator makes for the pods: group-writable, setgid (new files keep SHARED_GID).
SHARED_DIR_MODE = 0o2775
# A finished Job the supervisor did not delete (its process died) cleans itself up
# after a day; long enough for a deferred waiter to read the pods' final states.
TTL_AFTER_FINISHED_S = 24 * 3600


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
        # The node is only known once scheduled: the downward API gives the Kubernetes node name, which is both
        # the pod's name for its node and its host (every pod of a Job shares one template, so no slot name).
        *(
            k8s.V1EnvVar(
                name=name,
                value_from=k8s.V1EnvVarSource(field_ref=k8s.V1ObjectFieldSelector(field_path="spec.nodeName")),
            )
            for name in NODE_VARIABLES
        ),
        k8s.V1EnvVar(name="PYTHONUNBUFFERED", value="1"),  # pod logs are the node's evidence
        *(
            k8s.V1EnvVar(name=key, value=_literal(value))
            for key, value in plan.env.items()
            if key not in NODE_VARIABLES
        ),
    ]


def attempt_paths(plan: LaunchPlan) -> list[PathMount]:
    """What an attempt's pods may see of the hot tier, and which of it they may write.

    What the contract declares (``TrainEnv.paths``): its heartbeat folder, its
    lineage's checkpoint folder and the run's events folder (``events.d``)
    read-write; its dataset (and a ``resume_from`` path outside the checkpoint
    folder) read-only. Nothing else: not the run folder (its pinned spec, report
    and the orchestrator's ``events.jsonl``), not other pipelines' checkpoints or locks.
    """
    mounts = [PathMount(str(p.path), not p.writable) for p in plan.train_env.paths()]
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
    folders = [PurePosixPath(m.path) for m in attempt_paths(plan)]  # every path of the contract is a folder
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
            affinity=training_affinity(spec, name, plan.nodes),
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


def prepare_paths(plan: LaunchPlan) -> None:
    """Create the folders the pods mount read-write, as the orchestrator's user, before the Job.

    The kubelet would create a missing ``subPath`` itself, owned by root (not
    writable by the pods' user).
    Each folder made here is ``SHARED_DIR_MODE`` (group-writable, setgid), so
    the pods (in ``SHARED_GID``) write there and what they create stays in
    the group the orchestrator reads and tidies as.
    """
    for p in plan.train_env.paths():
        if p.writable and p.is_dir:
            shared_dirs(p.path)


def shared_dirs(path: Path) -> None:
    """``mkdir -p`` with ``SHARED_DIR_MODE`` on every folder it makes (not masked by the umask)."""
    missing = []
    for folder in (path, *path.parents):
        if folder.is_dir():
            break
        missing.append(folder)
    for folder in reversed(missing):
        try:
            folder.mkdir()
        except FileExistsError:
            if not folder.is_dir():
                raise
            continue  # made meanwhile by someone else: theirs to set
        os.chmod(folder, SHARED_DIR_MODE)
    if path.is_dir() and path.stat().st_uid == os.geteuid():
        os.chmod(path, stat.S_IMODE(path.stat().st_mode) | SHARED_DIR_MODE)  # an older folder of ours, too


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
        now = time.time()  # one clock for every pod of this look
        best = pods_by_index(pods, handle.plan.nodes, now)
        status = attempt_status([pod for pod, _ in best.values()], handle.plan.nodes, self._job_reason(handle), now)
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
            f"# pod {pod.metadata.name} on node {status.host or '(not placed)'}: {status.state}"
            f" exit={status.exit_code} reason={status.reason or '-'} {pod_message(pod)}".rstrip()
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
        """Mark the hosts ``nodes`` evicted, as the pressure test marks a weak node: later attempts are pinned
        to other hosts anyway, and the mark (``not_evicted`` affinity) keeps every other run of trainyard
        off them too. A later burn-in re-tests it after the cool-down (``trainyard.backends.kubernetes.cooldown``) and clears
        the mark when it passes; a person may clear it sooner (``kubectl label node NODE trainyard.io/evicted-``)."""
        return label_evicted(self.core, nodes, self.spec.evicted_label, self.spec.evict_with)

    def cancel_all(self) -> None:
        for handle in list(self.active):
            self.cancel(handle)
