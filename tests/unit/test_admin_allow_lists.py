"""What a spec may name is the admin's to allow (issue 49, holes 8 and 9).

Hole 8: ``${VAR}`` in a spec named any variable of the orchestrator's environment
(``${AIRFLOW__CORE__FERNET_KEY}`` in ``checkpoint.hot`` passed ``trainyard check``, and its value reached
the training processes and lineage events). Hole 9: a spec could run training pods as any account of
the namespace (the Airflow chart's ``airflow-scheduler``). Both are allow-lists now: harmless defaults,
and names the admin adds with ``[trainyard] spec_variables`` / ``pod_service_accounts``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from trainyard.errors import SpecError
from trainyard.spec import KubernetesSpec, load_spec
from trainyard.spec.templating import render

SPEC = """\
{notify}dataset: {{source: "file://{root}/cold/tokens", name: tokens}}
nodes: {nodes}
training: {{max_steps: 2, global_batch: 2, micro_batch: 1, checkpoint_every: 1}}
checkpoint: {{hot: "{hot}", cold: "file://{root}/cold/checkpoints"}}
runs_root: "file://{root}/runs"
"""
RUN = {"ds": "2026-01-01", "ds_nodash": "20260101", "dag_id": "d", "run_id": "r"}


@pytest.fixture(autouse=True)
def no_admin_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIRFLOW__TRAINYARD__SPEC_VARIABLES", raising=False)
    monkeypatch.delenv("AIRFLOW__TRAINYARD__POD_SERVICE_ACCOUNTS", raising=False)
    monkeypatch.delenv("AIRFLOW__TRAINYARD__NOTIFY_CONNECTIONS", raising=False)


def spec_file(tmp_path: Path, hot: str = "", nodes: str = "{count: 1}", notify: str = "") -> Path:
    path = tmp_path / "p.yaml"
    notify = f"notify: {notify}\n" if notify else ""
    path.write_text(SPEC.format(root=tmp_path, hot=hot or f"file://{tmp_path}/hot", nodes=nodes, notify=notify))
    return path


def refused(path: Path) -> str:
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    return "\n".join(caught.value.problems)


def test_a_secret_variable_in_a_spec_is_refused_naming_the_file_the_field_and_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIRFLOW__CORE__FERNET_KEY", "the-deployments-fernet-key")
    path = spec_file(tmp_path, hot="file:///tmp/${AIRFLOW__CORE__FERNET_KEY}/hot")
    message = refused(path)
    assert f"{path}: checkpoint.hot: ${{AIRFLOW__CORE__FERNET_KEY}} is not an allowed variable" in message
    assert "[trainyard] spec_variables" in message and "AIRFLOW__TRAINYARD__SPEC_VARIABLES" in message
    assert "the-deployments-fernet-key" not in message


def test_render_refuses_a_variable_outside_the_allow_list_even_when_it_is_set() -> None:
    """A pinned run or a spec built in Python reaches ``render`` without ``trainyard check``."""
    environ = {"AIRFLOW__CORE__FERNET_KEY": "the-deployments-fernet-key"}
    with pytest.raises(KeyError, match=r"\$\{AIRFLOW__CORE__FERNET_KEY\} is not an allowed variable"):
        render("file:///x/${AIRFLOW__CORE__FERNET_KEY}", RUN, environ)


def test_the_defaults_and_the_admins_variables_are_accepted_and_rendered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path))
    load_spec(spec_file(tmp_path, hot="file://${TRAINYARD_HOME}/hot"))
    monkeypatch.setenv("CKPT_ROOT", str(tmp_path / "ckpt"))
    assert "not an allowed variable" in refused(spec_file(tmp_path, hot="file://${CKPT_ROOT}/hot"))
    monkeypatch.setenv("AIRFLOW__TRAINYARD__SPEC_VARIABLES", "DATA_ROOT, CKPT_ROOT")
    load_spec(spec_file(tmp_path, hot="file://${CKPT_ROOT}/hot"))
    assert render("file://${CKPT_ROOT}/hot", RUN) == f"file://{tmp_path}/ckpt/hot"


def test_every_shipped_spec_uses_only_the_default_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    root = Path(__file__).resolve().parents[2]
    specs = [*root.glob("examples/**/*.yaml"), *root.glob("dags/pipelines/*.yaml")]
    assert specs
    for path in specs:
        text = path.read_text()
        if "dataset:" in text and "training:" in text:
            load_spec(path)  # raises naming the file and field


def k8s(account: str) -> str:
    return f"{{count: 1, backend: kubernetes, kubernetes: {{image: trainer, service_account: {account}}}}}"


def test_a_pod_service_account_outside_the_allow_list_is_refused_with_the_fix(tmp_path: Path) -> None:
    path = spec_file(tmp_path, nodes=k8s("airflow-scheduler"))
    message = refused(path)
    assert f"{path}: nodes.kubernetes.service_account: 'airflow-scheduler' is not an allowed pod service account" in (
        message
    )
    assert "trainyard-trainer" in message and "[trainyard] pod_service_accounts" in message


def test_the_trainer_account_and_the_admins_accounts_are_accepted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    load_spec(spec_file(tmp_path, nodes=k8s("trainyard-trainer")))
    load_spec(spec_file(tmp_path, nodes=k8s("null")))
    monkeypatch.setenv("AIRFLOW__TRAINYARD__POD_SERVICE_ACCOUNTS", "team-a-trainer,team-b-trainer")
    load_spec(spec_file(tmp_path, nodes=k8s("team-b-trainer")))
    # The launcher's own account stays refused whatever the admin lists.
    monkeypatch.setenv("AIRFLOW__TRAINYARD__POD_SERVICE_ACCOUNTS", "trainyard-launcher")
    assert "launcher's own service account" in refused(spec_file(tmp_path, nodes=k8s("trainyard-launcher")))


def test_the_launcher_refuses_an_unlisted_account_in_a_spec_built_past_validation() -> None:
    from trainyard.backends.kubernetes.pods import pod_account

    built = KubernetesSpec.model_construct(
        **{**KubernetesSpec(image="t", namespace="trainyard").__dict__, "service_account": "airflow-scheduler"}
    )
    with pytest.raises(ValueError, match="'airflow-scheduler' is not an allowed pod service account"):
        pod_account(built)


@pytest.mark.parametrize(
    ("notify", "field"),
    [
        ("{email: [a@example.com], connection: warehouse_db}", "notify.connection"),
        ("{slack: {connection: warehouse_db}}", "notify.slack.connection"),
        ("{webhook: {connection: warehouse_db}}", "notify.webhook.connection"),
    ],
)
def test_a_notify_connection_outside_the_allow_list_is_refused_with_the_fix(
    tmp_path: Path, notify: str, field: str
) -> None:
    # A notice carries the connection's credentials to its host: a spec naming the warehouse's connection would send
    # its password there, or (a webhook) post run details to it with its token.
    message = refused(spec_file(tmp_path, notify=notify))
    assert f"{field}: 'warehouse_db' is not a connection notices may use" in message, message
    assert "[trainyard] notify_connections" in message and "AIRFLOW__TRAINYARD__NOTIFY_CONNECTIONS" in message


def test_the_notifiers_default_connections_and_the_admins_are_accepted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    load_spec(spec_file(tmp_path, notify="{email: [a@example.com], slack: {}}"))  # smtp_default, slack_default
    monkeypatch.setenv("AIRFLOW__TRAINYARD__NOTIFY_CONNECTIONS", "oncall_hook")
    load_spec(spec_file(tmp_path, notify="{webhook: {connection: oncall_hook}}"))
