"""Pieces of every trainyard pod (training and burn-in): who it runs as, what it mounts, where it may land.

Built as ``kubernetes`` client models, so they can be checked against the
official schema with no cluster.

Shared volume: the orchestrator (the Airflow image: uid 50000, primary gid 0)
and the pods (``RUN_AS_USER``, gid ``RUN_AS_USER``) both write the hot tier.
They meet in ``SHARED_GID`` (0, the Airflow image's own group, as OpenShift
does it): the pods carry it as ``fsGroup`` and a supplemental group, and the
folders the orchestrator makes for them are group-writable with the setgid
bit (``trainyard.backends.kubernetes.launcher.prepare_paths``), so what either side
creates there stays in that group.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from trainyard.backends.kubernetes.models import k8s
from trainyard.backends.kubernetes.names import HOSTNAME_KEY, LABEL_JOB
from trainyard.protocol.env import NODE_VARIABLES
from trainyard.spec import LAUNCHER_SERVICE_ACCOUNT, KubernetesSpec
from trainyard.spec.admin import pod_service_accounts

CONTAINER = "trainer"
GPU_RESOURCE = "nvidia.com/gpu"
HOT_VOLUME, SHM_VOLUME, TMP_VOLUME = "hot", "dshm", "tmp"
RUN_AS_USER = 1000  # the trainer image's user (docker/Dockerfile.trainer)
AIRFLOW_UID, AIRFLOW_GID = 50000, 0  # the Airflow image's user and primary group (docker/Dockerfile.airflow)
SHARED_GID = AIRFLOW_GID
"""The group both the orchestrator and the pods write the hot tier as."""
# The launcher's own service account (docker/k8s/launcher-rbac.yaml): it may create pods and
# mark nodes, so no pod it creates may run as it.
LAUNCHER_ACCOUNT = LAUNCHER_SERVICE_ACCOUNT  # the one name, in the spec models: the spec refuses it too
_TOLERATION_KEYS = {
    "key": "key",
    "operator": "operator",
    "value": "value",
    "effect": "effect",
    "tolerationSeconds": "toleration_seconds",
}


@dataclass(frozen=True)
class PathMount:
    """One path a pod sees of the hot tier: a folder (a file only where a caller still mounts one)."""

    path: str
    read_only: bool
    per_node: bool = False
    """Each pod mounts only its node's folder of it (``<path>/<spec.nodeName>``, by ``subPathExpr``) at ``path``."""


NODE_EXPR = f"$({NODE_VARIABLES[0]})"
"""The pod's node (``spec.nodeName`` through the downward API), as ``subPathExpr`` and env values expand it."""


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
    """Non-root, in ``SHARED_GID`` as well as its own group (see the module docstring).

    ``fsGroupChangePolicy: OnRootMismatch``: the kubelet re-groups a volume
    only when its root is not in the group yet, instead of walking a hot tier
    of checkpoints at every pod start.
    """
    return k8s.V1PodSecurityContext(
        run_as_non_root=True,
        run_as_user=RUN_AS_USER,
        run_as_group=RUN_AS_USER,
        fs_group=SHARED_GID,
        fs_group_change_policy="OnRootMismatch",
        supplemental_groups=[SHARED_GID],
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
    if account is not None and account not in pod_service_accounts():  # a spec built without validation
        raise ValueError(
            f"nodes.kubernetes.service_account: {account!r} is not an allowed pod service account"
            " ([trainyard] pod_service_accounts)"
        )
    return account


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
            # "$$" is a literal "$" where the kubelet expands $(VAR); the node's folder is expanded per pod.
            expr = f"{sub.replace('$', '$$')}/{NODE_EXPR}" if m.per_node else None
            mounts.append(
                k8s.V1VolumeMount(
                    name=HOT_VOLUME,
                    mount_path=m.path,
                    sub_path=None if sub == "." or expr else sub,
                    sub_path_expr=expr,
                    read_only=True if m.read_only else None,
                )
            )
    return vols, mounts


def not_evicted_requirement(spec: KubernetesSpec) -> k8s.V1NodeSelectorRequirement:
    """A node carrying the evicted label is out (the pressure test or recovery marked it)."""
    return k8s.V1NodeSelectorRequirement(key=spec.evicted_label, operator="DoesNotExist")


def on_hosts(hosts: list[str]) -> k8s.V1NodeSelectorRequirement:
    """Only these nodes, by name: a field (``metadata.name``), not the hostname label, which a node may lack."""
    return k8s.V1NodeSelectorRequirement(key="metadata.name", operator="In", values=list(hosts))


def node_affinity(
    match_expressions: list[k8s.V1NodeSelectorRequirement] | None = None,
    match_fields: list[k8s.V1NodeSelectorRequirement] | None = None,
) -> k8s.V1NodeAffinity:
    """Required node affinity of ONE term: its requirements all hold (terms would be ORed)."""
    term = k8s.V1NodeSelectorTerm(match_expressions=match_expressions, match_fields=match_fields)
    return k8s.V1NodeAffinity(
        required_during_scheduling_ignored_during_execution=k8s.V1NodeSelector(node_selector_terms=[term])
    )


def training_affinity(spec: KubernetesSpec, name: str, hosts: list[str]) -> k8s.V1Affinity:
    """On the plan's ``hosts`` (the ones the pressure test passed) and off evicted ones, in one term;
    and one training pod per host (a host lost must cost one rank group, not two)."""
    spread = k8s.V1PodAffinityTerm(
        label_selector=k8s.V1LabelSelector(match_labels={LABEL_JOB: name}), topology_key=HOSTNAME_KEY
    )
    return k8s.V1Affinity(
        node_affinity=node_affinity([not_evicted_requirement(spec)], [on_hosts(hosts)]),
        pod_anti_affinity=k8s.V1PodAntiAffinity(required_during_scheduling_ignored_during_execution=[spread]),
    )
