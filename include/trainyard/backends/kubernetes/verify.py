"""A checkpoint's hash verification as a Kubernetes Job: several pods, each hashing a slice of its files.

The gate's verification reads every byte of the checkpoint; on one Airflow worker that is the
worker's disk or network bandwidth, whatever the size. With ``nodes.kubernetes.verify_pods`` the gate
runs an Indexed Job of that many pods instead (the cluster's scheduler spreads them; each mounts the
checkpoint's folder of the hot-tier claim read-only): pod ``i`` checks every ``n``-th file from ``i``
(``trainyard.checkpoint.slices``) and prints its answer as one JSON line, which the gate reads from its
log. The gate trusts an answer only if every slice answered once, for the manifest the gate read
itself; a pod that failed, or a Job that did not finish in time, fails the gate's task (an error to
retry), never passes or condemns the checkpoint. The Job is deleted when the gate is done (and has a
TTL, for a gate that died first). The manifest's own checks, unlisted files and the tensors stay on the
worker: they read only the manifest and, streamed, the tensors.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainyard.atomic import loads_untrusted
from trainyard.backends.kubernetes import api
from trainyard.backends.kubernetes.models import k8s
from trainyard.backends.kubernetes.names import INDEX_ANNOTATION, LABEL_JOB, dns_label
from trainyard.backends.kubernetes.pods import (
    CONTAINER,
    PathMount,
    container_security_context,
    pod_account,
    pod_security_context,
    scratch_env,
    token_account,
    tolerations,
    volumes,
)
from trainyard.backends.kubernetes.probes import scratch_root
from trainyard.backends.kubernetes.status import attempt_status
from trainyard.checkpoint.format import manifest_digest
from trainyard.checkpoint.slices import RESULT_KEY
from trainyard.spec import KubernetesSpec

log = logging.getLogger(__name__)

TTL_S = 3600
"""A verification Job the gate did not delete (it died) goes this long after it finished."""
LOG_LINES = 20


class VerificationFailed(RuntimeError):
    """The Job could not give an answer (a pod failed, it timed out, an answer is missing): retry the task."""


def build_verify_job(
    name: str, ckpt: Path, pods: int, spec: KubernetesSpec, timeout_s: float, launcher: tuple[str, str] | None = None
) -> k8s.V1Job:
    """The Indexed Job of ``pods`` pods, each ``python -m trainyard.checkpoint.slices CKPT INDEX PODS``."""
    if not spec.hot_pvc:
        raise ValueError(
            "nodes.kubernetes.verify_pods needs nodes.kubernetes.hot_pvc: the pods read the checkpoint there"
        )
    vols, mounts = volumes(spec, scratch_root(spec, str(ckpt)), [PathMount(str(ckpt), read_only=True)])
    account = pod_account(spec, launcher)
    container = k8s.V1Container(
        name=CONTAINER,
        image=spec.image,
        command=["python", "-m", "trainyard.checkpoint.slices"],  # the trainer image's entrypoint is torchrun
        args=[str(ckpt).replace("$", "$$"), "$(JOB_COMPLETION_INDEX)", str(pods)],
        env=[
            # Declared so "$(JOB_COMPLETION_INDEX)" in the args expands, as in the training Job.
            k8s.V1EnvVar(
                name="JOB_COMPLETION_INDEX",
                value_from=k8s.V1EnvVarSource(
                    field_ref=k8s.V1ObjectFieldSelector(field_path=f"metadata.annotations['{INDEX_ANNOTATION}']")
                ),
            ),
            k8s.V1EnvVar(name="PYTHONUNBUFFERED", value="1"),
            *scratch_env(),
        ],
        # Hashing streams each file: memory is bounded whatever the checkpoint's size; no GPU.
        resources=k8s.V1ResourceRequirements(
            requests={"cpu": "1", "memory": "512Mi"}, limits={"cpu": "2", "memory": "1Gi"}
        ),
        volume_mounts=mounts,
        security_context=container_security_context(),
    )
    labels = {"app.kubernetes.io/name": "trainyard", "app.kubernetes.io/component": "verify", LABEL_JOB: name}
    return k8s.V1Job(
        api_version="batch/v1",
        kind="Job",
        metadata=k8s.V1ObjectMeta(name=name, namespace=spec.namespace, labels=labels),
        spec=k8s.V1JobSpec(
            completions=pods,
            parallelism=pods,
            completion_mode="Indexed",
            backoff_limit=0,
            active_deadline_seconds=math.ceil(timeout_s),
            ttl_seconds_after_finished=TTL_S,
            template=k8s.V1PodTemplateSpec(
                metadata=k8s.V1ObjectMeta(labels=labels),
                spec=k8s.V1PodSpec(
                    containers=[container],
                    restart_policy="Never",
                    service_account_name=account,
                    automount_service_account_token=None if account else False,
                    enable_service_links=False,
                    node_selector=dict(spec.node_selector) or None,
                    tolerations=tolerations(spec),
                    security_context=pod_security_context(),
                    volumes=vols,
                ),
            ),
        ),
    )


def verify_in_cluster(
    api_client: Any, spec: KubernetesSpec, ckpt: Path, pods: int, timeout_s: float, poll_s: float = 1.0
) -> Callable[[dict[str, Any]], list[str]]:
    """What checks the listed files for ``format.verify``: the Job, run when it is called with the manifest."""

    def hashed(manifest: dict[str, Any]) -> list[str]:
        return run_verify_job(api_client, spec, ckpt, pods, timeout_s, poll_s)

    return hashed


def run_verify_job(
    api_client: Any, spec: KubernetesSpec, ckpt: Path, pods: int, timeout_s: float, poll_s: float = 1.0
) -> list[str]:
    """The problems the Job's pods found in ``ckpt``'s files; ``VerificationFailed`` when it gave no answer."""
    from kubernetes import client

    apis = api.ClientApis.of(client, api_client)
    digest = manifest_digest(ckpt)
    name = dns_label(f"verify-{ckpt.name}", f"{ckpt}|{secrets.token_hex(8)}")
    slots = [f"slice-{i}" for i in range(pods)]
    job = build_verify_job(name, ckpt, pods, spec, timeout_s, token_account(api_client))
    api.drive(apis, api.create_job(spec.namespace, job))
    started = time.monotonic()
    try:
        while True:
            found = api.drive(apis, api.look(spec.namespace, name))
            status = attempt_status(found[0], slots, found[1])
            if status.state == "failed":
                why = "; ".join(f"{n.slot}: {n.reason or f'exit {n.exit_code}'}" for n in status.failed())
                raise VerificationFailed(
                    f"checkpoint verification Job {name} failed ({why}){_tails(apis, spec, found[0])}"
                )
            if status.state == "succeeded":
                return _answers(apis, spec, found[0], pods, digest, name)
            if time.monotonic() - started > timeout_s:
                raise VerificationFailed(f"checkpoint verification Job {name} did not finish in {timeout_s:.0f} s")
            time.sleep(poll_s)
    finally:
        api.drive(apis, api.delete(spec.namespace, name, podgroup=False))


def _answers(
    apis: api.ClientApis, spec: KubernetesSpec, pods: list[Any], count: int, digest: str, name: str
) -> list[str]:
    """Every slice's answer, read from its pod's log: each once, for the gate's manifest."""
    answers: dict[int, dict[str, Any]] = {}
    for pod in pods:
        text = api.call(apis, api.pod_log(pod.metadata.name, spec.namespace, CONTAINER, LOG_LINES))
        for line in reversed(text.splitlines()):
            try:
                answer = loads_untrusted(line, "a slice's answer")  # a pod's log: whatever it printed
            except ValueError:
                continue
            if isinstance(answer, dict) and isinstance(answer.get(RESULT_KEY), int):
                answers.setdefault(answer[RESULT_KEY], answer)
                break
    missing = [i for i in range(count) if i not in answers]
    if missing:
        raise VerificationFailed(f"checkpoint verification Job {name}: no answer from slice(s) {missing}")
    problems: list[str] = []
    for i in range(count):
        answer = answers[i]
        if answer.get("of") != count or answer.get("manifest") != digest:
            raise VerificationFailed(
                f"checkpoint verification Job {name}: slice {i} checked another manifest or split (changed meanwhile?)"
            )
        problems += [str(p) for p in answer.get("problems") or []]
    files = sum(int(a.get("files", 0)) for a in answers.values())
    size = sum(int(a.get("bytes", 0)) for a in answers.values())
    log.info("checkpoint verified by %d pods (Job %s): %d files, %.1f MB", count, name, files, size / 1e6)
    return problems


def _tails(apis: api.ClientApis, spec: KubernetesSpec, pods: list[Any]) -> str:
    texts = [api.call(apis, api.pod_log(p.metadata.name, spec.namespace, CONTAINER, 5)).strip() for p in pods[:3]]
    return "".join(f"\n--- {p.metadata.name}\n{t}" for p, t in zip(pods, texts) if t)
