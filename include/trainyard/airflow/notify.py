"""Email a run's failure or recovery through Airflow's own SMTP notifier (the spec's ``notify``).

Why DAG-level callbacks (``on_failure_callback`` / ``on_success_callback``) and not a task:

- they fire wherever a DAG run ends: under the scheduler the DAG processor runs
  them (it parses the DAG file again and serves the connection), and
  ``airflow dags test`` runs them in its own process when the run ends
  (``DagRun.execute_dag_callbacks``), so one mechanism covers both;
- they fire however the run failed, also when a task was killed, timed out or
  never started, which a last "notify" task would not see (it would need a
  trigger rule that runs after anything, and as a leaf it would set the run's state);
- they hold no worker slot and add no task to the pipeline's graph.

Which notice to send, and its text, come from the run ledger (``trainyard.report.notice``).
The message goes through ``SmtpNotifier.notify`` directly, not ``notifier(context)``:
``__call__`` renders the subject and body as Jinja templates, and a body that quotes an
error message or a spec's ``{{ ds }}`` is text, not a template. The body also carries no brace
(``Notice.html``), so no later render can run what a rank wrote, and a body that cannot be
encoded (a rank's stray surrogate) goes again as plain ASCII rather than not at all. The mail
server, login and password come only from the Airflow connection; nothing here logs them.

A notice that cannot be sent never fails or hides anything: the callback logs one warning
naming the connection (no traceback) and records ``notify_failed`` in the run ledger. That
warning's reason is redacted (``redacted``): a URL's path, query and login and the connection's
password never reach the log or the ledger (an ``InvalidURL`` quotes the URL it refused).

Each channel takes only a connection of its own kind (``Channel.types``): a spec's author names the
connection, and any other connection's secret would be sent to its host or to Slack. A webhook
never follows a redirect: urllib would send the connection's headers (its ``Authorization``) on.
"""

from __future__ import annotations

import logging
import re
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

from trainyard.errors import SpecError
from trainyard.pipeline.run import RUN_STAGE, SNAPSHOT, Run, load_run
from trainyard.report.notice import Notice, RunFacts, notice_from_ledger
from trainyard.spec import NotifySpec, PipelineSpec, load_spec

if TYPE_CHECKING:
    from airflow.sdk import Context

log = logging.getLogger(__name__)

Outcome = Literal["failed", "succeeded"]


def dag_callbacks(spec_path: str, spec: PipelineSpec) -> dict[str, Any]:
    """``DAG(...)`` keyword arguments of the spec's notifications (none without ``notify``).

    A success callback is only needed for recovery notices; a failure notice
    also goes out from it when the ledger says a stage failed and Airflow's run
    state does not.
    """
    if spec.notify is None:
        return {}
    callbacks: dict[str, Any] = {"on_failure_callback": RunNotifier(spec_path, "failed")}
    if "recovery" in spec.notify.on:
        callbacks["on_success_callback"] = RunNotifier(spec_path, "succeeded")
    return callbacks


class RunNotifier:
    """A DAG-level callback: build the run's notice from its ledger and send it with ``SmtpNotifier``."""

    def __init__(self, spec_path: str, outcome: Outcome):
        self.spec_path = spec_path
        self.outcome = outcome

    def __repr__(self) -> str:  # Airflow logs the callback it runs
        return f"RunNotifier({self.spec_path!r}, {self.outcome!r})"

    def __call__(self, context: Any) -> None:
        dag_id, run_id = context["dag"].dag_id, str(context["run_id"])
        try:
            self._notify(context, dag_id, run_id)
        except SpecError as exc:
            log.warning("notify: no notice for run %s of %s: the spec cannot be read: %s", run_id, dag_id, exc)
        except Exception as exc:
            log.warning(
                "notify: no notice for run %s of %s: %s: %s (the run itself is not affected)",
                run_id,
                dag_id,
                type(exc).__name__,
                exc,
            )

    def _notify(self, context: Any, dag_id: str, run_id: str) -> None:
        run, notify = _run_and_notify(self.spec_path, dag_id, run_id)
        if notify is None:
            log.info("notify: the run's spec has no notify section; nothing to send")
            return
        facts = _facts(context, run, self.outcome)
        notice = notice_from_ledger(run.ledger, facts, notify.on)
        if notice is None:
            log.info("notify: nothing to send for run %s (notify.on: %s)", run_id, ", ".join(notify.on))
            return
        deliver(notice, notify, run, context)


@dataclass(frozen=True)
class Channel:
    name: Literal["email", "slack", "webhook"]
    connection: str
    check: str
    """What to check in the connection when a notice did not go (never its secrets)."""
    send: Callable[[Notice, Any], None]
    types: tuple[str, ...]
    """The connection types it sends through."""


def channels(notify: NotifySpec) -> list[Channel]:
    """Where the spec's ``notify`` sends each notice: email, Slack and a webhook, as it lists them."""
    out = []
    if notify.email:
        out.append(
            Channel(
                "email",
                notify.connection,
                "type smtp: host, port, login, from_email extra; or notify.from_email",
                lambda notice, context: _smtp_send(notice, notify, context),
                ("smtp", "email"),
            )
        )
    if slack := notify.slack:
        out.append(
            Channel(
                "slack",
                slack.connection,
                "type slackwebhook: the incoming webhook's token or URL in the password",
                lambda notice, context: _slack_send(notice, slack.connection),
                ("slackwebhook",),
            )
        )
    if webhook := notify.webhook:
        out.append(
            Channel(
                "webhook",
                webhook.connection,
                "the endpoint's http(s) URL in the password or host, its headers in the extra",
                lambda notice, context: _webhook_send(notice, webhook.connection, context),
                ("http",),
            )
        )
    return out


def deliver(notice: Notice, notify: NotifySpec, run: Run, context: Any) -> bool:
    """Send ``notice`` through every channel of ``notify``. One that fails logs one warning naming its
    connection, is recorded, and keeps none of the others from sending. True if every channel sent it."""
    every = True
    for channel in channels(notify):
        try:
            _check_type(channel)
            channel.send(notice, context)
        except Exception as exc:
            reason = redacted(f"{type(exc).__name__}: {str(exc).rstrip('.')}", _secrets(channel.connection))
            log.warning(
                "notify: the %s notice of run %s was NOT sent by %s through the Airflow connection %r: %s. Check"
                " that connection (%s) in %s; the run itself is not affected.",
                notice.kind,
                run.run_id,
                channel.name,
                channel.connection,
                reason,
                channel.check,
                run.spec_path,
            )
            run.ledger.append(
                RUN_STAGE,
                "notify_failed",
                kind=notice.kind,
                channel=channel.name,
                connection=channel.connection,
                error=reason,
            )
            every = False
            continue
        to = list(notify.email) if channel.name == "email" else []
        log.info("notify: %s notice of run %s sent by %s %s", notice.kind, run.run_id, channel.name, ", ".join(to))
        run.ledger.append(
            RUN_STAGE,
            "notified",
            kind=notice.kind,
            channel=channel.name,
            connection=channel.connection,
            to=to,
            subject=notice.subject,
        )
    return every


def _check_type(channel: Channel) -> None:
    from airflow.sdk import BaseHook

    kind = BaseHook.get_connection(channel.connection).conn_type
    if kind not in channel.types:
        raise ValueError(
            f"the connection is of type {kind!r}; a {channel.name} notice goes only through a connection of type"
            f" {' or '.join(channel.types)}"
        )


def _secrets(connection: str) -> list[str]:
    """What of ``connection`` must not be printed: its password, and its URLs' login, path and query."""
    from airflow.sdk import BaseHook

    try:
        conn = BaseHook.get_connection(connection)
    except Exception:
        return []
    found = [v for v in (conn.password, conn.login) if v]
    for value in (conn.password, conn.host):
        if value and "://" in value:
            rest = value.split("://", 1)[1]
            found += [part for part in re.split(r"[/?&=#@:]", rest)[1:] if len(part) >= 4 and not part.isdigit()]
    return found


# Any URL: kept to its scheme and host, since a path, a query or a login may be a token.
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)(?:[^/\s'\"@]*@)?([^/\s'\"?#]*)[^\s'\"]*")


def redacted(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every URL cut to its scheme and host and every secret (as given, stripped of control
    characters, or as ``repr`` escapes it) replaced: what an error message may quote is not ours to trust."""
    text = _URL.sub(lambda m: f"{m.group(1)}{m.group(2)}/[redacted]", text)
    forms = {f for s in secrets for f in (s, s.strip(), re.sub(r"[\x00-\x1f\x7f]", "", s), repr(s)[1:-1]) if f}
    for secret in sorted(forms, key=len, reverse=True):
        text = text.replace(secret, "[redacted]")
    return text


def _slack_send(notice: Notice, connection: str) -> None:
    """Post the notice through the Slack provider's webhook notifier: ``notify()``, which sends the text as
    given; calling the notifier would render it as a template first (rank text is data: issue 19)."""
    from airflow.providers.slack.notifications.slack_webhook import SlackWebhookNotifier

    SlackWebhookNotifier(slack_webhook_conn_id=connection, text=notice.slack(), unfurl_links=False).notify({})


WEBHOOK_TIMEOUT_S = 10.0


def _webhook_send(notice: Notice, connection: str, context: Any) -> None:
    """``POST`` the notice as JSON to the connection's URL; any answer but 2xx raises."""
    import json

    from airflow.sdk import BaseHook

    conn = BaseHook.get_connection(connection)
    url = webhook_url(conn.password, conn.host)
    headers = conn.extra_dejson.get("headers") or {}
    if not isinstance(headers, dict) or not all(isinstance(v, str) for v in headers.values()):
        raise ValueError("the extra's headers must be an object of strings")
    dag = context.get("dag")
    body = {
        "kind": notice.kind,
        "subject": notice.subject,
        "text": notice.text,
        "dag_id": getattr(dag, "dag_id", None),
        "run_id": str(context.get("run_id", "")),
        "link": notice.link,
    }
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={**headers, "Content-Type": "application/json"},
        method="POST",
    )
    opener = urllib.request.build_opener(_NoRedirect())
    with opener.open(request, timeout=WEBHOOK_TIMEOUT_S) as answer:  # webhook_url: http(s) only
        answer.read(1 << 16)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Refuse every redirect: urllib would send the connection's headers (``Authorization``) to wherever the
    endpoint points, and a webhook's URL is the admin's to set, not the endpoint's to move."""

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> None:
        raise urllib.error.HTTPError(
            req.full_url,
            code,
            f"the webhook answered {code} (a redirect), not followed: set the final URL",
            headers,
            fp,
        )


def webhook_url(password: str | None, host: str | None) -> str:
    """The endpoint's URL: the connection's password if it holds one (a URL with a token is a secret), else its
    host; only ``http``/``https``. Never in a message: it may carry the token."""
    for value in (password, host):
        if value and "://" in value:
            scheme = value.split("://", 1)[0].lower()
            if scheme not in ("http", "https"):
                raise ValueError(f"the webhook URL's scheme is {scheme!r}; only http and https are sent to")
            return value.strip()
    raise ValueError("no http(s) URL in the password or the host")


def _smtp_send(notice: Notice, notify: NotifySpec, context: Any) -> None:
    """Send ``notice`` as HTML; a body that cannot go as such (a rank's unencodable text) goes as plain ASCII."""
    from jinja2 import TemplateError

    try:
        _smtp_send_body(notice.subject, notice.html(), notify, context)
    except (UnicodeError, TemplateError) as exc:  # the server and the login would fail the same way again
        log.warning(
            "notify: the %s notice could not go as HTML (%s); sending it as plain ASCII text",
            notice.kind,
            type(exc).__name__,
        )
        _smtp_send_body(*notice.plain(), notify, context)


def _smtp_send_body(subject: str, body: str, notify: NotifySpec, context: Any) -> None:
    # Imported when a notice goes out: the DAG processor imports this module to parse every pipeline.
    from airflow.providers.smtp.notifications.smtp import SmtpNotifier

    # ``notify()``, not ``notifier(context)``: only fields left None are filled from the connection's
    # templates and rendered; the subject and body are always given, so only a sender taken from the
    # connection (admin-written) is rendered. The body is inert besides (``Notice.html``: no braces).
    notifier = SmtpNotifier(
        to=list(notify.email),
        from_email=notify.from_email,
        subject=subject,
        html_content=body,
        smtp_conn_id=notify.connection,
    )
    # That sender is rendered with the DAG's template environment; under ``airflow dags test`` the
    # context's DAG is a SerializedDAG, which has none. Without a DAG the notifier uses a sandboxed default.
    notifier.notify(cast("Context", {k: v for k, v in context.items() if k != "dag"}))


def _run_and_notify(spec_path: str, dag_id: str, run_id: str) -> tuple[Run, NotifySpec | None]:
    """The run (for its folder and ledger) and the ``notify`` it started with.

    The run's spec snapshot wins over the file (the spec a run started with is
    the one it finishes with); a run that failed before any task wrote the
    snapshot falls back to the file as it is now.
    """
    spec = load_spec(spec_path)
    run = Run(spec=spec, spec_path=Path(spec_path), dag_id=dag_id, run_id=run_id, ds="")
    if not (run.dir / SNAPSHOT).exists():
        return run, spec.notify
    try:
        pinned = load_run(run.dir / SNAPSHOT)  # the one reader of the snapshot, as every task uses
    except SpecError:
        return run, spec.notify
    return pinned, pinned.spec.notify


def _facts(context: Any, run: Run, outcome: Outcome) -> RunFacts:
    from airflow.sdk import conf

    from trainyard.report.pages import run_url

    ti = context.get("ti") or context.get("task_instance")
    # Airflow cannot guess its public address; without [api] base_url there is no link to give.
    base_url = conf.get("api", "base_url", fallback=None)
    report = run.dir / "report.html"
    return RunFacts(
        dag_id=run.dag_id,
        run_id=run.run_id,
        failed=outcome == "failed",
        failed_task=getattr(ti, "task_id", None) if outcome == "failed" else None,
        reason=context.get("reason"),
        link=run_url(base_url, run.dag_id, run.run_id) if base_url else None,
        report=str(report) if report.exists() else None,
    )
