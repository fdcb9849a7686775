"""The objects of an in-place attempt: a pod per node, its coordination store (pod + Service), its keys.

An attempt whose plan names a coordination store (``TRAINYARD_STORE``: it regroups in place) is not an
Indexed Job. A Job decides for itself when one of its pods goes: it counts the pod as a failure (with
``backoffLimit: 0`` the whole Job fails and its controller deletes the survivors) or it makes a new pod for
that index, on any host the template allows. In place, the controller (``trainyard.recovery.controller``)
decides which nodes leave, which join and where: so each node is a bare pod the launcher creates and
deletes itself (``api.kill_pods``, ``api.create_pod``), and a Job controller never acts on them.

- A node's pod (``node_pod``) is its node's alone: pinned to that host (node name = host, the store's
  identity of the node, which its key is for), labelled with it (``LABEL_NODE``), and given only its own key
  to the store from the attempt's Secret (``secretKeyRef`` to its node's entry). It runs torchrun standalone
  for its ``procs_per_node`` ranks: the pod is the unit (any rank failing ends it), and no rendezvous ties it
  to another pod, so any pod can go and the others run on. A replacement (a joiner, a node started again)
  is the same pod with a new name.
- The coordinator pod (``coordinator_pod``) serves the store (``trainyard.backends.store``) from the
  trainer image, on its pod IP; ``store_service`` (ClusterIP) gives it a stable address on the pod network.
  It holds no secret: every value is sealed with the orchestrator's keys, and a forged one is refused.
- ``key_secret``: each node's key (``coordstore.node_keys``; the attempt's secret stays with the
  orchestrator). Pods cannot read Secrets themselves (no API token is mounted in them).
"""

from __future__ import annotations

import base64
import secrets
from dataclasses import dataclass
from typing import Any

from trainyard.backends.base import LaunchPlan
from trainyard.backends.kubernetes.models import k8s
from trainyard.backends.kubernetes.names import (
    LABEL_COMPONENT,
    LABEL_JOB,
    LABEL_NODE,
    NODE_ANNOTATION,
    STORE_PORT,
    attempt_labels,
    label_value,
    object_name,
    store_name,
)
from trainyard.backends.kubernetes.objects import _literal, build_podgroup, training_pod_template
from trainyard.backends.kubernetes.pods import (
    container_security_context,
    node_affinity,
    not_evicted_requirement,
    on_hosts,
    pod_security_context,
    scratch_env,
    tolerations,
)
from trainyard.protocol.coordstore import KEY_ENV
from trainyard.protocol.env import STORE_BIND_VARIABLE
from trainyard.spec import KubernetesSpec

STORE_RESOURCES = {"cpu": "250m", "memory": "512Mi"}  # a TCPStore and an imported torch; no GPU


@dataclass(frozen=True)
class InPlaceObjects:
    name: str
    pods: list[k8s.V1Pod]
    coordinator: k8s.V1Pod | None
    service: k8s.V1Service | None
    secret: k8s.V1Secret | None
    podgroup: dict[str, Any] | None


def standalone_args(plan: LaunchPlan) -> list[str]:
    """torchrun for one pod's ranks alone: ``--standalone`` hosts the rendezvous in the pod (no other pod's)."""
    return [
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={plan.procs_per_node}",
        "--max-restarts=0",  # the node is the unit: a failed rank ends the pod, the controller decides
        *(_literal(arg) for arg in plan.entry_argv()),
    ]


def node_pod(
    plan: LaunchPlan, spec: KubernetesSpec, node: str, launcher: tuple[str, str] | None = None, fresh: bool = False
) -> k8s.V1Pod:
    """``node``'s pod in the attempt, pinned to the host ``node``; ``fresh``: a replacement, under a new name
    (the pod it replaces may still be terminating)."""
    name = object_name(plan)
    template = training_pod_template(plan, spec, name, launcher)
    pod_spec, container = template.spec, template.spec.containers[0]
    container.command = ["python", "-m", "torch.distributed.run"]
    container.args = standalone_args(plan)
    container.ports = None
    key = k8s.V1EnvVar(
        name=KEY_ENV,
        value_from=k8s.V1EnvVarSource(secret_key_ref=k8s.V1SecretKeySelector(name=store_name(name), key=node)),
    )
    container.env = [e for e in container.env if e.name not in ("JOB_COMPLETION_INDEX", KEY_ENV)] + [key]
    pod_spec.subdomain = None
    # Its own host only: the node's name is its identity on the store (its key is for that name).
    pod_spec.affinity = k8s.V1Affinity(node_affinity=node_affinity([not_evicted_requirement(spec)], [on_hosts([node])]))
    index = plan.nodes.index(node) if node in plan.nodes and not fresh else None
    suffix = str(index) if index is not None else f"{label_value(node)[:20].lower().strip('-.')}-{secrets.token_hex(3)}"
    labels = {**(template.metadata.labels or {}), LABEL_NODE: label_value(node)}
    annotations = {**(template.metadata.annotations or {}), NODE_ANNOTATION: node}
    return k8s.V1Pod(
        api_version="v1",
        kind="Pod",
        metadata=k8s.V1ObjectMeta(
            name=f"{name}-{suffix}", namespace=spec.namespace, labels=labels, annotations=annotations
        ),
        spec=pod_spec,
    )


def coordinator_pod(plan: LaunchPlan, spec: KubernetesSpec) -> k8s.V1Pod:
    """The pod serving the attempt's store, on its pod IP, as the trainer image's non-root user."""
    name, store = object_name(plan), store_name(object_name(plan))
    labels = {**attempt_labels(plan, name), LABEL_JOB: store, LABEL_COMPONENT: "coordinator"}
    container = k8s.V1Container(
        name="store",
        image=spec.image,
        command=["python", "-m", "trainyard.backends.store", f"--port={STORE_PORT}"],
        env=[
            k8s.V1EnvVar(
                name=STORE_BIND_VARIABLE,
                value_from=k8s.V1EnvVarSource(field_ref=k8s.V1ObjectFieldSelector(field_path="status.podIP")),
            ),
            *scratch_env(),
        ],
        resources=k8s.V1ResourceRequirements(requests=dict(STORE_RESOURCES), limits=dict(STORE_RESOURCES)),
        ports=[k8s.V1ContainerPort(name="store", container_port=STORE_PORT, protocol="TCP")],
        security_context=container_security_context(),
    )
    return k8s.V1Pod(
        api_version="v1",
        kind="Pod",
        metadata=k8s.V1ObjectMeta(name=store, namespace=spec.namespace, labels=labels),
        spec=k8s.V1PodSpec(
            containers=[container],
            restart_policy="Never",
            automount_service_account_token=False,  # it calls no API
            enable_service_links=False,
            node_selector=dict(spec.node_selector) or None,
            tolerations=tolerations(spec),
            affinity=k8s.V1Affinity(node_affinity=node_affinity([not_evicted_requirement(spec)])),
            security_context=pod_security_context(),
            volumes=[k8s.V1Volume(name="tmp", empty_dir=k8s.V1EmptyDirVolumeSource())],
        ),
    )


def store_service(plan: LaunchPlan, spec: KubernetesSpec) -> k8s.V1Service:
    """A ClusterIP Service in front of the coordinator pod: the address the ranks and the orchestrator dial."""
    name, store = object_name(plan), store_name(object_name(plan))
    return k8s.V1Service(
        api_version="v1",
        kind="Service",
        metadata=k8s.V1ObjectMeta(name=store, namespace=spec.namespace, labels=attempt_labels(plan, name)),
        spec=k8s.V1ServiceSpec(
            type="ClusterIP",
            selector={LABEL_JOB: store},
            ports=[k8s.V1ServicePort(name="store", port=STORE_PORT, target_port=STORE_PORT, protocol="TCP")],
        ),
    )


def key_secret(plan: LaunchPlan, spec: KubernetesSpec) -> k8s.V1Secret:
    """Each node's key to the attempt's store, one entry per node (a pod's env names only its own)."""
    name = object_name(plan)
    if not plan.store_keys:
        raise ValueError(f"attempt {plan.attempt} of run {plan.run_id}: an in-place plan must carry store_keys")
    data = {node: base64.b64encode(key.encode()).decode() for node, key in plan.store_keys.items()}
    return k8s.V1Secret(
        api_version="v1",
        kind="Secret",
        metadata=k8s.V1ObjectMeta(name=store_name(name), namespace=spec.namespace, labels=attempt_labels(plan, name)),
        type="Opaque",
        immutable=True,  # the attempt's keys never change; a new attempt has a Secret of its own
        data=data,
    )


def build_in_place(plan: LaunchPlan, spec: KubernetesSpec, launcher: tuple[str, str] | None = None) -> InPlaceObjects:
    """Every object of an in-place attempt; pure (names from the plan), as ``objects.build_objects``."""
    return InPlaceObjects(
        name=object_name(plan),
        pods=[node_pod(plan, spec, node, launcher) for node in plan.nodes],
        coordinator=coordinator_pod(plan, spec),
        service=store_service(plan, spec),
        secret=key_secret(plan, spec),
        podgroup=build_podgroup(plan, spec) if spec.scheduler == "volcano" else None,
    )
