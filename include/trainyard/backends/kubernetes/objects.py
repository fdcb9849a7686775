"""The objects of one attempt: an Indexed Job, a headless Service and (with Volcano) a PodGroup.

Built by pure functions from a ``LaunchPlan`` and the spec's ``KubernetesSpec``
(``build_objects``), as ``kubernetes`` client models, so they can be checked
against the official schema with no cluster. The pieces every pod has
(security context, volumes, affinity) are ``trainyard.backends.kubernetes.pods``'s.

Where pods run: the plan's ``nodes`` are hosts (Kubernetes node names, those
the pressure test passed), and every pod of the attempt is pinned to that set
(required node affinity on ``metadata.name``) with one pod per host. The
scheduler puts pod *i* on *any* host of the set, so a status names both its
slot (``plan.nodes[i]``) and its host (``spec.nodeName``).

Pod *i* of the Job is rank group *i* of the attempt: it runs one torchrun agent
(``python -m torch.distributed.run``) with ``--node-rank=$(JOB_COMPLETION_INDEX)``
and meets the others through static rendezvous on pod 0 (node rank 0), reached by its stable
DNS name ``<job>-0.<service>.<namespace>.svc.<domain>`` (an Indexed Job gives
pod *i* the hostname ``<job>-<i>``; the headless Service and the pods'
``subdomain`` give that hostname a DNS record).

How this lines up with the cncf-kubernetes provider: its ``KubernetesJobOperator``
builds the same ``kubernetes.client.V1Job`` from ``parallelism``,
``completions``, ``completion_mode="Indexed"`` and ``backoff_limit``; we set
exactly those (parallelism = completions = nodes, Indexed, backoffLimit 0)
but build the Job here, because the library never imports Airflow
(docs/architecture.md, layers) and because the operator owns one pod per task
and renames the Job (``job-`` prefix, random suffix), while the rendezvous
endpoint needs a name known before the Job exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kubernetes.utils import parse_quantity

from trainyard.backends.base import LaunchPlan
from trainyard.backends.kubernetes.api import PODGROUP_GROUP, PODGROUP_VERSION
from trainyard.backends.kubernetes.models import k8s
from trainyard.backends.kubernetes.names import (
    GROUP_NAME_ANNOTATION,
    INDEX_ANNOTATION,
    LABEL_JOB,
    RDZV_PORT,
    RUN_ID_ANNOTATION,
    attempt_labels,
    object_name,
    rendezvous_endpoint,
)
from trainyard.backends.kubernetes.paths import HEARTBEAT_VARIABLE, attempt_paths, hot_mount_path
from trainyard.backends.kubernetes.pods import (
    CONTAINER,
    NODE_EXPR,
    container_security_context,
    pod_account,
    pod_security_context,
    resources,
    scratch_env,
    tolerations,
    training_affinity,
    volumes,
)
from trainyard.protocol.env import NODE_VARIABLES
from trainyard.spec import KubernetesSpec

# A finished Job the supervisor did not delete (its process died) cleans itself up
# after a day; long enough for a deferred waiter to read the pods' final states.
TTL_AFTER_FINISHED_S = 24 * 3600


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
        # Static: the attempt's pods and their indexes are the Job's, fixed; pod 0's agent hosts the store at the
        # endpoint (node rank 0) and the others connect. torchrun's dynamic (c10d) rendezvous polls its state every
        # second while the pods join (as on the local backend, ``backends.local.launcher.torchrun_argv``).
        "--rdzv-backend=static",
        f"--rdzv-endpoint={endpoint}",
        _literal(f"--rdzv-id={plan.run_id}-a{plan.attempt}"),
        "--max-restarts=0",  # restarts are the supervisor's decision, not torchrun's
        *(_literal(arg) for arg in plan.entry_argv()),
    ]


def training_env(plan: LaunchPlan, mounted_per_node: bool = False) -> list[k8s.V1EnvVar]:
    """The plan's TRAINYARD_* contract, plus the node identity and index from the pod itself.

    A pod's heartbeat folder is its node's folder of the attempt's (``<hb>/<spec.nodeName>``): its beats and
    failure records name no other node. ``mounted_per_node`` (``hot_pvc``): the pod mounts only that folder,
    at the attempt's path; otherwise the variable names it."""
    beats = plan.env.get(HEARTBEAT_VARIABLE)
    own = {HEARTBEAT_VARIABLE: _literal(beats) + ("" if mounted_per_node else f"/{NODE_EXPR}")} if beats else {}
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
        # The spec's own (``training.env``), before the contract: its names never clash (``spec.args``).
        *(k8s.V1EnvVar(name=key, value=_literal(value)) for key, value in plan.script_env.items()),
        *(
            k8s.V1EnvVar(name=key, value=own.get(key, _literal(value)))
            for key, value in plan.env.items()
            if key not in NODE_VARIABLES
        ),
    ]


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
        env=[*training_env(plan, bool(spec.hot_pvc)), *scratch_env()],
        working_dir=plan.workdir,  # None: the image's WORKDIR
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
