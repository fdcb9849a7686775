"""Kubernetes objects of an attempt and of the pressure test, checked against the official schema.

Objects are built from a plan with no cluster, serialized the way the client
sends them (``ApiClient().sanitize_for_serialization``) and validated with
``kubernetes_validate`` (strict: an unknown field fails). The PodGroup is a
Volcano custom resource the official schema lacks, so its shape is asserted
directly. The pod-to-status mapping is a table of pods as the API returns them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes.client import ApiClient

from trainyard.backends.base import AttemptStatus, LaunchPlan, NodeStatus, status_from_dicts, status_to_dicts
from trainyard.backends.kubernetes.names import (
    GROUP_NAME_ANNOTATION,
    LABEL_JOB,
    MAX_JOB_NAME,
    label_value,
    object_name,
    rendezvous_endpoint,
)
from trainyard.backends.kubernetes.objects import build_objects
from trainyard.backends.kubernetes.paths import hot_mount_path
from trainyard.backends.kubernetes.status import attempt_status, pod_node_status
from trainyard.burnin.args import Drill, node_args
from trainyard.burnin.kubernetes import build_burnin_pod
from trainyard.protocol.env import TrainEnv
from trainyard.spec import KubernetesSpec, PressureTestSpec

ROOT = Path(__file__).resolve().parents[2]
K8S_VERSION = "1.37"  # the newest schema kubernetes-validate 1.37.0 ships
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # DNS-1035: also what a Service name must be
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
CONTRACT = [
    "TRAINYARD_DATA_DIR",
    "TRAINYARD_CHECKPOINT_DIR",
    "TRAINYARD_RESUME_FROM",
    "TRAINYARD_MAX_STEPS",
    "TRAINYARD_GLOBAL_BATCH",
    "TRAINYARD_MICRO_BATCH",
    "TRAINYARD_CHECKPOINT_EVERY",
    "TRAINYARD_CHECKPOINT_ASYNC",
    "TRAINYARD_SEED",
    "TRAINYARD_HEARTBEAT_DIR",
    "TRAINYARD_EVENTS_DIR",
    "TRAINYARD_RUN_ID",
    "TRAINYARD_ATTEMPT",
    "TRAINYARD_PROGRESS_EVERY_S",
]
HOME = "/mnt/trainyard"

SETTINGS = {
    "default-cpu": KubernetesSpec(image="registry.local/trainer:1", namespace="ml"),
    "default-gpu": KubernetesSpec(
        image="registry.local/trainer:1",
        namespace="ml",
        gpus=8,
        cpu="32",
        memory="256Gi",
        node_selector={"nvidia.com/gpu.product": "H100"},
        hot_pvc="trainyard-hot",
        service_account="trainyard-trainer",
        tolerations=[
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
            {"key": "spot", "operator": "Equal", "value": "true", "effect": "NoExecute", "tolerationSeconds": "300"},
        ],
    ),
    "volcano": KubernetesSpec(
        image="registry.local/trainer:1",
        namespace="ml",
        scheduler="volcano",
        cpu="500m",
        memory="3Gi",
        gpus=1,
        hot_pvc="trainyard-hot",
    ),
}


def make_plan(
    nodes: int = 3,
    run_id: str = "scheduled__2026-03-01T02:00:00+00:00",
    attempt: int = 2,
    env: dict[str, str] | None = None,
    args: list[str] | None = None,
) -> LaunchPlan:
    run = f"{HOME}/runs/tiny/{run_id}"
    base = {
        "TRAINYARD_DATA_DIR": f"{HOME}/hot/tokens/2026-03-01",
        "TRAINYARD_CHECKPOINT_DIR": f"{HOME}/checkpoints/tiny",
        "TRAINYARD_RESUME_FROM": "latest",
        "TRAINYARD_HEARTBEAT_DIR": f"{run}/attempt-{attempt}/heartbeat",
        "TRAINYARD_EVENTS_DIR": f"{run}/events.d",
        "TRAINYARD_RUN_ID": run_id,
        "TRAINYARD_ATTEMPT": str(attempt),
        "TRAINYARD_MAX_STEPS": "120",
        "TRAINYARD_GLOBAL_BATCH": "48",
        "TRAINYARD_MICRO_BATCH": "2",
        "TRAINYARD_CHECKPOINT_EVERY": "20",
        "TRAINYARD_CHECKPOINT_ASYNC": "1",
        "TRAINYARD_SEED": "0",
        "TRAINYARD_PROGRESS_EVERY_S": "30.0",
    }
    return LaunchPlan(
        run_id=run_id,
        attempt=attempt,
        nodes=[f"node-{i}" for i in range(nodes)],
        procs_per_node=2,
        entrypoint="trainyard.workload",
        args=args if args is not None else ["--lr", "0.01"],
        train_env=TrainEnv.from_env({"TRAINYARD_MAX_STEPS": "120", **env} if env is not None else base),
        log_dir=Path(f"{run}/attempt-{attempt}"),
    )


def wire(obj: Any) -> dict[str, Any]:
    """What the client puts on the wire."""
    return json.loads(json.dumps(ApiClient().sanitize_for_serialization(obj)))


def validate(doc: dict[str, Any]) -> None:
    assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True) == K8S_VERSION


def container(job: dict[str, Any]) -> dict[str, Any]:
    (only,) = job["spec"]["template"]["spec"]["containers"]
    return only


# ---------------------------------------------------------------- schema


@pytest.mark.parametrize("setting", SETTINGS)
def test_job_and_service_are_valid_kubernetes_objects(setting: str) -> None:
    objects = build_objects(make_plan(), SETTINGS[setting])
    validate(wire(objects.job))
    validate(wire(objects.service))


def test_an_unknown_field_fails_the_schema_check() -> None:
    # Guards the check itself: a misspelt field must not pass as valid.
    job = wire(build_objects(make_plan(), SETTINGS["default-cpu"]).job)
    job["spec"]["completionsMode"] = "Indexed"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(job)


# ---------------------------------------------------------------- the Job


@pytest.mark.parametrize("setting", SETTINGS)
def test_job_is_indexed_gang_of_nodes_with_no_retries(setting: str) -> None:
    job = wire(build_objects(make_plan(nodes=3), SETTINGS[setting]).job)
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"], spec["backoffLimit"]) == (
        "Indexed",
        3,
        3,
        0,
    )
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    assert job["metadata"]["namespace"] == "ml"


def test_each_pod_runs_torchrun_with_its_index_as_node_rank_and_pod_0_as_rendezvous() -> None:
    plan = make_plan(nodes=4)
    objects = build_objects(plan, SETTINGS["default-cpu"])
    name = objects.name
    pod = wire(objects.job)["spec"]["template"]["spec"]
    trainer = pod["containers"][0]
    assert trainer["command"] == ["python", "-m", "torch.distributed.run"]
    endpoint = f"{name}-0.{name}.ml.svc.cluster.local:29400"
    assert trainer["args"] == [
        "--nnodes=4",
        "--nproc-per-node=2",
        "--node-rank=$(JOB_COMPLETION_INDEX)",
        "--rdzv-backend=static",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={plan.run_id}-a2",
        "--max-restarts=0",
        "-m",
        "trainyard.workload",
        "--lr",
        "0.01",
    ]
    assert rendezvous_endpoint(name, "ml") == endpoint
    # The per-pod DNS name exists only if the pods' subdomain is the headless Service.
    service = wire(objects.service)
    assert pod["subdomain"] == service["metadata"]["name"] == name
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {LABEL_JOB: name}
    assert service["spec"]["ports"] == [{"name": "rdzv", "port": 29400, "protocol": "TCP", "targetPort": 29400}]
    assert wire(objects.job)["spec"]["template"]["metadata"]["labels"][LABEL_JOB] == name
    # $(JOB_COMPLETION_INDEX) only expands if the variable is declared in the container.
    index_var = next(e for e in trainer["env"] if e["name"] == "JOB_COMPLETION_INDEX")
    assert (
        index_var["valueFrom"]["fieldRef"]["fieldPath"]
        == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )


def test_a_script_entrypoint_and_a_custom_cluster_domain() -> None:
    plan = LaunchPlan(**{**make_plan().__dict__, "entrypoint": "/opt/train.py", "args": []})
    spec = KubernetesSpec(image="t", cluster_domain="corp.example")
    objects = build_objects(plan, spec)
    args = container(wire(objects.job))["args"]
    assert args[-1] == "/opt/train.py" and "-m" not in args
    assert f"--rdzv-endpoint={objects.name}-0.{objects.name}.default.svc.corp.example:29400" in args


def test_the_specs_folder_and_variables_reach_the_container_and_the_image_keeps_its_workdir() -> None:
    given = LaunchPlan(**{**make_plan().__dict__, "workdir": "/src/nanogpt", "script_env": {"WANDB_MODE": "$(x)"}})
    trainer = container(wire(build_objects(given, SETTINGS["default-cpu"]).job))
    validate(wire(build_objects(given, SETTINGS["default-cpu"]).job))
    assert trainer["workingDir"] == "/src/nanogpt"
    assert {"name": "WANDB_MODE", "value": "$$(x)"} in trainer["env"]
    assert "workingDir" not in container(wire(build_objects(make_plan(), SETTINGS["default-cpu"]).job))


def test_dollars_in_the_plan_reach_the_process_literally() -> None:
    # Kubernetes expands $(VAR) in args and env values; "$$" is its escape for "$".
    plan = make_plan(
        args=["--tag", "$(HOME)-$x"], env={"TRAINYARD_DATA_DIR": "/d/$(x)", "TRAINYARD_CHECKPOINT_DIR": "/d/l"}
    )
    trainer = container(wire(build_objects(plan, SETTINGS["default-cpu"]).job))
    assert trainer["args"][-2:] == ["--tag", "$$(HOME)-$$x"]
    assert {"name": "TRAINYARD_DATA_DIR", "value": "/d/$$(x)"} in trainer["env"]


@pytest.mark.parametrize("setting", SETTINGS)
def test_the_env_contract_and_the_node_identity(setting: str) -> None:
    trainer = container(wire(build_objects(make_plan(), SETTINGS[setting]).job))
    env = {e["name"]: e for e in trainer["env"]}
    for name in CONTRACT:
        # A pod's heartbeat folder is its host's: mounted alone there with a claim, else named by the variable.
        own = "" if name != "TRAINYARD_HEARTBEAT_DIR" or SETTINGS[setting].hot_pvc else "/$(TRAINYARD_NODE)"
        assert env[name]["value"] == make_plan().env[name].replace("$", "$$") + own
    assert env["TRAINYARD_NODE"] == {
        "name": "TRAINYARD_NODE",
        "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}},
    }


def test_a_node_name_in_the_plan_env_does_not_override_the_pods_own() -> None:
    plan = make_plan(env={**make_plan().env, "TRAINYARD_NODE": "node-0"})
    env = container(wire(build_objects(plan, SETTINGS["default-cpu"]).job))["env"]
    assert [e for e in env if e["name"] == "TRAINYARD_NODE"] == [
        {"name": "TRAINYARD_NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
    ]


@pytest.mark.parametrize("setting", SETTINGS)
def test_pods_run_as_non_root_with_no_privileges(setting: str) -> None:
    pod = wire(build_objects(make_plan(), SETTINGS[setting]).job)["spec"]["template"]["spec"]
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "runAsGroup": 1000,
        "fsGroup": 0,  # the Airflow image's group: both sides write the hot tier (test_deploy_files)
        "fsGroupChangePolicy": "OnRootMismatch",
        "supplementalGroups": [0],
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert pod["containers"][0]["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    # The image is read-only: temporary files and caches go to an emptyDir.
    assert {"name": "tmp", "emptyDir": {}} in pod["volumes"]
    assert {"name": "tmp", "mountPath": "/tmp"} in pod["containers"][0]["volumeMounts"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["TMPDIR"] == env["HOME"] == "/tmp"


@pytest.mark.parametrize("setting", SETTINGS)
def test_pods_are_pinned_to_the_plans_hosts_avoid_evicted_nodes_and_each_other(setting: str) -> None:
    plan = make_plan()
    objects = build_objects(plan, SETTINGS[setting])
    affinity = wire(objects.job)["spec"]["template"]["spec"]["affinity"]
    terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    # ONE term: its requirements are ANDed (separate terms would be ORed, and "not evicted" alone would do).
    assert terms == [
        {
            "matchExpressions": [{"key": "trainyard.io/evicted", "operator": "DoesNotExist"}],
            "matchFields": [{"key": "metadata.name", "operator": "In", "values": plan.nodes}],
        }
    ]
    assert affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == [
        {"labelSelector": {"matchLabels": {LABEL_JOB: objects.name}}, "topologyKey": "kubernetes.io/hostname"}
    ]


def test_cpu_setting_has_no_gpu_no_pvc_no_scheduler_and_guaranteed_resources() -> None:
    pod = wire(build_objects(make_plan(), SETTINGS["default-cpu"]).job)["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"] == {
        "limits": {"cpu": "1", "memory": "2Gi"},
        "requests": {"cpu": "1", "memory": "2Gi"},
    }
    assert "schedulerName" not in pod and "nodeSelector" not in pod and "tolerations" not in pod
    assert [v["name"] for v in pod["volumes"]] == ["dshm", "tmp"]
    assert pod["automountServiceAccountToken"] is False and "serviceAccountName" not in pod


def test_gpu_setting_has_gpus_selector_tolerations_and_the_hot_tier() -> None:
    plan = make_plan()
    pod = wire(build_objects(plan, SETTINGS["default-gpu"]).job)["spec"]["template"]["spec"]
    trainer = pod["containers"][0]
    assert trainer["resources"]["limits"] == {"cpu": "32", "memory": "256Gi", "nvidia.com/gpu": "8"}
    assert trainer["resources"]["requests"] == trainer["resources"]["limits"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "H100"}
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "spot", "operator": "Equal", "value": "true", "effect": "NoExecute", "tolerationSeconds": 300},
    ]
    assert pod["serviceAccountName"] == "trainyard-trainer" and "automountServiceAccountToken" not in pod
    assert {"name": "hot", "persistentVolumeClaim": {"claimName": "trainyard-hot"}} in pod["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in trainer["volumeMounts"]


def test_volcano_setting_adds_scheduler_group_annotation_and_a_podgroup() -> None:
    objects = build_objects(make_plan(nodes=3), SETTINGS["volcano"])
    template = wire(objects.job)["spec"]["template"]
    assert template["spec"]["schedulerName"] == "volcano"
    assert template["metadata"]["annotations"][GROUP_NAME_ANNOTATION] == objects.name
    group = objects.podgroup
    assert group is not None
    # Not in the official schema (a CRD): its shape, as Volcano's v1beta1 API reads it.
    assert set(group) == {"apiVersion", "kind", "metadata", "spec"}
    assert (group["apiVersion"], group["kind"]) == ("scheduling.volcano.sh/v1beta1", "PodGroup")
    assert group["metadata"]["name"] == objects.name and group["metadata"]["namespace"] == "ml"
    assert group["spec"] == {
        "minMember": 3,
        "minResources": {"cpu": "1500m", "memory": str(9 * 2**30), "nvidia.com/gpu": "3"},
    }
    assert json.loads(json.dumps(group)) == group
    assert build_objects(make_plan(), SETTINGS["default-cpu"]).podgroup is None


# ---------------------------------------------------------------- names


@pytest.mark.parametrize(
    "run_id",
    [
        "manual__2026-03-01T02:00:00.123456+00:00",
        "scheduled__2026-03-01T02:00:00+00:00",
        "backfill__" + "x" * 200,
        "UPPER_and.dots",
        "---",
    ],
)
def test_names_are_dns_labels_short_enough_for_every_pod_hostname(run_id: str) -> None:
    plan = make_plan(nodes=512, run_id=run_id)
    name = object_name(plan)
    assert DNS_LABEL.match(name) and len(name) <= MAX_JOB_NAME
    assert len(f"{name}-511") <= 63  # the hostname of the last pod
    assert len(f"{name}-0.{name}") <= 253
    labels = wire(build_objects(plan, SETTINGS["default-cpu"]).job)["metadata"]["labels"]
    assert all(LABEL_VALUE.match(v) and len(v) <= 63 for v in labels.values())


def test_names_are_stable_per_attempt_and_distinct_across_attempts_and_runs() -> None:
    plan = make_plan()
    assert object_name(plan) == object_name(make_plan())
    assert object_name(plan) != object_name(make_plan(attempt=3))
    # Two run ids that sanitize to the same text still get different names.
    assert object_name(make_plan(run_id="a:b")) != object_name(make_plan(run_id="a+b"))
    other_pipeline = LaunchPlan(**{**plan.__dict__, "log_dir": Path("/mnt/trainyard/runs/other") / plan.run_id})
    assert object_name(other_pipeline) != object_name(plan)
    assert label_value("node-3") == "node-3" and label_value("a:b") != label_value("a+b")


# ---------------------------------------------------------------- hot tier and tolerations


def test_hot_mount_is_the_deepest_shared_folder_or_the_spec_says_where() -> None:
    plan = make_plan()
    assert hot_mount_path(plan, SETTINGS["default-gpu"]) == HOME
    spec = KubernetesSpec(image="t", hot_pvc="hot", hot_mount="/mnt")
    assert hot_mount_path(plan, spec) == "/mnt"
    with pytest.raises(ValueError, match="hot_mount: /elsewhere does not hold"):
        hot_mount_path(plan, KubernetesSpec(image="t", hot_pvc="hot", hot_mount="/elsewhere"))
    scattered = make_plan(env={"TRAINYARD_DATA_DIR": "/data/x", "TRAINYARD_CHECKPOINT_DIR": "/ckpt/y"})
    with pytest.raises(ValueError, match="share no folder but '/'"):
        build_objects(scattered, SETTINGS["default-gpu"])
    build_objects(scattered, SETTINGS["default-cpu"])  # no PVC, nothing to mount


# ---------------------------------------------------------------- what a pod may see and do


def hot_mounts(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "hot"}


@pytest.mark.parametrize("setting", ["default-gpu", "volcano"])
def test_pods_mount_only_their_attempts_folders_and_the_dataset_read_only(setting: str) -> None:
    run_dir = str(make_plan().log_dir.parent)
    plan = make_plan(env={**make_plan().env, "TRAINYARD_EVENTS_DIR": f"{run_dir}/events.d"})
    pod = wire(build_objects(plan, SETTINGS[setting]).job)["spec"]["template"]["spec"]
    env = plan.env
    # Each its own subPath of the claim (whose root the orchestrator sees at HOME), at the orchestrator's path.
    assert hot_mounts(pod) == {
        env["TRAINYARD_CHECKPOINT_DIR"]: {
            "name": "hot",
            "mountPath": env["TRAINYARD_CHECKPOINT_DIR"],
            "subPath": "checkpoints/tiny",
        },
        # Only its host's folder of the attempt's (the kubelet expands the pod's spec.nodeName): a pod writes
        # no other node's beats or failure records, so it can blame no other node.
        env["TRAINYARD_HEARTBEAT_DIR"]: {
            "name": "hot",
            "mountPath": env["TRAINYARD_HEARTBEAT_DIR"],
            "subPathExpr": env["TRAINYARD_HEARTBEAT_DIR"].removeprefix(HOME + "/") + "/$(TRAINYARD_NODE)",
        },
        # The run's events folder, where each pod appends a file of its own; never the orchestrator's events.jsonl.
        env["TRAINYARD_EVENTS_DIR"]: {
            "name": "hot",
            "mountPath": env["TRAINYARD_EVENTS_DIR"],
            "subPath": env["TRAINYARD_EVENTS_DIR"].removeprefix(HOME + "/"),
        },
        env["TRAINYARD_DATA_DIR"]: {
            "name": "hot",
            "mountPath": env["TRAINYARD_DATA_DIR"],
            "subPath": "hot/tokens/2026-03-01",
            "readOnly": True,
        },
    }
    # Not the tier's root, not the run folder (pinned spec, report), not other pipelines' checkpoints.
    assert not {HOME, run_dir, str(plan.log_dir), f"{HOME}/checkpoints", f"{run_dir}/events.jsonl"} & set(
        hot_mounts(pod)
    )
    # Every path the pod is told about lies in what it mounts.
    trainer_env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    for key in ("TRAINYARD_DATA_DIR", "TRAINYARD_CHECKPOINT_DIR", "TRAINYARD_HEARTBEAT_DIR", "TRAINYARD_EVENTS_DIR"):
        assert any(Path(trainer_env[key]).is_relative_to(m) for m in hot_mounts(pod)), key


def test_a_resume_path_outside_the_checkpoints_is_mounted_read_only() -> None:
    other = f"{HOME}/checkpoints/other/step_000100"
    plan = make_plan(env={**make_plan().env, "TRAINYARD_RESUME_FROM": other})
    mounts = hot_mounts(wire(build_objects(plan, SETTINGS["default-gpu"]).job)["spec"]["template"]["spec"])
    assert mounts[other] == {
        "name": "hot",
        "mountPath": other,
        "subPath": "checkpoints/other/step_000100",
        "readOnly": True,
    }
    inside = make_plan(env={**make_plan().env, "TRAINYARD_RESUME_FROM": f"{HOME}/checkpoints/tiny/step_000100"})
    mounts = hot_mounts(wire(build_objects(inside, SETTINGS["default-gpu"]).job)["spec"]["template"]["spec"])
    assert f"{HOME}/checkpoints/tiny/step_000100" not in mounts  # its own lineage's folder already holds it


def test_a_path_climbing_out_of_the_tier_is_refused() -> None:
    plan = make_plan(env={**make_plan().env, "TRAINYARD_DATA_DIR": f"{HOME}/hot/../../etc"})
    with pytest.raises(ValueError, match=r"without '\.\.'"):
        build_objects(plan, SETTINGS["default-gpu"])


def test_no_pod_runs_as_the_launchers_own_account(monkeypatch: pytest.MonkeyPatch) -> None:
    # The spec refuses this account; the launcher refuses it again (a spec built past validation).
    monkeypatch.setenv("AIRFLOW__TRAINYARD__POD_SERVICE_ACCOUNTS", "airflow-worker")  # even if the admin allowed it
    with pytest.raises(ValueError, match="launcher's own service account"):
        KubernetesSpec(image="t", namespace="trainyard", service_account="trainyard-launcher")
    own = KubernetesSpec.model_construct(
        **{**KubernetesSpec(image="t", namespace="trainyard").__dict__, "service_account": "trainyard-launcher"}
    )
    with pytest.raises(ValueError, match="service_account: 'trainyard-launcher' is the launcher's own account"):
        build_objects(make_plan(), own)
    with pytest.raises(ValueError, match="launcher's own account"):
        burnin_pod(own)
    # The account the launcher really calls the API as (from its token), in the pods' namespace.
    worker = KubernetesSpec(image="t", namespace="ml", service_account="airflow-worker")
    with pytest.raises(ValueError, match="'airflow-worker' is the launcher's own"):
        build_objects(make_plan(), worker, ("ml", "airflow-worker"))
    build_objects(make_plan(), worker, ("other-ns", "airflow-worker"))  # another namespace's account of that name


def test_the_launcher_knows_its_own_account_from_its_token() -> None:
    import base64

    from kubernetes.client import Configuration

    from trainyard.backends.kubernetes.pods import token_account

    def client(auth: str | None) -> ApiClient:
        config = Configuration()
        if auth is not None:
            config.api_key = {"authorization": auth}
        return ApiClient(config)

    claims = base64.urlsafe_b64encode(json.dumps({"sub": "system:serviceaccount:ml:airflow-worker"}).encode())
    token = f"eyJhbGciOiJSUzI1NiJ9.{claims.decode().rstrip('=')}.c2ln"
    assert token_account(client(f"Bearer {token}")) == ("ml", "airflow-worker")
    assert token_account(client("Bearer not-a-jwt")) is None
    assert token_account(client(None)) is None
    user = base64.urlsafe_b64encode(json.dumps({"sub": "alice"}).encode()).decode()
    assert token_account(client(f"Bearer x.{user}.y")) is None


def test_an_unknown_toleration_key_is_named() -> None:
    spec = KubernetesSpec(image="t", tolerations=[{"key": "a", "oprator": "Exists"}])
    with pytest.raises(ValueError, match=r"tolerations\[0\]: unknown key\(s\) oprator"):
        build_objects(make_plan(), spec)


def test_new_spec_fields_are_validated() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        KubernetesSpec(image="t", hot_mount="relative/path")
    with pytest.raises(ValidationError):
        KubernetesSpec(image="t", evict_with="cordon")
    assert KubernetesSpec(image="t").evict_with == "label"


# ---------------------------------------------------------------- pods -> statuses


def pod(
    phase: str,
    *,
    node: str | None = "k8s-a",
    index: int = 0,
    reason: str | None = None,
    state: dict[str, Any] | None = None,
    last: dict[str, Any] | None = None,
    conditions: list[dict[str, Any]] | None = None,
    deleting: bool = False,
) -> Any:
    """A V1Pod as the client deserializes it from the API server's JSON."""
    body: dict[str, Any] = {
        "metadata": {
            "name": f"job-{index}-abcde",
            "namespace": "ml",
            "annotations": {"batch.kubernetes.io/job-completion-index": str(index)},
        },
        "spec": {"containers": [{"name": "trainer", "image": "t"}], **({"nodeName": node} if node else {})},
        "status": {
            "phase": phase,
            **({"reason": reason} if reason else {}),
            **({"conditions": conditions} if conditions else {}),
        },
    }
    if deleting:
        body["metadata"]["deletionTimestamp"] = "2026-03-01T03:00:00Z"
    if state is not None or last is not None:
        body["status"]["containerStatuses"] = [
            {
                "name": "trainer",
                "image": "t",
                "imageID": "",
                "ready": False,
                "restartCount": 1 if last else 0,
                "state": state or {},
                **({"lastState": last} if last else {}),
            }
        ]
    return ApiClient().deserialize(SimpleNamespace(data=json.dumps(body)), "V1Pod")


def terminated(code: int, reason: str) -> dict[str, Any]:
    return {"terminated": {"exitCode": code, "reason": reason}}


NOW = datetime(2026, 3, 1, 3, 0, tzinfo=UTC).timestamp()


def unschedulable(message: str, since: str = "2026-03-01T02:59:00Z") -> list[dict[str, Any]]:
    return [
        {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": message,
            "lastTransitionTime": since,
        }
    ]


DISRUPTED = [{"type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager"}]
PREEMPTED = [{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}]

STATUS_CASES = [
    ("pending-unscheduled", pod("Pending", node=None), NodeStatus("node-0", "running")),
    (
        "unschedulable-on-its-hosts",  # pinned to named hosts none of which takes it: waiting will not help
        pod(
            "Pending",
            node=None,
            conditions=unschedulable("0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector."),
        ),
        NodeStatus("node-0", "failed", None, reason="Unschedulable"),
    ),
    (
        "unschedulable-for-gpus-a-while",  # the last attempt's pods still hold them: wait
        pod(
            "Pending",
            node=None,
            conditions=unschedulable("0/2 nodes are available: 2 Insufficient nvidia.com/gpu.", "2026-03-01T02:55:00Z"),
        ),
        NodeStatus("node-0", "running"),
    ),
    (
        "unschedulable-for-gpus-too-long",
        pod(
            "Pending",
            node=None,
            conditions=unschedulable("0/2 nodes are available: 2 Insufficient nvidia.com/gpu.", "2026-03-01T02:40:00Z"),
        ),
        NodeStatus("node-0", "failed", None, reason="Unschedulable"),
    ),
    (
        "pending-pulling",
        pod("Pending", state={"waiting": {"reason": "ContainerCreating"}}),
        NodeStatus("node-0", "running", host="k8s-a"),
    ),
    ("running", pod("Running", state={"running": {}}), NodeStatus("node-0", "running", host="k8s-a")),
    (
        "succeeded",
        pod("Succeeded", state=terminated(0, "Completed")),
        NodeStatus("node-0", "succeeded", 0, host="k8s-a"),
    ),
    (
        "user-error",
        pod("Failed", state=terminated(1, "Error")),
        NodeStatus("node-0", "failed", 1, reason="Error", host="k8s-a"),
    ),
    (
        "oom",
        pod("Failed", state=terminated(137, "OOMKilled")),
        NodeStatus("node-0", "failed", 137, reason="OOMKilled", host="k8s-a"),
    ),
    ("evicted", pod("Failed", reason="Evicted"), NodeStatus("node-0", "failed", None, reason="Evicted", host="k8s-a")),
    (
        "evicted-after-start",
        pod("Failed", reason="Evicted", state=terminated(137, "Error")),
        NodeStatus("node-0", "failed", 137, reason="Evicted", host="k8s-a"),
    ),
    (
        "deadline",
        pod("Failed", reason="DeadlineExceeded"),
        NodeStatus("node-0", "failed", None, reason="DeadlineExceeded", host="k8s-a"),
    ),
    (
        "node-lost-running",
        pod("Running", reason="NodeLost", state={"running": {}}),
        NodeStatus("node-0", "failed", None, reason="NodeLost", host="k8s-a"),
    ),
    ("node-unknown", pod("Unknown"), NodeStatus("node-0", "failed", None, reason="NodeLost", host="k8s-a")),
    (
        "taint-eviction",
        pod("Running", state={"running": {}}, conditions=DISRUPTED, deleting=True),
        NodeStatus("node-0", "failed", None, reason="DeletionByTaintManager", host="k8s-a"),
    ),
    (
        "preempted",
        pod("Failed", state=terminated(143, "Error"), conditions=PREEMPTED),
        NodeStatus("node-0", "failed", 143, reason="PreemptionByScheduler", host="k8s-a"),
    ),
    (
        "image-pull",
        pod("Pending", state={"waiting": {"reason": "ImagePullBackOff"}}),
        NodeStatus("node-0", "failed", None, reason="ImagePullBackOff", host="k8s-a"),
    ),
    (
        "crash-loop",
        pod("Running", state={"waiting": {"reason": "CrashLoopBackOff"}}, last=terminated(2, "Error")),
        NodeStatus("node-0", "failed", 2, reason="CrashLoopBackOff", host="k8s-a"),
    ),
    (
        "exited-phase-lagging",
        pod("Running", state=terminated(3, "Error")),
        NodeStatus("node-0", "failed", 3, reason="Error", host="k8s-a"),
    ),
    (
        "deleting-without-disruption",
        pod("Running", state={"running": {}}, deleting=True),
        NodeStatus("node-0", "running", host="k8s-a"),
    ),
]


@pytest.mark.parametrize(("case", "given", "expected"), STATUS_CASES, ids=[c[0] for c in STATUS_CASES])
def test_pod_to_node_status(case: str, given: Any, expected: NodeStatus) -> None:
    assert pod_node_status(given, "node-0", NOW) == expected


def test_attempt_status_orders_by_index_and_keeps_the_telling_pod() -> None:
    nodes = ["node-0", "node-1", "node-2"]
    pods = [
        pod("Running", index=2, node="c", state={"running": {}}),
        pod("Succeeded", index=0, node="a"),
        pod("Running", index=1, node="b", state={"running": {}}),
        pod("Failed", index=1, node="b", state=terminated(137, "OOMKilled")),
    ]
    status = attempt_status(pods, nodes)
    # Slots follow the completion index; hosts are wherever the scheduler put each pod.
    assert [(n.slot, n.host) for n in status.nodes] == [("node-0", "a"), ("node-1", "b"), ("node-2", "c")]
    assert [n.node for n in status.nodes] == nodes  # the old name of the slot
    assert status.state == "failed"
    assert status.failed() == [NodeStatus("node-1", "failed", 137, reason="OOMKilled", host="b")]
    assert attempt_status([], nodes).nodes == [NodeStatus(n, "running") for n in nodes]
    stray = pod("Failed", index=7, state=terminated(1, "Error"))  # an index outside the plan is not this attempt's
    assert attempt_status([stray], nodes).state == "running"


def test_a_failed_job_fails_unfinished_nodes_only_when_no_pod_says_why() -> None:
    nodes = ["node-0", "node-1"]
    done, running = pod("Succeeded", index=0, node="a"), pod("Running", index=1, node="b", state={"running": {}})
    assert attempt_status([done, running], nodes, "DeadlineExceeded").nodes == [
        NodeStatus("node-0", "succeeded", 0, host="a"),
        NodeStatus("node-1", "failed", None, reason="DeadlineExceeded", host="b"),
    ]
    oom = pod("Failed", index=0, node="a", state=terminated(137, "OOMKilled"))
    assert attempt_status([oom, running], nodes, "BackoffLimitExceeded").nodes == [
        NodeStatus("node-0", "failed", 137, reason="OOMKilled", host="a"),
        NodeStatus("node-1", "running", host="b"),
    ]
    assert attempt_status([], nodes, "JobDeleted").failed() == [
        NodeStatus("node-0", "failed", reason="JobDeleted"),
        NodeStatus("node-1", "failed", reason="JobDeleted"),
    ]


def test_statuses_survive_a_json_round_trip() -> None:
    status = AttemptStatus(
        [NodeStatus("node-0", "failed", 137, "/logs/a.log", "OOMKilled", host="b"), NodeStatus("node-1", "running")]
    )
    assert status_from_dicts(json.loads(json.dumps(status_to_dicts(status)))) == status
    # An event written before slot and host were told apart (a trigger of the old code) still reads.
    old = [{"node": "k8s-1", "state": "failed", "exit_code": 137, "log": "", "reason": "OOMKilled"}]
    assert status_from_dicts(old).nodes == [NodeStatus("k8s-1", "failed", 137, reason="OOMKilled", host="k8s-1")]


# ---------------------------------------------------------------- burn-in pods


KEY = "ab" * 32


def burnin_pod(spec: KubernetesSpec, scratch: str = f"{HOME}/hot/.burnin") -> dict[str, Any]:
    schedule = SimpleNamespace(slot_s=4.0, collective_s=6.0)
    return wire(
        build_burnin_pod(
            "gpu-node-7",
            run_id="manual__2026-03-01",
            store="10.0.0.5:41000",
            schedule=schedule,
            cfg=PressureTestSpec(),
            spec=spec,
            scratch=scratch,
            timeout_s=34.0,
            key=KEY,
            drill=Drill("throttle", 0.3),
        )
    )


@pytest.mark.parametrize("setting", SETTINGS)
def test_burnin_pod_is_valid_pinned_and_non_root(setting: str) -> None:
    body = burnin_pod(SETTINGS[setting])
    validate(body)
    spec = body["spec"]
    assert spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"] == [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-node-7"]}]}
    ]
    trainer = spec["containers"][0]
    assert trainer["command"] == ["python", "-m", "trainyard.burnin.node"]
    assert trainer["args"][:4] == ["--node", "gpu-node-7", "--store", "10.0.0.5:41000"]
    assert {"name": "TRAINYARD_NODE", "value": "gpu-node-7"} in trainer["env"]
    assert trainer["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 1000
    assert trainer["securityContext"]["readOnlyRootFilesystem"] is True
    # Its per-run key is in its environment, never in its arguments (visible in every process list).
    assert {"name": "TRAINYARD_BURNIN_KEY", "value": KEY} in trainer["env"] and KEY not in " ".join(trainer["args"])
    assert trainer["image"] == SETTINGS[setting].image
    assert trainer["resources"] == container(wire(build_objects(make_plan(), SETTINGS[setting]).job))["resources"]
    # A node marked evicted by taint can still be re-tested.
    assert {"key": "trainyard.io/evicted", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert spec["restartPolicy"] == "Never" and spec["activeDeadlineSeconds"] == 34 + 60
    assert DNS_LABEL.match(body["metadata"]["name"]) and len(body["metadata"]["name"]) <= 63


def test_burnin_pod_names_differ_per_node_and_per_try() -> None:
    from trainyard.backends.kubernetes.probes import burnin_pod_name

    names = {burnin_pod_name("tiny/run-1", node, store) for node in ("a", "b") for store in ("h:1", "h:2")}
    assert len(names) == 4 and all(DNS_LABEL.match(n) and len(n) <= 63 for n in names)
    assert burnin_pod_name("tiny/run-1", "a", "h:1") == burnin_pod_name("tiny/run-1", "a", "h:1")


def test_burnin_pod_mounts_only_its_scratch_folder_of_the_hot_tier() -> None:
    # Without hot_mount: the folder of the scratch's name at the claim's root.
    assert hot_mounts(burnin_pod(SETTINGS["default-gpu"])["spec"]) == {
        f"{HOME}/hot/.burnin": {"name": "hot", "mountPath": f"{HOME}/hot/.burnin", "subPath": ".burnin"}
    }
    spec = KubernetesSpec(image="t", hot_pvc="hot", hot_mount=HOME)
    assert hot_mounts(burnin_pod(spec)["spec"]) == {
        f"{HOME}/hot/.burnin": {"name": "hot", "mountPath": f"{HOME}/hot/.burnin", "subPath": "hot/.burnin"}
    }
    with pytest.raises(ValueError, match="does not hold the burn-in scratch"):
        burnin_pod(KubernetesSpec(image="t", hot_pvc="hot", hot_mount="/elsewhere"))


def test_burnin_args_are_the_ones_the_local_pressure_test_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run the local pressure test with a Popen that records its argv, then compare."""
    from trainyard.backends.local import probes
    from trainyard.burnin import local
    from trainyard.burnin.protocol import Schedule

    seen: list[list[str]] = []

    class Recorder:
        returncode = 1

        def __init__(self, argv: list[str], **_: Any) -> None:
            seen.append(argv)

        def poll(self) -> int:
            return 1

        def wait(self) -> int:
            return 1

    monkeypatch.setattr(probes.subprocess, "Popen", Recorder)
    cfg = PressureTestSpec(duration_s=3.0, timeout_s=1.0, matmul_size=64, collective_sizes_kb=[8, 64])
    local.run_burn_in(["node-1"], cfg, tmp_path / "scratch", tmp_path / "logs", {"node-1": ("crash", 0.0)})
    (argv,) = seen
    assert argv[:3] == [sys.executable, "-m", "trainyard.burnin.node"]
    store = argv[argv.index("--store") + 1]
    timeout = float(argv[argv.index("--timeout") + 1])
    ours = node_args("node-1", store, Schedule.of(cfg, 1), cfg, str(tmp_path / "scratch"), timeout, Drill("crash", 0.0))
    assert argv[3:] == ours


# ---------------------------------------------------------------- docker/k8s manifests


def manifests(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((ROOT / "docker" / "k8s" / name).read_text()) if d]


@pytest.mark.parametrize(
    "name", ["launcher-rbac.yaml", "node-eviction-rbac.yaml", "hot-tier-pvc.yaml", "trainer-rbac.yaml"]
)
def test_manifests_are_valid_kubernetes_objects(name: str) -> None:
    docs = manifests(name)
    assert docs
    for doc in docs:
        validate(doc)


def test_launcher_role_grants_only_namespaced_training_verbs() -> None:
    by_kind = {d["kind"]: d for d in manifests("launcher-rbac.yaml")}
    assert set(by_kind) == {"ServiceAccount", "Role", "RoleBinding"}
    grants = {
        (g, r, v)
        for rule in by_kind["Role"]["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    assert not any("*" in part for grant in grants for part in grant)
    assert ("batch", "jobs", "create") in grants and ("scheduling.volcano.sh", "podgroups", "delete") in grants
    assert ("", "secrets", "get") not in grants and not any(r == "nodes" for _, r, _ in grants)
    binding = by_kind["RoleBinding"]
    assert binding["roleRef"]["name"] == by_kind["Role"]["metadata"]["name"]
    assert binding["subjects"][0]["name"] == by_kind["ServiceAccount"]["metadata"]["name"]


def test_cluster_role_only_reads_and_patches_nodes() -> None:
    role, binding = manifests("node-eviction-rbac.yaml")
    assert role["kind"] == "ClusterRole" and binding["kind"] == "ClusterRoleBinding"
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "patch"]}]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "trainyard-launcher", "namespace": "airflow"}]


def test_hot_tier_claim_is_shared_read_write() -> None:
    claims = [d for d in manifests("hot-tier-pvc.yaml") if d["kind"] == "PersistentVolumeClaim"]
    assert {c["metadata"]["namespace"] for c in claims} == {"trainyard", "airflow"}
    assert all(c["spec"]["accessModes"] == ["ReadWriteMany"] for c in claims)


# ---------------------------------------------------------------- the trigger


WATCH = {
    "attempt": 2,
    "started": 1795996612.5,
    "handle": {"namespace": "ml", "name": "ty-run-a1-0123abcd", "podgroup": False, "poll_s": 5.0, "connection": "k8s"},
    "nodes": ["node-0", "node-1"],
    "world_size": 2,
    "heartbeat_dir": "/hot/runs/r/attempt-1/heartbeat",
    "target_step": 1000,
    "in_place": True,
    "regrouped": True,
    "store": "10.96.0.7:29500",
    "generation": 2,
    "faults_seen": "1",
    "wake_s": 3600.0,
    "heartbeat_timeout_s": 60.0,
    "startup_grace_s": 120.0,
    "progress_every_s": 30.0,
    "tokens_per_step": 4096,
    "checkpoint_dir": "/hot/checkpoints/p",
}


def rebuilt(classpath: str, kwargs: dict[str, Any]) -> Any:
    """The trigger as the triggerer rebuilds it from the metadata DB's JSON."""
    module, _, cls = classpath.rpartition(".")
    return getattr(__import__(module, fromlist=[cls]), cls)(**json.loads(json.dumps(kwargs)))


def test_trigger_serializes_the_watch_it_was_given_as_is() -> None:
    from trainyard.airflow.triggers import CLASSPATH, KubernetesAttemptTrigger
    from trainyard.recovery.deferred import AttemptWatch

    watch = AttemptWatch.from_json(WATCH)
    classpath, kwargs = KubernetesAttemptTrigger(watch).serialize()
    assert classpath == CLASSPATH == "trainyard.airflow.triggers.KubernetesAttemptTrigger"
    assert kwargs == {"watch": WATCH, "config_file": None, "max_api_errors": 5}  # every field, none beside it
    again = rebuilt(classpath, kwargs)
    assert again.watch == watch and again.serialize() == (classpath, kwargs)
    assert (again.namespace, again.job_name, again.poll_interval) == ("ml", "ty-run-a1-0123abcd", 5.0)


def test_a_trigger_serialized_in_the_old_form_is_rebuilt_with_its_watch() -> None:
    """A task deferred by a version whose trigger took 26 arguments resumes under this one: the triggerer rebuilds
    the trigger from the old kwargs in the metadata DB, and it watches the same attempt the same way."""
    from trainyard.airflow.triggers import CLASSPATH
    from trainyard.recovery.deferred import AttemptWatch

    old = {
        "namespace": "ml",
        "job_name": "ty-run-a1-0123abcd",
        "nodes": ["node-0", "node-1"],
        "poll_interval": 5.0,
        "kubernetes_conn_id": "k8s",
        "config_file": None,
        "cluster_context": "prod",
        "in_cluster": None,
        "timeout_s": 3600.0,
        "max_api_errors": 5,
        "heartbeat_dir": "/hot/runs/r/attempt-1/heartbeat",
        "heartbeat_timeout_s": 60.0,
        "world_size": 2,
        "started": 1795996612.5,
        "startup_grace_s": 120.0,
        "podgroup": False,
        "attempt": 2,
        "target_step": 1000,
        "tokens_per_step": 4096,
        "progress_every_s": 30.0,
        "checkpoint_dir": "/hot/checkpoints/p",
        "in_place": True,
        "regrouped": True,
        "store": "10.96.0.7:29500",
        "generation": 2,
        "faults_seen": "1",
    }
    trigger = rebuilt(CLASSPATH, old)
    assert trigger.watch == AttemptWatch.from_json(WATCH)
    assert trigger.serialize() == (CLASSPATH, {"watch": WATCH, "config_file": None, "max_api_errors": 5})


def test_the_local_pressure_test_and_classify_need_no_kubernetes_sdk() -> None:
    """With the SDK unimportable, the stages (local burn-in), classify and kube's SDK-free modules still load."""
    code = (
        "import sys; sys.modules['kubernetes'] = None\n"  # None in sys.modules: any import of it fails
        "import trainyard.pipeline.stages, trainyard.burnin.local, trainyard.recovery.classify\n"
        "import trainyard.backends.kubernetes.reasons, trainyard.backends.kubernetes.status, trainyard.backends.kubernetes.names\n"
        "assert not any(m.startswith('kubernetes.') for m in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ.copy())
    assert done.returncode == 0, done.stderr[-2000:]
