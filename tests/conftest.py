"""Test-wide isolation: Airflow and trainyard homes in a temporary folder.

Set before anything imports Airflow, so no test touches a developer's
``~/airflow`` or the project's ``.airflow``. Also the ``smtp_server`` fixture:
a real SMTP server (aiosmtpd) on 127.0.0.1 for the notification tests.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_HOME = Path(tempfile.mkdtemp(prefix="trainyard-tests-"))
os.environ["AIRFLOW_HOME"] = str(_HOME / "airflow")
os.environ["TRAINYARD_HOME"] = str(_HOME / "trainyard")
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(ROOT / "dags")
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
# The connection ids the notice tests send through, as an admin would list them ([trainyard] notify_connections);
# tests/unit/test_admin_allow_lists.py checks the list itself with this unset.
os.environ["AIRFLOW__TRAINYARD__NOTIFY_CONNECTIONS"] = "mail mail_down team_slack team_hook warehouse"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``make test``'s second phase collects only the files that say ``mark.alone`` (collecting every file costs
    ~20 s of imports): a test marked ``alone`` some other way would run in neither phase, so it fails here."""
    for item in items:
        if item.get_closest_marker("alone") and "mark.alone" not in item.path.read_text():
            raise pytest.UsageError(f"{item.nodeid} is marked alone but its file never says mark.alone: write it so")


# ------------------------------------------------------------------ a real SMTP server (aiosmtpd) on 127.0.0.1


class MailSink:
    """An aiosmtpd handler: keeps every message received; a login passes only with the expected password."""

    def __init__(self, port: int, login: str = "trainyard", password: str = "s3cret-smtp-pass"):
        self.port, self.login, self.password = port, login, password
        self.mails: list[dict] = []
        self.logins: list[str] = []

    async def handle_DATA(self, server, session, envelope):  # aiosmtpd's hook for a message's content
        import email
        from email import policy

        message = email.message_from_bytes(envelope.original_content, policy=policy.default)
        self.mails.append({"from": envelope.mail_from, "to": list(envelope.rcpt_tos), "message": message})
        return "250 OK"

    def authenticate(self, server, session, envelope, mechanism, auth_data):
        from aiosmtpd.smtp import AuthResult, LoginPassword

        login = auth_data.login.decode() if isinstance(auth_data, LoginPassword) else str(auth_data)
        self.logins.append(login)
        ok = (
            isinstance(auth_data, LoginPassword)
            and auth_data.password.decode() == self.password
            and login == self.login
        )
        return AuthResult(success=ok, handled=False)

    def connection(self, port: int | None = None, **extra) -> str:
        """An ``AIRFLOW_CONN_*`` value (JSON) for this server (or ``port``): plain SMTP, no TLS (a test server)."""
        import json

        return json.dumps(
            {
                "conn_type": "smtp",
                "host": "127.0.0.1",
                "port": port or self.port,
                "login": self.login,
                "password": self.password,
                "extra": {"disable_tls": True, "disable_ssl": True, "timeout": 10, "retry_limit": 0, **extra},
            }
        )

    @staticmethod
    def text(mail: dict) -> str:
        """The text of a message's HTML body (tags dropped, entities decoded)."""
        import html
        import re

        part = mail["message"].get_body(preferencelist=("html", "plain"))
        return html.unescape(re.sub(r"<[^>]+>", "", part.get_content()))


@pytest.fixture
def smtp_server():
    """A :class:`MailSink` serving SMTP on a free port of 127.0.0.1; login ``trainyard`` with its password."""
    from aiosmtpd.controller import Controller

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sink = MailSink(port)
    controller = Controller(
        sink,
        hostname="127.0.0.1",
        port=port,
        authenticator=sink.authenticate,
        auth_required=True,
        auth_require_tls=False,
    )
    controller.start()
    try:
        yield sink
    finally:
        controller.stop()
