"""Retries: only the errors S3 documents as transient, with jittered backoff, a bounded number of tries.

The server is a real HTTP server on 127.0.0.1 that answers S3 error documents in a scripted order,
reached by S3Tier's own minio client: what is retried is decided on real responses.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import urllib3
from minio.error import S3Error, ServerError

from trainyard.errors import DataError, TransientError
from trainyard.storage.s3 import S3Tier
from trainyard.storage.s3auth import S3Settings
from trainyard.storage.s3retry import Retry, retryable

SECRET = "secret-never-logged"
FAST = Retry(attempts=4, backoff_s=0.01, max_backoff_s=0.02)


class ScriptedS3:
    """Answers each request with the next scripted (status, S3 error code); 200 with a body when done."""

    def __init__(self) -> None:
        self.script: list[tuple[int, str]] = []
        self.requests = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.requests += 1
                status, code = outer.script.pop(0) if outer.script else (200, "")
                body = (
                    b"hello"
                    if status == 200
                    else f"<Error><Code>{code}</Code><Message>scripted</Message></Error>".encode()
                )
                self.send_response(status)
                self.send_header("Content-Type", "application/octet-stream" if status == 200 else "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("ETag", '"5d41402abc4b2a76b9719d911017c592"')
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def tier(self, retry: Retry = FAST) -> S3Tier:
        port = self.server.server_address[1]
        settings = S3Settings.from_endpoint_url(f"http://127.0.0.1:{port}", "key", SECRET, "us-east-1")
        return S3Tier("s3://bucket/data", settings, retry=retry)


@pytest.fixture
def s3() -> Iterator[ScriptedS3]:
    server = ScriptedS3()
    yield server
    server.server.shutdown()
    server.server.server_close()


@pytest.mark.parametrize(
    "script",
    [
        [(400, "RequestTimeout")],
        [(500, "InternalError")] * 2,  # urllib3's own single retry takes the first, tenacity the second
        [(503, "SlowDown"), (503, "SlowDown"), (503, "ServiceUnavailable")],
    ],
)
def test_transient_errors_are_retried_until_the_answer_comes(s3: ScriptedS3, script, caplog) -> None:
    s3.script = list(script)
    with caplog.at_level(logging.WARNING, logger="trainyard.storage.s3retry"):
        assert s3.tier().read_bytes("a.bin") == b"hello"
    assert s3.requests == len(script) + 1
    assert "read data/a.bin: try 1 of 4 failed" in caplog.text
    assert SECRET not in caplog.text


@pytest.mark.parametrize(
    ("status", "code"), [(403, "AccessDenied"), (400, "InvalidArgument"), (403, "RequestTimeTooSkewed")]
)
def test_other_errors_are_not_retried(s3: ScriptedS3, status: int, code: str) -> None:
    s3.script = [(status, code)] * 5
    with pytest.raises(S3Error) as raised:
        s3.tier().read_bytes("a.bin")
    assert raised.value.code == code and s3.requests == 1


def test_a_missing_object_is_asked_for_once(s3: ScriptedS3) -> None:
    s3.script = [(404, "NoSuchKey")] * 5
    assert s3.tier().read_bytes("a.bin") is None
    assert s3.requests == 1


def test_retries_are_bounded_and_end_in_a_transient_error(s3: ScriptedS3) -> None:
    s3.script = [(400, "RequestTimeout")] * 10
    with pytest.raises(TransientError, match=r"^read data/a\.bin: gave up after 3 tries: .*RequestTimeout"):
        s3.tier(Retry(attempts=3, backoff_s=0.01)).read_bytes("a.bin")
    assert s3.requests == 3


def test_the_time_budget_ends_retries_before_the_attempt_cap(s3: ScriptedS3) -> None:
    s3.script = [(400, "RequestTimeout")] * 10
    with pytest.raises(TransientError, match="gave up after 1 tries"):
        s3.tier(Retry(attempts=9, backoff_s=0.01, budget_s=0.0)).read_bytes("a.bin")
    assert s3.requests == 1


def _s3_error(status: int, code: str) -> S3Error:
    return S3Error(urllib3.HTTPResponse(status=status), code, "m", "/b/k", "req", "host")


@pytest.mark.parametrize(
    ("exc", "retry"),
    [
        (_s3_error(500, "InternalError"), True),
        (_s3_error(503, "SlowDown"), True),
        (_s3_error(400, "RequestTimeout"), True),
        (_s3_error(502, "BadGateway"), True),  # a 5xx whatever its code
        (_s3_error(404, "NoSuchKey"), False),
        (_s3_error(403, "AccessDenied"), False),
        (_s3_error(403, "RequestTimeTooSkewed"), False),
        (ServerError("server failed with HTTP status code 503", 503), True),
        (ServerError("server failed with HTTP status code 501", 501), False),
        (urllib3.exceptions.ProtocolError("Connection aborted."), True),
        (urllib3.exceptions.ReadTimeoutError(None, "/", "Read timed out."), True),  # type: ignore[arg-type]
        (
            urllib3.exceptions.MaxRetryError(
                None,  # type: ignore[arg-type]
                "/",
                urllib3.exceptions.NewConnectionError(None, "Connection refused"),  # type: ignore[arg-type]
            ),
            True,
        ),
        (urllib3.exceptions.MaxRetryError(None, "/", urllib3.exceptions.ResponseError("too many 503")), True),  # type: ignore[arg-type]
        (urllib3.exceptions.SSLError("certificate verify failed"), False),
        (ConnectionResetError(104, "reset"), True),
        (PermissionError(13, "denied"), False),
        (DataError("s3://b/k: failed verification"), False),
        (ValueError("x"), False),
    ],
)
def test_retryable(exc: BaseException, retry: bool) -> None:
    assert retryable(exc) is retry
