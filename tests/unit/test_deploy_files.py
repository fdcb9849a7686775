"""The deployment files in ``docker/``: images, the compose stack, the Kubernetes manifests.

No Docker daemon or cluster here, so the files are checked as data. The
compose file is validated against the Compose Specification's JSON schema
(from compose-spec/compose-spec, Apache-2.0, as shipped by the pinned
``check-jsonschema`` package), then for what the schema cannot know: one image
and one environment for every Airflow component, start-up order, credentials
that only ever come from ``docker/.env``. Every Kubernetes manifest is
validated with ``kubernetes_validate`` (1.37, strict) and cross-checked
against the names the others and the launcher use.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import re
import stat
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes.client import ApiClient

from trainyard.backends.base import LaunchPlan
from trainyard.backends.kubernetes.paths import prepare_paths
from trainyard.backends.kubernetes.pods import (
    AIRFLOW_GID,
    AIRFLOW_UID,
    LAUNCHER_ACCOUNT,
    RUN_AS_USER,
    container_security_context,
    pod_security_context,
)
from trainyard.protocol.env import TrainEnv
from trainyard.protocol.live_metrics import INSTRUMENTS, otlp_endpoint, prometheus_name
from trainyard.spec.admin import TRAINER_SERVICE_ACCOUNT

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "docker-compose.yaml"
K8S_VERSION = "1.37"
AIRFLOW_SERVICES = ["airflow-init", "api-server", "scheduler", "dag-processor", "triggerer"]
LONG_RUNNING = ["postgres", "minio", "api-server", "scheduler", "dag-processor", "triggerer", "prometheus", "grafana"]
OBSERVABILITY = ["otel-collector", "prometheus", "grafana"]
# Names of values that hold a credential (an access key id is a name, a passwords file a path).
SECRET_NAME = re.compile(
    r"PASSWORD(?!S_FILE)|SECRET|TOKEN|FERNET|(?<!ACCESS)_KEY$|^MC_HOST_|^AIRFLOW_CONN_|SQL_ALCHEMY_CONN"
)
# ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, ${VAR?error}; $$ is a literal $.
REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")
REQUIRED = re.compile(r"^\$\{[A-Z_][A-Z0-9_]*:\?[^}]*\}$")


# ---------------------------------------------------------------- helpers


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def env_example() -> dict[str, str]:
    out = {}
    for line in (DOCKER / ".env.example").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable substitution, as far as this file uses it."""

    def one(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        value = env.get(name)
        unset = value is None or (value == "" and op is not None and op.startswith(":"))
        if op in (":?", "?") and unset:
            raise KeyError(f"{name}: {arg}")
        if op in (":-", "-") and unset:
            return arg
        return value or ""

    parts = text.split("$$")
    return "$".join(REFERENCE.sub(one, part) for part in parts)


def references(node: Any) -> list[re.Match[str]]:
    """The ${...} compose substitutes in a parsed file's values (not $${...}: that is the container's shell)."""
    if isinstance(node, dict):
        return [m for v in node.values() for m in references(v)]
    if isinstance(node, list):
        return [m for v in node for m in references(v)]
    return list(REFERENCE.finditer(node.replace("$$", ""))) if isinstance(node, str) else []


def filled_env() -> dict[str, str]:
    """docker/.env.example with every empty value filled, as a user's docker/.env would be."""
    return {k: v or f"{k.lower().replace('_', '')}0123456789" for k, v in env_example().items()}


def dockerfile(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    lines, current = [], ""
    for raw in (DOCKER / name).read_text().splitlines():
        if raw.lstrip().startswith("#") or not raw.strip():
            continue
        current += raw.rstrip().removesuffix("\\") + " "
        if not raw.rstrip().endswith("\\"):
            lines.append(current.strip())
            current = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def pinned(package: str) -> str:
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        if line.startswith(f"{package}=="):
            return line.split("==", 1)[1].strip()
    raise AssertionError(f"{package} is not pinned in requirements.txt")


def args_of(instructions: list[tuple[str, str]]) -> dict[str, str]:
    return dict(arg.split("=", 1) for kind, arg in instructions if kind == "ARG" and "=" in arg)


def k8s_docs() -> list[tuple[str, dict[str, Any]]]:
    return [
        (path.name, doc)
        for path in sorted((DOCKER / "k8s").glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


# ---------------------------------------------------------------- compose: schema


def test_compose_file_is_valid_under_the_compose_specification() -> None:
    schema_file = importlib.resources.files("check_jsonschema") / "builtin_schemas/vendor/compose-spec.json"
    schema = json.loads(schema_file.read_text())
    assert schema["$id"] == "compose_spec.json"
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    errors = [f"{e.json_path}: {e.message}" for e in validator.iter_errors(compose())]
    assert errors == []
    # The schema does reject what compose would: an unknown condition, a misspelt key.
    broken = compose()
    broken["services"]["scheduler"]["depends_on"]["api-server"]["condition"] = "service_ready"
    broken["services"]["minio"]["healtcheck"] = broken["services"]["minio"].pop("healthcheck")
    found = " ".join(e.message for e in validator.iter_errors(broken))
    assert "'healtcheck' was unexpected" in found and "service_ready" in found


# ---------------------------------------------------------------- compose: services


def test_stack_has_the_databases_and_every_airflow_3_component() -> None:
    services = compose()["services"]
    assert set(services) == {"postgres", "minio", "minio-init", "cold-data", *AIRFLOW_SERVICES, *OBSERVABILITY}
    assert services["postgres"]["image"].startswith("postgres:")
    assert services["minio"]["image"].startswith("minio/minio:RELEASE.")
    assert services["minio"]["command"][:2] == ["server", "/data"]
    assert services["minio-init"]["image"].startswith("minio/mc:RELEASE.")
    commands = {name: services[name]["command"] for name in AIRFLOW_SERVICES[1:]}
    assert commands == {
        "api-server": "api-server",
        "scheduler": "scheduler",
        "dag-processor": "dag-processor",
        "triggerer": "triggerer",
    }


def test_airflow_services_share_one_image_and_one_environment_anchor() -> None:
    node = yaml.compose(COMPOSE.read_text())
    top = {k.value: v for k, v in node.value}
    common = top["x-airflow-common"]
    services = {k.value: v for k, v in top["services"].value}
    for name in AIRFLOW_SERVICES:
        merged = [v for k, v in services[name].value if k.value == "<<"]
        assert merged == [common], f"{name} does not merge *airflow-common"
        assert not any(k.value == "environment" for k, _ in services[name].value), f"{name} overrides the environment"
    data = compose()
    images = {data["services"][n]["image"] for n in AIRFLOW_SERVICES}
    envs = [data["services"][n]["environment"] for n in AIRFLOW_SERVICES]
    assert images == {data["x-airflow-common"]["image"]} and all(e == envs[0] for e in envs)
    build = data["x-airflow-common"]["build"]
    assert (COMPOSE.parent / build["context"]).resolve() == ROOT, "the context is the repository root"
    assert (ROOT / build["dockerfile"]) == DOCKER / "Dockerfile.airflow"


def test_airflow_runs_local_executor_against_the_api_server() -> None:
    data = compose()
    env = data["x-airflow-common"]["environment"]
    assert env["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor"
    url = urlsplit(env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"])
    api = data["services"]["api-server"]
    published = [p.rsplit(":", 1)[1] for p in api["ports"]]
    assert (url.scheme, url.hostname, str(url.port), url.path) == ("http", "api-server", published[0], "/execution/")
    assert api["healthcheck"]["test"][-1] == f"http://localhost:{url.port}/api/v2/monitor/health"
    assert REQUIRED.match(env["AIRFLOW__API_AUTH__JWT_SECRET"]), "the JWT secret must come from docker/.env"
    assert REQUIRED.match(env["AIRFLOW__API__SECRET_KEY"])
    assert env["AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK"] == "True"  # what the scheduler's healthcheck calls


def test_hot_tier_volume_is_trainyard_home_in_every_airflow_service() -> None:
    data = compose()
    home = data["x-airflow-common"]["environment"]["TRAINYARD_HOME"]
    for name in AIRFLOW_SERVICES:
        assert f"trainyard-home:{home}" in data["services"][name]["volumes"], name
    mounts = [
        v.split(":", 1)[0] for s in [data["x-airflow-common"], *data["services"].values()] for v in s.get("volumes", [])
    ]
    used = {m for m in mounts if not m.startswith((".", "/"))}  # named volumes; the rest are bind mounts
    assert used == set(data["volumes"]), "every named volume is declared, every declared one is used"
    assert f"ENV TRAINYARD_HOME={home}" in " ".join(f"{k} {a}" for k, a in dockerfile("Dockerfile.airflow"))


def test_start_up_order_waits_for_health_and_one_shot_jobs() -> None:
    services = compose()["services"]
    for name, service in services.items():
        for target, how in service.get("depends_on", {}).items():
            if how["condition"] == "service_healthy":
                assert "healthcheck" in services[target], f"{name} waits for {target}, which has no healthcheck"
            else:
                assert how["condition"] == "service_completed_successfully", f"{name} -> {target}"
                assert services[target]["restart"] == "no", f"{target} must be a one-shot job"
    for name in LONG_RUNNING:
        assert services[name]["healthcheck"]["test"], name
    needs = {name: {t: h["condition"] for t, h in s.get("depends_on", {}).items()} for name, s in services.items()}
    assert needs["minio-init"] == {"minio": "service_healthy"}
    assert needs["cold-data"] == {"minio-init": "service_completed_successfully"}  # the bucket and its key first
    assert needs["airflow-init"] == {"postgres": "service_healthy"}
    for name in AIRFLOW_SERVICES[1:]:
        assert needs[name]["postgres"] == "service_healthy"
        assert needs[name]["airflow-init"] == "service_completed_successfully"
    # The scheduler runs the tasks: they need the execution API and the cold bucket.
    assert needs["scheduler"]["api-server"] == "service_healthy"
    assert needs["scheduler"]["minio-init"] == "service_completed_successfully"
    assert needs["triggerer"]["api-server"] == "service_healthy"


def test_init_migrates_and_loads_the_settings_file_the_image_holds() -> None:
    command = compose()["services"]["airflow-init"]["command"]
    assert command[:2] == ["bash", "-c"]
    steps = [s.strip() for s in command[2].split("&&")]
    assert steps[0] == "airflow db migrate"
    module, path = steps[1].removeprefix("python -m ").split()
    assert module == "trainyard.airflow.settings"
    copies = [a.split() for k, a in dockerfile("Dockerfile.airflow") if k == "COPY"]
    assert any("airflow_settings.yaml" in c and c[-1].rstrip("/") == str(Path(path).parent) for c in copies)


def test_minio_init_creates_the_cold_bucket_and_the_key_airflow_uses() -> None:
    data = compose()
    init = data["services"]["minio-init"]
    script = init["command"][0]
    assert 'mc mb --ignore-existing "cold/$${BUCKET}"' in script
    assert init["environment"]["BUCKET"] == "${TRAINYARD_COLD_BUCKET:-trainyard-cold}"
    assert urlsplit(interpolate(init["environment"]["MC_HOST_cold"], filled_env())).hostname == "minio"
    conn = json.loads(interpolate(data["x-airflow-common"]["environment"]["AIRFLOW_CONN_TRAINYARD_COLD"], filled_env()))
    assert conn["conn_type"] == "aws" and conn["extra"]["endpoint_url"] == "http://minio:9000"
    assert "9000:9000" in " ".join(data["services"]["minio"]["ports"])
    # Airflow's login is the key minio-init creates and limits to the bucket.
    raw = json.loads(re.sub(r":\?[^}]*\}", "}", data["x-airflow-common"]["environment"]["AIRFLOW_CONN_TRAINYARD_COLD"]))
    assert (raw["login"], raw["password"]) == ("${TRAINYARD_S3_ACCESS_KEY}", "${TRAINYARD_S3_SECRET_KEY}")
    assert init["environment"]["ACCESS_KEY"].startswith("${TRAINYARD_S3_ACCESS_KEY:?")
    assert init["environment"]["SECRET_KEY"].startswith("${TRAINYARD_S3_SECRET_KEY:?")
    assert "mc admin policy attach cold trainyard-cold" in script


def test_cold_data_loads_the_partition_the_mounted_s3_pipeline_stages() -> None:
    import shlex

    from trainyard.cli import parser
    from trainyard.spec import load_spec

    data = compose()
    job = data["services"]["cold-data"]
    assert job["image"] == data["x-airflow-common"]["image"] and job["build"] == data["x-airflow-common"]["build"]
    assert job["restart"] == "no" and job["entrypoint"] == ["/bin/bash", "-ec"]
    uid = str(job["user"]).split(":")[0]
    assert uid.isdigit() and int(uid) != 0 and int(uid) == AIRFLOW_UID, "the job runs as the image's non-root user"
    env = job["environment"]
    # Credentials through the standard chain's variables, from docker/.env only; the endpoint is the stack's MinIO.
    assert REQUIRED.match(env["AWS_ACCESS_KEY_ID"]) and env["AWS_ACCESS_KEY_ID"].startswith(
        "${TRAINYARD_S3_ACCESS_KEY:?"
    )
    assert REQUIRED.match(env["AWS_SECRET_ACCESS_KEY"]) and "TRAINYARD_S3_SECRET_KEY" in env["AWS_SECRET_ACCESS_KEY"]
    endpoint = urlsplit(env["AWS_ENDPOINT_URL_S3"])
    assert (endpoint.scheme, endpoint.hostname, endpoint.port) == ("http", "minio", 9000)
    assert env["BUCKET"] == data["services"]["minio-init"]["environment"]["BUCKET"]
    # Each trainyard line is one the CLI accepts (variables filled as the container's shell would).
    shell = {k: interpolate(str(v), filled_env()) for k, v in env.items()}
    lines = [line.strip() for line in job["command"][0].splitlines() if line.strip()]
    runs = []
    for line in lines:
        argv = shlex.split(re.sub(r"\$\{(\w+)\}", lambda m: shell[m.group(1)], line.replace("$$", "$")))
        assert argv[0] == "trainyard", line
        assert "SECRET" not in line and filled_env()["TRAINYARD_S3_SECRET_KEY"] not in " ".join(argv)
        runs.append(parser().parse_args(argv[1:]))
    demo, upload, listed = runs
    assert (demo.command, upload.command, listed.command) == ("demo-data", "upload", "ls")
    assert Path(upload.src) == Path(demo.cold) / "tokens" / demo.date
    # The pipeline mounted into every Airflow component stages exactly that partition.
    spec_file = ROOT / "examples" / "specs" / "s3_pretrain.yaml"
    volumes = data["x-airflow-common"]["volumes"]
    mount = f"../examples/specs/{spec_file.name}:/opt/airflow/dags/s3_example/pipelines/{spec_file.name}:ro"
    assert mount in volumes and "../dags/pipelines.py:/opt/airflow/dags/s3_example/pipelines.py:ro" in volumes
    assert (COMPOSE.parent / mount.split(":")[0]).resolve() == spec_file
    spec = load_spec(spec_file)
    assert (
        spec.dataset.source.replace("{{ ds }}", demo.date)
        == f"s3://{filled_env()['TRAINYARD_COLD_BUCKET']}/tokens/{demo.date}"
    )
    assert upload.dest == spec.dataset.source.replace("{{ ds }}", demo.date)
    assert spec.dataset.connection == spec.checkpoint.connection == "trainyard_cold"
    assert "AIRFLOW_CONN_TRAINYARD_COLD" in data["x-airflow-common"]["environment"]


# ---------------------------------------------------------------- compose: metrics


def mounted(service: dict[str, Any], target: str) -> Path:
    """The file or folder of this checkout that ``service`` mounts at ``target``."""
    [source] = [v.split(":")[0] for v in service["volumes"] if v.split(":")[1] == target]
    return (COMPOSE.parent / source).resolve()


def test_airflow_and_the_training_runs_push_metrics_to_the_collector_prometheus_scrapes() -> None:
    data = compose()
    services = data["services"]
    env = data["x-airflow-common"]["environment"]
    assert env["AIRFLOW__METRICS__OTEL_ON"] == "True"
    # What the train stage hands rank 0 (TRAINYARD_METRICS_OTLP), from the variables Airflow itself reads.
    endpoint = urlsplit(otlp_endpoint(env) or "")
    collector = yaml.safe_load(mounted(services["otel-collector"], "/etc/otelcol/config.yaml").read_text())
    receiver = collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    assert (endpoint.hostname, endpoint.port, endpoint.path) == (
        "otel-collector",
        int(receiver.rsplit(":")[1]),
        "/v1/metrics",
    )
    assert services["otel-collector"]["command"] == ["--config=/etc/otelcol/config.yaml"]
    exporter = collector["exporters"]["prometheus"]
    assert exporter["add_metric_suffixes"] is False  # the dashboard's names: trainyard_train_loss
    assert collector["service"]["pipelines"]["metrics"] == {
        "receivers": ["otlp"],
        "processors": ["batch"],
        "exporters": ["prometheus"],
    }
    scrape = yaml.safe_load(mounted(services["prometheus"], "/etc/prometheus/prometheus.yaml").read_text())
    [job] = scrape["scrape_configs"]
    assert job["static_configs"] == [{"targets": [f"otel-collector:{exporter['endpoint'].rsplit(':')[1]}"]}]
    assert services["grafana"]["depends_on"] == {"prometheus": {"condition": "service_healthy"}}


def test_the_grafana_dashboard_shows_every_live_training_metric_from_the_provisioned_prometheus() -> None:
    grafana = compose()["services"]["grafana"]
    provisioning = mounted(grafana, "/etc/grafana/provisioning")
    [source] = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert source["type"] == "prometheus" and urlsplit(source["url"]).hostname == "prometheus"
    [provider] = yaml.safe_load((provisioning / "dashboards" / "trainyard.yaml").read_text())["providers"]
    folder = mounted(grafana, provider["options"]["path"])
    dashboard = json.loads((folder / "trainyard.json").read_text())
    shown: list[str] = []
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == source["uid"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == source["uid"]
            shown += re.findall(r"\b(trainyard_[a-z_]+)\{", target["expr"])
            assert '{pipeline=~"$pipeline", run_id=~"$run_id"}' in target["expr"]
    assert sorted(shown) == sorted(prometheus_name(key) for key in INSTRUMENTS)  # each once, none unknown
    variables = {v["name"]: v["definition"] for v in dashboard["templating"]["list"]}
    assert set(variables) == {"pipeline", "run_id"}


# ---------------------------------------------------------------- compose: credentials


def test_no_credential_is_written_in_the_compose_file() -> None:
    data = compose()
    for name, service in {"x-airflow-common": data["x-airflow-common"], **data["services"]}.items():
        for key, value in (service.get("environment") or {}).items():
            if not SECRET_NAME.search(key) or REQUIRED.match(value):
                continue
            # A URL or a JSON connection: where its credential goes, there is a reference.
            marked = REFERENCE.sub("@ref@", value)
            if value.startswith("{"):
                conn = json.loads(marked)
                assert (conn["login"], conn["password"]) == ("@ref@", "@ref@"), f"{name}.{key}"
            else:
                assert urlsplit(marked).password == "@ref@", f"{name}.{key}"
    # Every reference to a secret is required: none has a default to fall back on.
    for m in references(data):
        if SECRET_NAME.search(m.group(1)):
            assert m.group(2) == ":?", f"${{{m.group(1)}}} must be written ${{{m.group(1)}:?...}}"


def test_no_credential_of_the_stack_reaches_the_training_processes() -> None:
    # The scheduler runs the tasks (LocalExecutor), and they start torchrun agents and burn-in probes:
    # those get an allow-listed environment, which none of the stack's credentials is on.
    from trainyard.backends.local.environ import allowed

    env = compose()["x-airflow-common"]["environment"]
    secrets = [k for k in env if SECRET_NAME.search(k)]
    assert {
        "AIRFLOW__CORE__FERNET_KEY",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN",
        "AIRFLOW__API_AUTH__JWT_SECRET",
        "AIRFLOW_CONN_TRAINYARD_COLD",
    } <= set(secrets)
    assert [k for k in env if allowed(k)] == []  # not a secret either: nothing of Airflow's own crosses


def test_env_example_names_every_variable_and_holds_no_secret() -> None:
    example = env_example()
    referenced = {m.group(1) for m in references(compose())}
    assert referenced == set(example), "docker/.env.example and the compose file name different variables"
    secrets = {k for k in example if SECRET_NAME.search(k)}
    assert secrets >= {"POSTGRES_PASSWORD", "AIRFLOW_JWT_SECRET", "MINIO_ROOT_PASSWORD", "TRAINYARD_S3_SECRET_KEY"}
    assert {k: example[k] for k in secrets} == {k: "" for k in secrets}
    with pytest.raises(KeyError, match="POSTGRES_PASSWORD"):  # compose refuses to start without it
        interpolate(compose()["services"]["postgres"]["environment"]["POSTGRES_PASSWORD"], example)
    assert (DOCKER / ".gitignore").read_text().split("\n").count(".env") == 1


def test_filled_environment_gives_a_database_url_airflow_can_use() -> None:
    env = compose()["x-airflow-common"]["environment"]
    url = urlsplit(interpolate(env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"], filled_env()))
    example = env_example()
    assert (url.scheme, url.hostname, url.port) == ("postgresql+psycopg2", "postgres", 5432)
    assert (url.username, url.path) == (example["POSTGRES_USER"], f"/{example['POSTGRES_DB']}")
    assert url.password == filled_env()["POSTGRES_PASSWORD"]


# ---------------------------------------------------------------- images


def test_airflow_image_is_the_pinned_airflow_with_the_project() -> None:
    steps = dockerfile("Dockerfile.airflow")
    (base,) = [a for k, a in steps if k == "FROM"]
    assert re.fullmatch(rf"apache/airflow:{re.escape(pinned('apache-airflow'))}(-python3\.11)?", base)
    text = " ".join(a for _, a in steps)
    assert "-r /opt/trainyard/requirements.txt -c /opt/trainyard/constraints.txt" in text
    copied = {src.rstrip("/"): a.split()[-1] for k, a in steps if k == "COPY" for src in a.split()[1:-1]}
    # The DAGs are mounted from the checkout (edited specs need no rebuild); the view comes from the package.
    assert "dags" not in copied and "plugins" not in copied
    assert "../dags:/opt/airflow/dags/project:ro" in compose()["x-airflow-common"]["volumes"]
    assert copied["include"] == "/opt/trainyard/include" and copied["README.md"] == "/opt/trainyard/"
    assert "pip install --no-cache-dir --no-deps /opt/trainyard" in text


@pytest.mark.parametrize("name", ["Dockerfile.airflow", "Dockerfile.trainer"])
def test_images_run_as_a_numeric_non_root_user(name: str) -> None:
    users = [a for k, a in dockerfile(name) if k == "USER"]
    assert users, f"{name} has no USER"
    for user in users:
        uid, _, gid = user.partition(":")
        assert uid.isdigit() and int(uid) != 0 and (not gid or gid.isdigit()), f"{name}: USER {user}"


@pytest.mark.parametrize("name", ["Dockerfile.airflow", "Dockerfile.trainer"])
def test_images_pin_the_torch_of_requirements_from_a_chosen_index(name: str) -> None:
    args = args_of(dockerfile(name))
    assert args["TORCH_VERSION"] == pinned("torch")
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"  # --build-arg a CUDA index for GPUs


def test_trainer_user_is_the_one_the_pods_run_as() -> None:
    (user,) = [a for k, a in dockerfile("Dockerfile.trainer") if k == "USER"]
    assert user == f"{RUN_AS_USER}:{RUN_AS_USER}"
    assert f"--uid {RUN_AS_USER}" in " ".join(a for k, a in dockerfile("Dockerfile.trainer") if k == "RUN")


def groups_of(uid: int, gid: int, context: Any) -> set[int]:
    """The groups a pod's process is in: its own, the supplemental ones and fsGroup (the kubelet adds it)."""
    return {gid, *(context.supplemental_groups or []), *([context.fs_group] if context.fs_group is not None else [])}


def can_write(st: os.stat_result, uid: int, groups: set[int]) -> bool:
    """POSIX permission check of a folder for write and search (owner bits first, then group, then other)."""
    bits = stat.S_IMODE(st.st_mode)
    if st.st_uid == uid:
        return bits & 0o300 == 0o300
    if st.st_gid in groups:
        return bits & 0o030 == 0o030
    return bits & 0o003 == 0o003


def test_airflow_and_the_pods_share_a_group_that_writes_what_prepare_paths_makes(tmp_path: Path) -> None:
    """The orchestrator (the Airflow image's user) and the trainer pods both write the hot tier's folders."""
    # The Airflow image's user, from its Dockerfile: uid 50000, group 0 (every COPY gives it to 50000:0).
    (user,) = [a for k, a in dockerfile("Dockerfile.airflow") if k == "USER"]
    chowns = {a.split()[0] for k, a in dockerfile("Dockerfile.airflow") if k == "COPY" and a.startswith("--chown")}
    assert (int(user), chowns) == (AIRFLOW_UID, {f"--chown={AIRFLOW_UID}:{AIRFLOW_GID}"})
    context = pod_security_context()
    pods = groups_of(context.run_as_user, context.run_as_group, context)
    assert context.run_as_user != AIRFLOW_UID and AIRFLOW_GID in pods  # different users, one shared group
    # The folders the pods mount, made as the orchestrator makes them (a umask that would mask group write).
    run = tmp_path / "runs" / "p" / "r"
    plan = LaunchPlan(
        run_id="r", attempt=1, nodes=["n"], procs_per_node=1, entrypoint="trainyard.workload", args=[],
        train_env=TrainEnv(
            tmp_path / "hot" / "data", tmp_path / "checkpoints" / "p", 10,
            heartbeat_dir=run / "attempt-1" / "heartbeat", events_dir=run / "events.d",
        ),
        log_dir=run / "attempt-1",
    )  # fmt: skip
    old = os.umask(0o077)
    try:
        prepare_paths(plan)
    finally:
        os.umask(old)
    written = [(p.name, p.path) for p in plan.train_env.paths() if p.writable]
    assert len(written) == 3
    written.append(("host n's heartbeat folder", plan.heartbeat_dir / "n"))  # what the pod on n mounts
    for key, path in written:
        st = os.stat(path)
        # Here the orchestrator's own group stands for AIRFLOW_GID (a test cannot chown to group 0).
        mine = {st.st_gid: AIRFLOW_GID}
        shared = {mine.get(g, g) for g in pods}
        as_pod = os.stat_result((*st[:4], -1, AIRFLOW_GID if st.st_gid in mine else st.st_gid, *st[6:]))
        assert can_write(as_pod, context.run_as_user, shared), f"{key}: {stat.filemode(st.st_mode)}"
        assert can_write(st, os.geteuid(), set()), key  # the orchestrator, as owner
        # setgid: what a pod creates inside stays in the shared group, so the orchestrator can read it.
        assert st.st_mode & stat.S_ISGID, f"{key}: {stat.filemode(st.st_mode)}"


@pytest.mark.parametrize("name", ["Dockerfile.airflow", "Dockerfile.trainer"])
def test_build_context_lets_through_exactly_what_the_image_copies(name: str) -> None:
    rules = [r for r in (DOCKER / f"{name}.dockerignore").read_text().splitlines() if r and not r.startswith("#")]
    assert rules[0] == "*", "the context is the repository root: exclude all, then allow"
    allowed = {r[1:].rstrip("/") for r in rules if r.startswith("!")}
    sources = {
        src.rstrip("/")
        for k, a in dockerfile(name)
        if k == "COPY"
        for src in a.split()[:-1]
        if not src.startswith("--")
    }
    assert sources == allowed
    assert all((ROOT / s).exists() for s in sources)


# ---------------------------------------------------------------- kubernetes manifests


@pytest.mark.parametrize("name", sorted(p.name for p in (DOCKER / "k8s").glob("*.yaml")))
def test_every_kubernetes_manifest_is_valid(name: str) -> None:
    docs = [doc for file, doc in k8s_docs() if file == name]
    assert docs
    for doc in docs:
        assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True) == K8S_VERSION


def test_manifests_agree_on_namespace_and_names() -> None:
    docs = [doc for _, doc in k8s_docs()]
    namespaces = {d["metadata"]["name"] for d in docs if d["kind"] == "Namespace"}
    assert namespaces == {"trainyard", "airflow"}  # training and Airflow apart (issue 49)
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume"}
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] not in cluster_scoped} == namespaces
    # Every grant is in the training namespace; only the launcher's account and Airflow's claim are not.
    for d in docs:
        if d["kind"] in ("Role", "RoleBinding"):
            assert d["metadata"]["namespace"] == "trainyard"
    accounts = {(d["metadata"]["namespace"], d["metadata"]["name"]) for d in docs if d["kind"] == "ServiceAccount"}
    roles = {(d["kind"], d["metadata"]["name"]) for d in docs if d["kind"] in ("Role", "ClusterRole")}
    for d in docs:
        if d["kind"] in ("RoleBinding", "ClusterRoleBinding"):
            assert (d["roleRef"]["kind"], d["roleRef"]["name"]) in roles
            assert all((s["namespace"], s["name"]) in accounts for s in d["subjects"])


def test_no_long_lived_token_and_the_short_lived_way_is_documented() -> None:
    # A token Secret never expires; the TokenRequest API (kubectl create token, a projected volume) does.
    docs = [doc for _, doc in k8s_docs()]
    assert [d for d in docs if d["kind"] == "Secret"] == []
    rbac = (DOCKER / "k8s" / "launcher-rbac.yaml").read_text()
    assert "kubectl -n airflow create token trainyard-launcher --duration=" in rbac
    assert "serviceAccountToken: {path: token, expirationSeconds:" in rbac


def test_the_only_cluster_wide_grant_is_marking_nodes() -> None:
    docs = [doc for _, doc in k8s_docs()]
    (cluster_role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    assert cluster_role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "patch"]}]
    (binding,) = [d for d in docs if d["kind"] == "ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == cluster_role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": LAUNCHER_ACCOUNT, "namespace": "airflow"}]
    # Everything else is namespaced, and the launcher's account is the one no pod may be given: it lives
    # where no training pod runs. The trainer's account has no grant at all.
    accounts = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceAccount"}
    assert sorted(accounts) == [LAUNCHER_ACCOUNT, TRAINER_SERVICE_ACCOUNT]
    assert accounts[LAUNCHER_ACCOUNT]["metadata"]["namespace"] == "airflow"
    trainer = accounts[TRAINER_SERVICE_ACCOUNT]
    assert trainer["metadata"]["namespace"] == "trainyard" and trainer["automountServiceAccountToken"] is False
    bound = [s["name"] for d in docs if d["kind"].endswith("Binding") for s in d["subjects"]]
    assert TRAINER_SERVICE_ACCOUNT not in bound
    text = (DOCKER / "k8s" / "node-eviction-rbac.yaml").read_text()
    assert "resourceNames cannot list the nodes" in text and "RBAC cannot limit a patch" in text


def test_restricted_namespace_admits_the_pods_trainyard_builds() -> None:
    for namespace in [d for _, d in k8s_docs() if d["kind"] == "Namespace"]:
        assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    pod = ApiClient().sanitize_for_serialization(pod_security_context())
    container = ApiClient().sanitize_for_serialization(container_security_context())
    assert pod["runAsNonRoot"] is True and pod["seccompProfile"]["type"] == "RuntimeDefault"
    assert pod["runAsUser"] != 0
    assert container["allowPrivilegeEscalation"] is False and container["capabilities"]["drop"] == ["ALL"]
    assert container["readOnlyRootFilesystem"] is True


def test_the_launchers_secret_grant_says_why_resource_names_cannot_scope_it() -> None:
    """Issue 49, hole 9: "delete secrets" cannot be scoped by name (each attempt's Secret is named per run), so
    no Secret but the attempts' keys may live where it applies."""
    (role,) = [d for f, d in k8s_docs() if f == "launcher-rbac.yaml" and d["kind"] == "Role"]
    [secrets] = [r for r in role["rules"] if r["resources"] == ["secrets"]]
    assert secrets["verbs"] == ["create", "delete"] and "resourceNames" not in secrets
    text = (DOCKER / "k8s" / "launcher-rbac.yaml").read_text()
    assert 'RBAC cannot restrict "create" by name' in text and "nor list/watch" in text
    assert "Airflow's own Secrets live in the airflow namespace" in text
    assert role["metadata"]["namespace"] == "trainyard"
    values = (DOCKER / "helm" / "values.yaml").read_text()
    assert "kubectl -n airflow create secret" in values and "kubectl -n trainyard create secret" not in values
