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
    """moto's STS on a port of its own: minio sends AssumeRoleWithWebIdentity unsigned, its parameters in
    the query string, which moto's all-services dispatcher cannot tell from an S3 request."""
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
