"""The standard credential chain against real servers: SeaweedFS's S3, and moto's S3, STS and instance metadata.

SeaweedFS checks every signature against its one identity, so a stage that
works there was signed with the keys the chain should have picked (a test
offers wrong keys beside them, so picking those would fail). Temporary keys
(from STS for a web identity token, from instance metadata) are issued by moto
and no real server here knows them: those tests use moto's S3, which accepts
any signature, and record each request as it arrives to see whose access key
signed it.
"""

from __future__ import annotations

import io
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import pytest
from minio.error import S3Error
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from sts_helpers import in_, stub_sts
from werkzeug.serving import make_server

from trainyard.storage.s3 import S3Tier
from trainyard.storage.s3auth import CHAIN_VARS, S3Settings, settings_for
from trainyard.storage.staging import stage

pytestmark = pytest.mark.integration
ROLE = "arn:aws:iam::123456789012:role/trainyard-staging"
# Shaped as the projected service-account token of IRSA (header.payload.signature); STS here checks nothing.
JWT = "eyJhbGciOiJSUzI1NiIsImtpZCI6InRlc3QifQ.eyJzdWIiOiJzeXN0ZW06c2VydmljZWFjY291bnQ6dHJhaW55YXJkIn0.c2lnbmF0dXJl"


@dataclass
class Recorded:
    """A moto application over HTTP on 127.0.0.1 that keeps each request's method, query and signer."""

    url: str
    requests: list[dict[str, str]] = field(default_factory=list)

    def access_keys(self) -> set[str]:
        """The access key ids that signed the requests (SigV4 ``Credential=<key>/<scope>``)."""
        keys = set()
        for r in self.requests:
            if "Credential=" in r["authorization"]:
                keys.add(r["authorization"].split("Credential=", 1)[1].split("/", 1)[0])
        return keys


@contextmanager
def serving(app: Any) -> Iterator[Recorded]:
    recorded = Recorded("")

    def recording(environ: dict[str, Any], start_response: Any) -> Any:
        query = parse_qs(environ.get("QUERY_STRING", ""))
        if environ.get("CONTENT_TYPE", "").startswith("application/x-www-form-urlencoded"):
            # botocore sends STS's Action in a form body; read it and hand the app the same bytes.
            body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
            environ["wsgi.input"] = io.BytesIO(body)
            query = {**query, **parse_qs(body.decode())}
        recorded.requests.append(
            {
                "method": environ["REQUEST_METHOD"],
                "action": query.get("Action", [""])[0],
                "authorization": environ.get("HTTP_AUTHORIZATION", ""),
                "token": environ.get("HTTP_X_AMZ_SECURITY_TOKEN", ""),
            }
        )
        return app(environ, start_response)

    server = make_server("127.0.0.1", 0, recording, threaded=True, request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    recorded.url = f"http://127.0.0.1:{server.server_port}"
    try:
        yield recorded
    finally:
        server.shutdown()
        thread.join()
        server.server_close()


@pytest.fixture
def s3(moto_server: Any) -> Iterator[Recorded]:
    """moto's S3 (the same in-process buckets as ``moto_server``), every request recorded."""
    with serving(DomainDispatcherApplication(create_backend_app)) as recorded:
        yield recorded


@pytest.fixture
def sts() -> Iterator[Recorded]:
    """moto's STS on a port of its own: its all-services dispatcher may take an STS call for an S3 request."""
    with serving(create_backend_app("sts")) as recorded:
        yield recorded


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in CHAIN_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_REGION", "us-east-1")


def fill(s3_server: Any, bucket: str, n: int = 3) -> dict[str, bytes]:
    """Objects written by another tool (minio's client, fixed keys): what a platform's bucket holds."""
    import io

    client = s3_server.client()
    files = {f"shard_{i}.bin": bytes([i]) * (1000 + i) for i in range(n)}
    for key, data in files.items():
        client.put_object(bucket, f"ds/{key}", io.BytesIO(data), len(data))
    return files


def staged(settings: S3Settings, bucket: str, hot: Path) -> dict[str, bytes]:
    tier = S3Tier(f"s3://{bucket}/ds", settings)
    result = stage(tier, hot)
    assert result.files == len(tier.list())
    return {p.name: p.read_bytes() for p in hot.glob("*.bin")}


def test_environment_credentials_without_a_login_stage_and_list(
    s3_server: Any, bucket: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    files = fill(s3_server, bucket)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    settings = S3Settings.from_env()
    assert staged(settings, bucket, tmp_path / "hot") == files
    assert settings.credentials.retrieve().access_key == s3_server.access_key


def test_a_web_identity_token_is_exchanged_at_sts_and_its_temporary_keys_sign_s3(
    moto_server: Any, s3: Recorded, sts: Recorded, moto_bucket: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    bucket = moto_bucket
    files = fill(moto_server, bucket)
    (tmp_path / "token").write_text(JWT)
    monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(tmp_path / "token"))  # as IRSA sets them in a pod
    monkeypatch.setenv("AWS_ROLE_ARN", ROLE)
    monkeypatch.setenv("AWS_ENDPOINT_URL_STS", sts.url)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3.url)
    settings = S3Settings.from_env()
    assert staged(settings, bucket, tmp_path / "hot") == files

    creds = settings.credentials.retrieve()
    assert creds.access_key.startswith("ASIA") and creds.session_token  # STS's temporary keys, not static ones
    assert [r["action"] for r in sts.requests] == ["AssumeRoleWithWebIdentity"]  # once: the keys are cached
    assert s3.access_keys() == {creds.access_key}
    assert {r["token"] for r in s3.requests} == {creds.session_token}
    assert getattr(settings.credentials, "found", "").startswith("web identity")


def test_a_named_profile_of_the_shared_credentials_file(
    s3_server: Any, bucket: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    files = fill(s3_server, bucket)
    path = tmp_path / "aws-credentials"
    path.write_text(  # the default profile's keys are refused by the server: only the named one works
        "[default]\naws_access_key_id = AKIADEFAULT\naws_secret_access_key = d\n\n"
        f"[datasets]\naws_access_key_id = {s3_server.access_key}\naws_secret_access_key = {s3_server.secret_key}\n"
    )
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(path))
    monkeypatch.setenv("AWS_PROFILE", "datasets")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.url)
    assert staged(S3Settings.from_env(), bucket, tmp_path / "hot") == files
    monkeypatch.setenv("AWS_PROFILE", "default")
    with pytest.raises(S3Error, match="AccessDenied|InvalidAccessKeyId|SignatureDoesNotMatch"):
        S3Tier(f"s3://{bucket}/ds", S3Settings.from_env()).list()


def test_instance_metadata_when_nothing_else_answers(
    moto_server: Any, s3: Recorded, moto_bucket: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    bucket = moto_bucket
    files = fill(moto_server, bucket)
    monkeypatch.delenv("AWS_EC2_METADATA_DISABLED")
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", moto_server.url)  # moto serves /latest/meta-data too
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3.url)
    settings = S3Settings.from_env()
    assert staged(settings, bucket, tmp_path / "hot") == files
    assert s3.access_keys() == {settings.credentials.retrieve().access_key}
    assert getattr(settings.credentials, "found", "").startswith("EC2 instance metadata")


def test_an_airflow_connection_with_endpoint_url_and_no_login_uses_the_chain(
    s3_server: Any, bucket: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import json

    from airflow.sdk import Connection

    files = fill(s3_server, bucket)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")  # the connection's endpoint wins
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    conn = Connection(
        conn_id="trainyard_cold",
        conn_type="aws",
        extra=json.dumps({"endpoint_url": s3_server.url, "region_name": "us-east-1"}),
    )
    settings = settings_for(conn)
    assert settings.endpoint == s3_server.url.removeprefix("http://") and not settings.secure
    assert staged(settings, bucket, tmp_path / "hot") == files
    assert settings.credentials.retrieve().access_key == s3_server.access_key


def test_missing_credentials_fail_the_stage_with_the_one_line_that_says_how_to_fix_it(
    s3_server: Any, bucket: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from trainyard.storage.s3auth import CredentialsNotFound

    fill(s3_server, bucket)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.url)
    tier = S3Tier(f"s3://{bucket}/ds", S3Settings.from_env())
    with pytest.raises(CredentialsNotFound, match=r"^no S3 credentials found \(tried the environment") as caught:
        stage(tier, tmp_path / "hot")
    assert "AWS_ACCESS_KEY_ID" in str(caught.value) and "AWS_PROFILE" in str(caught.value)
    assert not list(tmp_path.glob("hot/*.bin"))


# ---------------------------------------------------------------- profiles and assumed roles, fixture keys only
# These use only the S3 fixture's interface (url, client(), access_key, secret_key), so they hold against any
# real S3 server: the keys that reach the bucket are the server's own, found through a profile or an assumed role,
# while every other key in play is one the server does not know.


def aws_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, credentials: str, config: str) -> None:
    """A shared credentials file and config file of our own, as ``aws configure`` writes them."""
    (tmp_path / "aws-credentials").write_text(credentials)
    (tmp_path / "aws-config").write_text(config)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))


def test_a_profile_of_the_shared_files_reaches_a_real_bucket(
    s3_server: Any, bucket: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    files = fill(s3_server, bucket)
    aws_files(
        tmp_path,
        monkeypatch,
        "[default]\naws_access_key_id = AKIANOTKNOWNHERE\naws_secret_access_key = not-known\n\n"
        f"[datasets]\naws_access_key_id = {s3_server.access_key}\naws_secret_access_key = {s3_server.secret_key}\n",
        "[profile datasets]\nregion = us-east-1\n",
    )
    monkeypatch.setenv("AWS_PROFILE", "datasets")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.url)
    settings = S3Settings.from_env()
    assert staged(settings, bucket, tmp_path / "hot") == files
    assert settings.credentials.retrieve().access_key == s3_server.access_key
    assert getattr(settings.credentials, "found", "") == "the shared credentials file"


ROLE_SESSION = "nightly-staging"


def test_a_profile_role_assumed_with_its_source_profile_reaches_a_real_bucket(
    s3_server: Any, bucket: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``role_arn`` + ``source_profile`` in the config file, assumed by botocore, the keys handed to minio.

    STS is botocore's ``Stubber`` on the very client botocore's AssumeRoleProvider creates
    (``sts_helpers``): SeaweedFS has no STS, and moto's STS issues keys no other S3 server accepts.
    The stub answers with the S3 server's own keys (and no session token, which a server that issued
    none would refuse), so the assumed keys reach the real bucket; the source profile's keys are
    unknown to the server, so they could not have. The test asserts the AssumeRole request carried
    the role and session name and was signed with the source profile's keys.
    """
    files = fill(s3_server, bucket)
    aws_files(
        tmp_path,
        monkeypatch,
        "[base]\naws_access_key_id = AKIABASESOURCE00\naws_secret_access_key = base-secret\n",
        f"[profile staging]\nrole_arn = {ROLE}\nsource_profile = base\nrole_session_name = {ROLE_SESSION}\n",
    )
    monkeypatch.setenv("AWS_PROFILE", "staging")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.url)
    sts = stub_sts(monkeypatch, (s3_server.access_key, s3_server.secret_key, "", in_(3600)))
    settings = S3Settings.from_env()
    assert staged(settings, bucket, tmp_path / "hot") == files
    assert sts.calls == [{"RoleArn": ROLE, "RoleSessionName": ROLE_SESSION}]  # once: botocore keeps the keys
    assert [c["access_key"] for c in sts.clients] == ["AKIABASESOURCE00"]
    assert getattr(settings.credentials, "found", "") == "an assumed role"


def test_an_airflow_connection_role_arn_reaches_a_real_bucket(
    s3_server: Any, bucket: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A connection's ``role_arn`` extra, assumed with its login and password at its ``service_config``
    STS endpoint (STS stubbed as in the test above, for the same reasons)."""
    import json

    from airflow.sdk import Connection

    files = fill(s3_server, bucket)
    sts = stub_sts(monkeypatch, (s3_server.access_key, s3_server.secret_key, "", in_(3600)))
    extra = {
        "endpoint_url": s3_server.url,
        "region_name": "us-east-1",
        "role_arn": ROLE,
        "service_config": {"sts": {"endpoint_url": "https://sts.example.internal"}},
    }
    conn = Connection(
        conn_id="trainyard_cold",
        conn_type="aws",
        login="AKIACONNSOURCE00",
        password="connection-source-secret",
        extra=json.dumps(extra),
    )
    settings = settings_for(conn)
    assert staged(settings, bucket, tmp_path / "hot") == files
    assert sts.calls == [{"RoleArn": ROLE, "RoleSessionName": "Airflow_trainyard_cold"}]
    assert sts.clients == [
        {"endpoint_url": "https://sts.example.internal", "region": "us-east-1", "access_key": "AKIACONNSOURCE00"}
    ]


@contextmanager
def debug_logs(*names: str) -> Iterator[list[str]]:
    """Every record of these loggers at DEBUG, formatted with its arguments, in a list.

    A handler of our own on each logger, not caplog's on the root: importing Airflow's SDK
    reconfigures the root logger's handlers, and a test must see what a deployment's handlers would.
    """
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(f"{record.name} {record.getMessage()} {record.exc_text or ''}")

    handler = Keep(logging.DEBUG)
    handler.setFormatter(logging.Formatter())
    saved = [(logging.getLogger(n), logging.getLogger(n).level) for n in names]
    for logger, _ in saved:
        logger.setLevel(logging.DEBUG)
        logger.addHandler(handler)
    try:
        yield lines
    finally:
        for logger, level in saved:
            logger.removeHandler(handler)
            logger.setLevel(level)


def test_assumed_keys_from_a_real_sts_stay_out_of_debug_logs_and_reprs(
    sts: Recorded, monkeypatch: pytest.MonkeyPatch
) -> None:
    """moto's STS over HTTP, so botocore's DEBUG dumps of the request and of the answer (which carries the
    assumed secret and session token) really happen; none of the secrets reaches a log record."""
    import json

    from airflow.sdk import Connection

    from trainyard.storage.s3auth import CredentialsNotFound

    extra = {
        "endpoint_url": "http://127.0.0.1:9",
        "role_arn": ROLE,
        "service_config": {"sts": {"endpoint_url": sts.url}},
    }
    source_secret = "connection-source-secret-never-seen"
    conn = Connection(
        conn_id="cold", conn_type="aws", login="AKIACONNSOURCE00", password=source_secret, extra=json.dumps(extra)
    )
    refused_conn = Connection(conn_id="cold", conn_type="aws", extra=json.dumps({"profile_name": "nowhere"}))
    with debug_logs("botocore", "trainyard", "minio", "urllib3") as lines:
        settings = settings_for(conn)
        creds = settings.credentials.retrieve()
        refused = settings_for(refused_conn)
        with pytest.raises(CredentialsNotFound) as caught:
            refused.credentials.retrieve()
    assert [r["action"] for r in sts.requests] == ["AssumeRole"] and creds.session_token
    secrets = (source_secret, creds.secret_key, creds.session_token)
    assert any(line.startswith("botocore.") for line in lines) and any("s3 credentials from" in x for x in lines)
    assert not any(secret in line for secret in secrets for line in lines)
    for text in (repr(settings), str(settings), repr(settings.credentials), settings.source):
        assert not any(secret in text for secret in secrets)
    assert not any(secret in f"{caught.value!s} {caught.value!r}" for secret in secrets)
