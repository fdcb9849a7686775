"""The notify adapter: DAG-level callbacks that send the run's notice with Airflow's SmtpNotifier.

Called here as Airflow calls them (a context with the DAG, run id, reason and
the task it blames), against a real SMTP server on 127.0.0.1 (aiosmtpd); the
connection comes from ``AIRFLOW_CONN_<ID>`` as in a deployment.
tests/integration/test_notify.py runs the same through ``airflow dags test``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from trainyard.airflow.dag_builder import build_dag
from trainyard.airflow.notify import RunNotifier, dag_callbacks
from trainyard.pipeline.run import RUN_STAGE, Run, open_run
from trainyard.spec import load_spec

DAG_ID = "nightly"
BASE_URL = "http://airflow.example.com:8080"
SPEC = """\
dataset: {{source: "file://{home}/cold", name: tokens, hot: "file://{home}/hot"}}
runs_root: "file://{home}/runs"
nodes: {{count: 1}}
training: {{max_steps: 4, global_batch: 2, micro_batch: 2, checkpoint_every: 2}}
{notify}
"""
NOTIFY = (
    "notify: {{email: [ml-oncall@example.com, lead@example.com], on: [failure, recovery], connection: {conn}{sender}}}"
)


def write_spec(tmp_path: Path, conn: str = "mail", sender: str = "trainyard@example.com", notify: bool = True) -> Path:
    path = tmp_path / f"{DAG_ID}.yaml"
    text = NOTIFY.format(conn=conn, sender=f", from_email: {sender}" if sender else "") if notify else ""
    path.write_text(SPEC.format(home=tmp_path, notify=text))
    return path


def failed_run(path: Path) -> Run:
    run = open_run(path, DAG_ID, f"manual__{time.monotonic_ns()}", "2026-11-28")
    run.ledger.append("stage_dataset", "stage_start")
    run.ledger.append(
        "stage_dataset",
        "stage_failed",
        error="DataError",
        seconds=0.1,
        message="file:///cold holds no objects to stage; check dataset.source and the partition date",
    )
    return run


def context(run: Run, task: str = "stage_dataset", reason: str = "task_failure") -> dict[str, Any]:
    return {
        "dag": SimpleNamespace(dag_id=run.dag_id),
        "run_id": run.run_id,
        "reason": reason,
        "ti": SimpleNamespace(task_id=task),
    }


@pytest.fixture(autouse=True)
def base_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", BASE_URL)


def test_a_failed_run_is_mailed_with_stage_class_and_link(smtp_server, tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_MAIL", smtp_server.connection())
    run = failed_run(write_spec(tmp_path))
    with caplog.at_level(logging.INFO):
        RunNotifier(str(run.spec_path), "failed")(context(run))
    [mail] = smtp_server.mails
    assert mail["to"] == ["ml-oncall@example.com", "lead@example.com"] and mail["from"] == "trainyard@example.com"
    assert smtp_server.logins == ["trainyard"]  # credentials from the Airflow connection
    assert mail["message"]["Subject"] == "[trainyard] nightly failed at stage_dataset: DataError"
    body = smtp_server.text(mail)
    assert "Failed stage: stage_dataset" in body and "Failure class: DataError" in body
    assert f"Run page: {BASE_URL}/trainyard/runs/{DAG_ID}/{run.run_id}" in body
    [sent] = run.ledger.events(RUN_STAGE, "notified")
    assert sent["kind"] == "failure" and sent["to"] == ["ml-oncall@example.com", "lead@example.com"]
    assert smtp_server.password not in caplog.text


@pytest.mark.parametrize("case", ["server down", "wrong password", "no sender anywhere"])
def test_a_notice_that_cannot_go_is_one_warning_naming_the_connection(
    case, smtp_server, tmp_path, monkeypatch, caplog
) -> None:
    conn = {
        "server down": smtp_server.connection(port=_closed_port()),
        "wrong password": smtp_server.connection().replace(smtp_server.password, "not-the-password"),
        "no sender anywhere": smtp_server.connection(),
    }[case]
    monkeypatch.setenv("AIRFLOW_CONN_MAIL_DOWN", conn)
    run = failed_run(
        write_spec(tmp_path, conn="mail_down", sender="" if case == "no sender anywhere" else "t@example.com")
    )
    with caplog.at_level(logging.INFO):
        RunNotifier(str(run.spec_path), "failed")(context(run))  # returns: a mail problem never raises
    assert smtp_server.mails == []
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "trainyard.airflow.notify"]
    assert "NOT sent by email through the Airflow connection 'mail_down'" in warning.getMessage()
    assert warning.exc_info is None and "Traceback" not in caplog.text
    assert "not-the-password" not in caplog.text and smtp_server.password not in caplog.text
    [failed] = run.ledger.events(RUN_STAGE, "notify_failed")
    assert failed["connection"] == "mail_down" and failed["kind"] == "failure"
    if case == "no sender anywhere":
        assert "from_email" in warning.getMessage()


def test_a_run_that_started_without_notify_sends_nothing(smtp_server, tmp_path, monkeypatch, caplog) -> None:
    """The spec a run started with decides, not the file as edited since."""
    monkeypatch.setenv("AIRFLOW_CONN_MAIL", smtp_server.connection())
    run = failed_run(write_spec(tmp_path, notify=False))
    write_spec(tmp_path)  # notify added while the run was going
    with caplog.at_level(logging.INFO):
        RunNotifier(str(run.spec_path), "failed")(context(run))
    assert smtp_server.mails == [] and "no notify section" in caplog.text


def test_a_clean_success_sends_nothing(smtp_server, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_MAIL", smtp_server.connection())
    run = open_run(write_spec(tmp_path), DAG_ID, "manual__clean", "2026-11-28")
    for stage in ("stage_dataset", "check_dataset", "burn_in", "train", "check_checkpoint", "publish", "report"):
        run.ledger.append(stage, "stage_end", seconds=1.0, result={})
    RunNotifier(str(run.spec_path), "succeeded")(context(run, task="report", reason="success"))
    assert smtp_server.mails == [] and list(run.ledger.events(RUN_STAGE, "notified")) == []


def test_callbacks_are_attached_only_as_the_spec_asks(tmp_path: Path) -> None:
    path = write_spec(tmp_path)
    dag = build_dag(path, load_spec(path))
    assert isinstance(dag.on_failure_callback, RunNotifier) and dag.on_failure_callback.outcome == "failed"
    assert isinstance(dag.on_success_callback, RunNotifier) and dag.on_success_callback.outcome == "succeeded"
    path.write_text(path.read_text().replace("on: [failure, recovery]", "on: [failure]"))
    assert set(dag_callbacks(str(path), load_spec(path))) == {"on_failure_callback"}
    assert dag_callbacks(str(path), load_spec(write_spec(tmp_path, notify=False))) == {}


def _closed_port() -> int:
    import socket

    with socket.socket() as s:  # bound, never listening: a connection is refused at once
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RANK_TEXT = "loss {{ 7*7 }} then {{ conn.smtp_default.password }} and {% endfor %} {# x #} \udcff"


@pytest.mark.parametrize("sender", ["spec", "connection"])
def test_rank_text_in_a_notice_is_sent_verbatim_never_rendered(sender, smtp_server, tmp_path, monkeypatch) -> None:
    """A rank's message reaches the failure mail as text: no template runs, no secret is read, and a
    stray block tag or an unencodable character still lets the mail go."""
    monkeypatch.setenv("AIRFLOW_CONN_MAIL", smtp_server.connection(from_email="conn@example.com"))
    monkeypatch.setenv("AIRFLOW_CONN_SMTP_DEFAULT", smtp_server.connection())
    path = write_spec(tmp_path, sender="trainyard@example.com" if sender == "spec" else "")
    run = open_run(path, DAG_ID, f"manual__{time.monotonic_ns()}", "2026-11-28")
    run.ledger.append("train", "stage_start")
    run.ledger.append("train", "stage_failed", error="TrainingFailed", seconds=0.1, message=RANK_TEXT)
    RunNotifier(str(run.spec_path), "failed")(context(run, task="train"))
    [mail] = smtp_server.mails
    body = smtp_server.text(mail)
    assert "loss {{ 7*7 }}" in body and "loss 49" not in body
    assert "{{ conn.smtp_default.password }}" in body and smtp_server.password not in body
    assert "{% endfor %}" in body and "{# x #}" in body
    assert mail["from"] == ("trainyard@example.com" if sender == "spec" else "conn@example.com")
    [sent] = run.ledger.events(RUN_STAGE, "notified")
    assert sent["kind"] == "failure"


class Receiver:
    """An HTTP endpoint on 127.0.0.1 that keeps every POST (path, headers, JSON body) and answers ``status``."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, dict[str, str], Any]] = []
        self.status = 200
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.posts.append((self.path, dict(self.headers), json.loads(body)))
                self.send_response(receiver.status)
                self.end_headers()
                self.wfile.write(b"ok")  # what Slack's webhooks answer

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def sent(self, path: str) -> list[Any]:
        return [body for p, _, body in self.posts if p == path]


@pytest.fixture
def receiver() -> Any:
    server = Receiver()
    yield server
    server.server.shutdown()


def channels_spec(tmp_path: Path, receiver: Receiver, monkeypatch: pytest.MonkeyPatch, email: bool = True) -> Path:
    slack = {"conn_type": "slackwebhook", "password": f"{receiver.url}/services/T000/B000/XXXX"}
    hook = {"conn_type": "http", "host": f"{receiver.url}/hook", "extra": {"headers": {"Authorization": "Bearer tk"}}}
    monkeypatch.setenv("AIRFLOW_CONN_TEAM_SLACK", json.dumps(slack))
    monkeypatch.setenv("AIRFLOW_CONN_TEAM_HOOK", json.dumps(hook))
    path = tmp_path / f"{DAG_ID}.yaml"
    emails = "email: [ml-oncall@example.com], connection: mail, from_email: t@example.com, " if email else ""
    notify = f"notify: {{{emails}slack: {{connection: team_slack}}, webhook: {{connection: team_hook}}}}"
    path.write_text(SPEC.format(home=tmp_path, notify=notify))
    return path


def test_slack_and_a_webhook_get_the_notice_the_mail_has(smtp_server, receiver, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_MAIL", smtp_server.connection())
    run = failed_run(channels_spec(tmp_path, receiver, monkeypatch))
    RunNotifier(str(run.spec_path), "failed")(context(run))
    [mail] = smtp_server.mails
    [slack] = receiver.sent("/services/T000/B000/XXXX")
    [hook] = receiver.sent("/hook")
    subject = "[trainyard] nightly failed at stage_dataset: DataError"
    assert mail["message"]["Subject"] == subject == hook["subject"]
    assert slack["text"].startswith(f"*{subject}*\n```\n") and slack["unfurl_links"] is False
    for line in smtp_server.text(mail).strip().splitlines():  # every line of the mail, in both
        assert line in slack["text"] and line in hook["text"], line
    link = f"{BASE_URL}/trainyard/runs/{DAG_ID}/{run.run_id}"
    assert hook["link"] == link and slack["text"].endswith(f"```\n{link}")
    assert hook["kind"] == "failure" and hook["dag_id"] == DAG_ID and hook["run_id"] == run.run_id
    [headers] = [h for p, h, _ in receiver.posts if p == "/hook"]
    assert headers["Authorization"] == "Bearer tk" and headers["Content-Type"] == "application/json"
    sent = {e["channel"]: e for e in run.ledger.events(RUN_STAGE, "notified")}
    assert sorted(sent) == ["email", "slack", "webhook"]
    assert sent["slack"]["connection"] == "team_slack" and sent["webhook"]["connection"] == "team_hook"


def test_rank_text_reaches_slack_and_the_webhook_as_text(receiver, tmp_path, monkeypatch) -> None:
    """Slack acts on ``<!channel>`` and ``<url|label>``; they arrive escaped. Nothing is rendered either way."""
    run = open_run(channels_spec(tmp_path, receiver, monkeypatch, email=False), DAG_ID, "manual__rank", "2026-11-28")
    run.ledger.append("train", "stage_start")
    text = RANK_TEXT + " <!channel> <https://evil.example|click> a```b"
    run.ledger.append("train", "stage_failed", error="TrainingFailed", seconds=0.1, message=text)
    RunNotifier(str(run.spec_path), "failed")(context(run, task="train"))
    [slack] = receiver.sent("/services/T000/B000/XXXX")
    [hook] = receiver.sent("/hook")
    assert "&lt;!channel&gt;" in slack["text"] and "<!channel>" not in slack["text"]
    assert "&lt;https://evil.example|click&gt;" in slack["text"] and "a```b" not in slack["text"]
    assert "loss {{ 7*7 }}" in slack["text"] and "{% endfor %}" in slack["text"] and "loss 49" not in slack["text"]
    assert (
        "<!channel> <https://evil.example|click>" in hook["text"] and "{{ conn.smtp_default.password }}" in hook["text"]
    )
    assert [e["channel"] for e in run.ledger.events(RUN_STAGE, "notified")] == ["slack", "webhook"]


def test_a_channel_that_fails_is_one_warning_and_the_others_still_send(
    smtp_server, receiver, tmp_path, monkeypatch, caplog
) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_MAIL", smtp_server.connection())
    path = channels_spec(tmp_path, receiver, monkeypatch)
    receiver.status = 500
    run = failed_run(path)
    with caplog.at_level(logging.INFO):
        RunNotifier(str(run.spec_path), "failed")(context(run))
    assert len(smtp_server.mails) == 1  # the mail went
    warnings = [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("trainyard")
    ]
    assert len(warnings) == 2 and "Traceback" not in caplog.text and "XXXX" not in caplog.text
    assert any("by slack through the Airflow connection 'team_slack'" in w for w in warnings)
    assert any("by webhook through the Airflow connection 'team_hook'" in w and "500" in w for w in warnings)
    failed = {e["channel"]: e for e in run.ledger.events(RUN_STAGE, "notify_failed")}
    assert sorted(failed) == ["slack", "webhook"]
    assert [e["channel"] for e in run.ledger.events(RUN_STAGE, "notified")] == ["email"]


@pytest.mark.parametrize(
    ("host", "why"), [("ftp://127.0.0.1/x", "only http and https"), ("127.0.0.1", "no http(s) URL")]
)
def test_a_webhook_connection_without_an_http_url_is_named(host, why, tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_TEAM_HOOK", json.dumps({"conn_type": "http", "host": host}))
    path = tmp_path / f"{DAG_ID}.yaml"
    path.write_text(SPEC.format(home=tmp_path, notify="notify: {webhook: {connection: team_hook}}"))
    run = failed_run(path)
    RunNotifier(str(run.spec_path), "failed")(context(run))
    [failed] = run.ledger.events(RUN_STAGE, "notify_failed")
    assert failed["channel"] == "webhook" and why in failed["error"]


# ---------------------------------------------------------------- issue 49, hole 11: what a channel trusts


def test_backticks_in_rank_text_cannot_close_the_slack_code_block(receiver, tmp_path, monkeypatch) -> None:
    run = open_run(channels_spec(tmp_path, receiver, monkeypatch, email=False), DAG_ID, "manual__ticks", "2026-11-28")
    run.ledger.append("train", "stage_start")
    text = "a````\n<!here> *all clear*\n`````b"
    run.ledger.append("train", "stage_failed", error="TrainingFailed", seconds=0.1, message=text)
    RunNotifier(str(run.spec_path), "failed")(context(run, task="train"))
    [slack] = receiver.sent("/services/T000/B000/XXXX")
    assert slack["text"].count("```") == 2, "rank text opened or closed a code block"


def test_a_notify_connection_of_another_type_is_not_used(receiver, tmp_path, monkeypatch) -> None:
    """A spec's author names the connection: a database's, with its password, must not go to a webhook."""
    conn = {"conn_type": "postgres", "host": f"{receiver.url}/hook", "password": "the-databases-password"}
    monkeypatch.setenv("AIRFLOW_CONN_WAREHOUSE", json.dumps(conn))
    path = tmp_path / f"{DAG_ID}.yaml"
    path.write_text(SPEC.format(home=tmp_path, notify="notify: {webhook: {connection: warehouse}}"))
    run = failed_run(path)
    RunNotifier(str(run.spec_path), "failed")(context(run))
    assert receiver.posts == []
    [failed] = run.ledger.events(RUN_STAGE, "notify_failed")
    assert "type 'postgres'" in failed["error"] and "type http" in failed["error"]


def test_a_webhook_redirect_is_not_followed_with_the_authorization_header(tmp_path, monkeypatch) -> None:
    seen: list[tuple[str, str, str | None]] = []

    class Redirecting(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            seen.append(("POST", self.path, self.headers.get("Authorization")))
            self.send_response(302)
            self.send_header("Location", "/elsewhere")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_GET(self) -> None:
            seen.append(("GET", self.path, self.headers.get("Authorization")))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Redirecting)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/hook"
        hook = {"conn_type": "http", "host": url, "extra": {"headers": {"Authorization": "Bearer tk"}}}
        monkeypatch.setenv("AIRFLOW_CONN_TEAM_HOOK", json.dumps(hook))
        path = tmp_path / f"{DAG_ID}.yaml"
        path.write_text(SPEC.format(home=tmp_path, notify="notify: {webhook: {connection: team_hook}}"))
        run = failed_run(path)
        RunNotifier(str(run.spec_path), "failed")(context(run))
    finally:
        server.shutdown()
    assert seen == [("POST", "/hook", "Bearer tk")], "the redirect was followed"
    [failed] = run.ledger.events(RUN_STAGE, "notify_failed")
    assert "302" in failed["error"] and "not followed" in failed["error"]


def test_an_invalid_webhook_url_puts_no_token_in_the_ledger_or_the_log(tmp_path, monkeypatch, caplog) -> None:
    hook = {"conn_type": "http", "password": "http://127.0.0.1:9/hook/SECRET\x01TOKEN123?key=KEY456"}
    monkeypatch.setenv("AIRFLOW_CONN_TEAM_HOOK", json.dumps(hook))
    path = tmp_path / f"{DAG_ID}.yaml"
    path.write_text(SPEC.format(home=tmp_path, notify="notify: {webhook: {connection: team_hook}}"))
    run = failed_run(path)
    with caplog.at_level(logging.INFO):
        RunNotifier(str(run.spec_path), "failed")(context(run))
    [failed] = run.ledger.events(RUN_STAGE, "notify_failed")
    assert failed["error"].startswith("InvalidURL")
    for secret in ("TOKEN123", "KEY456"):
        assert secret not in failed["error"] and secret not in caplog.text, secret
