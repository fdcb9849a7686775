"""``notify`` end to end: real ``airflow dags test`` runs email a real SMTP server (aiosmtpd on 127.0.0.1).

The mail server, login and password reach Airflow only as the connection
``smtp_default`` in the environment (``AIRFLOW_CONN_SMTP_DEFAULT``), as in a
deployment. One run fails (its data partition is missing), one succeeds after
recovery acted (a drill kills a node mid-training); each must arrive once, to
the spec's recipients, naming the stage, the failure class and the run's page.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from airflow_helpers import ROOT, STAGES, airflow, airflow_env, query, task_states

from trainyard.report.pages import run_url
from trainyard.shards import write_synthetic_corpus

pytestmark = pytest.mark.integration
DATE = "2026-11-28"
BASE_URL = "http://airflow.example.com:8080"
RECIPIENTS = ["ml-oncall@example.com", "lead@example.com"]
NOTIFY = "notify: {email: [ml-oncall@example.com, lead@example.com], on: [failure, recovery]}"
COMMON = """\
runs_root: file://${{TRAINYARD_HOME}}/runs
nodes: {{count: 2, min: 1}}
pressure_test: {{enabled: false}}
training:
  args: {{seq-len: 32, d-model: 32, n-layers: 1, n-heads: 2, lr: 0.01}}
  max_steps: 8
  global_batch: 4
  micro_batch: 2
  checkpoint_every: 2
  checkpoint_async: false
  heartbeat_timeout_s: 10
recovery: {{max_attempts: 3, backoff_s: 0.2}}
params: []
"""
# The partition of {{ ds }} was never written: stage_dataset fails fast with DataError.
MISSING_DATA = "dataset: {source: 'file://${TRAINYARD_HOME}/cold/tokens/{{ ds }}', name: 'tokens/{{ ds }}'}\n"
RECOVERS = ("dataset: {source: 'file://${TRAINYARD_HOME}/cold/static', name: static}\n"
            "drills: [{fault: kill, node: node-1, step: 5}]\n")


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("notify")
    dags = home / "dags"
    (dags / "pipelines").mkdir(parents=True)
    shutil.copy(ROOT / "dags" / "pipelines.py", dags)
    (dags / "pipelines" / "notify_fails.yaml").write_text(MISSING_DATA + COMMON.format() + NOTIFY + "\n")
    (dags / "pipelines" / "notify_recovers.yaml").write_text(RECOVERS + COMMON.format() + NOTIFY + "\n")
    env = airflow_env(home, dags, AIRFLOW__API__BASE_URL=BASE_URL)
    write_synthetic_corpus(Path(env["TRAINYARD_HOME"]) / "cold" / "static", shards=2, tokens_per_shard=8192)
    return env


def dags_test(env: dict[str, str], smtp_server, dag_id: str) -> tuple[str, str]:
    """Run the DAG once with the SMTP connection in the environment; its run id and the command's output."""
    conn = smtp_server.connection(from_email="trainyard@example.com")
    done = airflow({**env, "AIRFLOW_CONN_SMTP_DEFAULT": conn}, "dags", "test", dag_id, DATE)
    out = done.stdout + done.stderr
    [(run_id,)] = query(env, "SELECT run_id FROM dag_run WHERE dag_id = ?", dag_id)
    assert smtp_server.password not in out  # the connection's password is never logged
    assert "NOT sent" not in out and "Callback failed" not in out, out[-4000:]
    return run_id, out


def the_one_mail(smtp_server, out: str) -> tuple[dict, str]:
    assert len(smtp_server.mails) == 1, out[-4000:]
    [mail] = smtp_server.mails
    assert mail["to"] == RECIPIENTS and mail["message"]["To"] == ", ".join(RECIPIENTS)
    assert mail["from"] == "trainyard@example.com"  # the connection's from_email extra
    assert smtp_server.logins == ["trainyard"]  # logged in with the connection's credentials
    return mail, smtp_server.text(mail)


def test_a_failed_run_emails_the_stage_the_failure_class_and_the_run_page(env, smtp_server) -> None:
    run_id, out = dags_test(env, smtp_server, "notify_fails")
    states = {t: s for t, (s, _) in task_states(env, "notify_fails", DATE).items()}
    assert states["stage_dataset"] == "failed" and states["train"] == "upstream_failed", out[-4000:]
    mail, body = the_one_mail(smtp_server, out)
    assert mail["message"]["Subject"] == "[trainyard] notify_fails failed at stage_dataset: DataError"
    assert "Failed stage: stage_dataset" in body and "Failure class: DataError" in body
    assert "holds no objects to stage" in body
    assert f"Run page: {run_url(BASE_URL, 'notify_fails', run_id)}" in body


def test_a_run_that_recovered_emails_what_failed_what_was_done_and_the_steps_lost(env, smtp_server) -> None:
    run_id, out = dags_test(env, smtp_server, "notify_recovers")
    states = {t: s for t, (s, _) in task_states(env, "notify_recovers", DATE).items()}
    assert states == dict.fromkeys(STAGES, "success"), out[-4000:]
    mail, body = the_one_mail(smtp_server, out)
    assert mail["message"]["Subject"].startswith(
        "[trainyard] notify_recovers succeeded after recovery: node_lost -> scale_down, ")
    assert "succeeded, but recovery acted in train" in body
    assert "attempt 1: node_lost on node-1 -> scale_down" in body and "Steps lost in all: " in body
    assert f"Run page: {run_url(BASE_URL, 'notify_recovers', run_id)}" in body
