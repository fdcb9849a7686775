"""docker/helm/values.yaml: the official Airflow chart's values that run trainyard on Kubernetes.

Neither the chart nor helm can be had here (no network but the package registries), so the values are not
checked against the chart's values.schema.json; instead each pod the chart makes from them (the scheduler,
triggerer, API server, DAG processor and a KubernetesExecutor task pod) is rendered as far as these values
decide it (image, service account, security contexts, the global volumes and mounts, the environment) and
validated with ``kubernetes_validate`` (strict), then checked against the namespace's "restricted" Pod
Security Standard and the manifests in docker/k8s/ it relies on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from trainyard.backends.kubernetes.pods import AIRFLOW_GID, AIRFLOW_UID, LAUNCHER_ACCOUNT
from trainyard.protocol.live_metrics import otlp_endpoint

ROOT = Path(__file__).resolve().parents[2]
VALUES = ROOT / "docker" / "helm" / "values.yaml"
K8S_VERSION = "1.37"
AIRFLOW_NAMESPACE, TRAINING_NAMESPACE = "airflow", "trainyard"  # helm -n airflow; nodes.kubernetes.namespace
COMPONENTS = ["scheduler", "triggerer", "apiServer", "dagProcessor"]
# Who needs the hot tier, and why: the task pods stage and train, the triggerer reads a deferred attempt's
# heartbeats, the API server's training-runs view reads the run folders, the DAG processor checks specs.
HOT_TIER = ["worker", "triggerer", "apiServer", "dagProcessor"]


def values() -> dict[str, Any]:
    return yaml.safe_load(VALUES.read_text())


def manifests(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((ROOT / "docker" / "k8s" / name).read_text()) if d]


def pinned(package: str) -> str:
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        if line.startswith(f"{package}=="):
            return line.split("==", 1)[1].strip()
    raise AssertionError(f"{package} is not pinned")


def rendered_pod(component: str, v: dict[str, Any]) -> dict[str, Any]:
    """The pod the chart makes for ``component`` ("worker": a KubernetesExecutor task pod), as far as the values
    decide it: the chart's global volumes, mounts, environment and security contexts go into every Airflow
    container; the task pod takes images.pod_template and workers.kubernetes' service account."""
    image = v["images"]["pod_template" if component == "worker" else "airflow"]
    section = v["workers"]["kubernetes"] if component == "worker" else v.get(component, {})
    account = section.get("serviceAccount", {}).get("name") or f"airflow-{component.lower()}"
    secrets = [
        {"name": s["envName"], "valueFrom": {"secretKeyRef": {"name": s["secretName"], "key": s["secretKey"]}}}
        for s in v["secret"]
    ]
    container = {
        "name": "base" if component == "worker" else component.lower(),
        "image": f"{image['repository']}:{image['tag']}",
        "imagePullPolicy": image["pullPolicy"],
        "env": [*v["env"], *secrets],
        "securityContext": v["securityContexts"]["containers"],
        "volumeMounts": v["volumeMounts"],
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"airflow-{component.lower()}", "namespace": AIRFLOW_NAMESPACE},
        "spec": {
            "serviceAccountName": account,
            "securityContext": v["securityContexts"]["pod"],
            "volumes": v["volumes"],
            "containers": [container],
        },
    }


@pytest.mark.parametrize("component", ["worker", *COMPONENTS])
def test_every_pod_the_values_make_is_valid_and_meets_the_restricted_standard(component: str) -> None:
    pod = rendered_pod(component, values())
    assert kubernetes_validate.validate(pod, K8S_VERSION, strict=True) == K8S_VERSION
    spec, [container] = pod["spec"], pod["spec"]["containers"]
    security = spec["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] != 0
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    namespaces = {n["metadata"]["name"]: n for n in manifests("namespace.yaml")}
    namespace = namespaces[pod["metadata"]["namespace"]]
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_the_hot_tier_is_the_shared_claim_at_trainyard_home_wherever_it_is_needed() -> None:
    v = values()
    claims = {
        d["metadata"]["namespace"]: d for d in manifests("hot-tier-pvc.yaml") if d["kind"] == "PersistentVolumeClaim"
    }
    claim = claims[AIRFLOW_NAMESPACE]  # Airflow's side of the tier, in its own namespace
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # the pods and Airflow write it at once
    home = {e["name"]: e["value"] for e in v["env"]}["TRAINYARD_HOME"]
    for component in HOT_TIER:
        pod = rendered_pod(component, v)
        volumes = {vol["name"]: vol for vol in pod["spec"]["volumes"]}
        [mount] = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["mountPath"] == home]
        assert volumes[mount["name"]]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        assert not mount.get("readOnly") and not mount.get("subPath")  # the whole tier, writable
    # One place: no component mounts it a second time (a duplicate volume name makes a pod invalid).
    for component in COMPONENTS:
        assert not v.get(component, {}).get("extraVolumes") and not v.get(component, {}).get("extraVolumeMounts")
    assert not v["workers"]["kubernetes"].get("extraVolumes")


def test_airflow_is_the_pinned_airflow_as_the_image_user_that_shares_the_pods_group() -> None:
    v = values()
    assert v["airflowVersion"] == pinned("apache-airflow")
    assert v["executor"] in ("KubernetesExecutor", "CeleryExecutor")
    assert v["images"]["airflow"] == v["images"]["pod_template"]  # task pods run the same image
    assert (v["uid"], v["gid"]) == (AIRFLOW_UID, AIRFLOW_GID)
    pod = v["securityContexts"]["pod"]
    assert (pod["runAsUser"], pod["runAsGroup"], pod["fsGroup"]) == (AIRFLOW_UID, AIRFLOW_GID, AIRFLOW_GID)


def test_the_task_pods_and_the_triggerer_act_as_the_launcher_account_and_nothing_else_does() -> None:
    v = values()
    accounts = {d["metadata"]["name"] for d in manifests("launcher-rbac.yaml") if d["kind"] == "ServiceAccount"}
    assert LAUNCHER_ACCOUNT in accounts
    for component in ["worker", "triggerer"]:
        assert rendered_pod(component, v)["spec"]["serviceAccountName"] == LAUNCHER_ACCOUNT
    for component in ["scheduler", "apiServer", "dagProcessor"]:
        assert rendered_pod(component, v)["spec"]["serviceAccountName"] != LAUNCHER_ACCOUNT
    connection = {e["name"]: e["value"] for e in v["env"]}["AIRFLOW_CONN_K8S_TRAINING"]
    assert yaml.safe_load(connection)["extra"]["in_cluster"] is True


def test_credentials_come_only_from_secrets_and_metrics_go_to_a_collector() -> None:
    v = values()
    env = {e["name"]: e["value"] for e in v["env"]}
    for name, value in env.items():
        assert not any(word in name for word in ("PASSWORD", "SECRET", "TOKEN", "KEY")), name
        assert "password" not in value.lower() and "@" not in value, name
    assert v["postgresql"] == {"enabled": False} and v["data"]["metadataSecretName"]
    assert v["fernetKeySecretName"] and v["apiSecretKeySecretName"] and v["jwtSecretName"]
    assert [s["envName"] for s in v["secret"]] == ["AIRFLOW_CONN_TRAINYARD_COLD"]
    assert otlp_endpoint(env) == "http://otel-collector.monitoring:4318/v1/metrics"
    assert v["config"]["metrics"]["otel_on"] == "True"


def test_the_docs_say_how_to_install_with_these_values() -> None:
    text = (ROOT / "docs" / "kubernetes.md").read_text()
    assert "helm upgrade --install airflow apache-airflow/airflow -n airflow -f docker/helm/values.yaml" in text
    for secret in ("airflow-metadata", "airflow-fernet-key", "airflow-api-secret-key", "airflow-jwt-secret",
                   "trainyard-cold-connection"):  # fmt: skip
        assert secret in text, secret


def test_airflow_and_the_training_pods_run_in_separate_namespaces_over_one_hot_tier() -> None:
    """Issue 49, hole 9: Airflow's Secrets and its scheduler's pod grants are not where training code runs."""
    v = values()
    for component in ["worker", *COMPONENTS]:
        assert rendered_pod(component, v)["metadata"]["namespace"] != TRAINING_NAMESPACE
    connection = {e["name"]: e["value"] for e in v["env"]}["AIRFLOW_CONN_K8S_TRAINING"]
    assert yaml.safe_load(connection)["extra"]["namespace"] == TRAINING_NAMESPACE
    header = VALUES.read_text()
    assert "-n airflow -f docker/helm/values.yaml" in header and "-n trainyard -f" not in header
    docs = manifests("hot-tier-pvc.yaml")
    claims = {d["metadata"]["namespace"]: d for d in docs if d["kind"] == "PersistentVolumeClaim"}
    volumes = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PersistentVolume"}
    assert sorted(claims) == [AIRFLOW_NAMESPACE, TRAINING_NAMESPACE]
    sources = set()
    for namespace, claim in claims.items():
        volume = volumes[claim["spec"]["volumeName"]]
        assert volume["spec"]["claimRef"] == {"namespace": namespace, "name": claim["metadata"]["name"]}
        assert volume["spec"]["persistentVolumeReclaimPolicy"] == "Retain"  # never deleted with a claim
        sources.add(yaml.safe_dump(volume["spec"]["nfs"]))
    assert len(sources) == 1, "the two claims must be the same file system"
