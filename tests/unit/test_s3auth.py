"""Where the S3 endpoint is and whose credentials: the standard AWS rules, decided without a server."""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from minio.credentials import StaticProvider

from trainyard.errors import SpecError
from trainyard.storage import open_tier
from trainyard.storage.s3 import S3Tier
from trainyard.storage.s3auth import (
    CHAIN_VARS,
    CredentialChain,
    CredentialsNotFound,
    S3Settings,
    credential_chain,
    endpoint_from,
    redact,
    settings_for,
)

SECRET = "wJalrXUtnFEMI-never-to-be-seen"


@pytest.fixture(autouse=True)
def no_aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No credentials or endpoint from the machine running the tests; no instance metadata either."""
    for name in CHAIN_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.aws/credentials
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def connection(**fields: Any) -> SimpleNamespace:
    """An Airflow connection as settings_for reads it (conn_id, login, password, host, port, extra_dejson)."""
    base: dict[str, Any] = {"conn_id": "cold", "login": None, "password": None, "host": None, "port": None}
    return SimpleNamespace(**{**base, "extra_dejson": fields.pop("extra", {}), **fields})


# ---------------------------------------------------------------- endpoint and region


def test_endpoint_variables_in_the_aws_order_then_the_alias_then_aws_itself() -> None:
    env = {
        "AWS_ENDPOINT_URL_S3": "http://s3only:9000",
        "AWS_ENDPOINT_URL": "https://all:443",
        "TRAINYARD_S3_ENDPOINT": "http://alias:9000",
    }
    assert endpoint_from(env, None) == ("s3only:9000", False)
    del env["AWS_ENDPOINT_URL_S3"]
    assert endpoint_from(env, None) == ("all:443", True)
    del env["AWS_ENDPOINT_URL"]
    assert endpoint_from(env, None) == ("alias:9000", False)
    assert endpoint_from({}, None) == ("s3.amazonaws.com", True)
    assert endpoint_from({}, "eu-west-1") == ("s3.eu-west-1.amazonaws.com", True)


def test_from_env_takes_region_and_endpoint_and_an_explicit_url_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-central-1")
    s = S3Settings.from_env()
    assert (s.endpoint, s.secure, s.region) == ("s3.eu-central-1.amazonaws.com", True, "eu-central-1")
    monkeypatch.setenv("AWS_REGION", "us-west-2")  # AWS_REGION first, as the AWS SDKs do
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    s = S3Settings.from_env()
    assert (s.endpoint, s.secure, s.region) == ("127.0.0.1:9000", False, "us-west-2")
    s = S3Settings.from_env("https://minio.example.com:9443")
    assert (s.endpoint, s.secure) == ("minio.example.com:9443", True)
    assert isinstance(s.credentials, CredentialChain)


def test_open_tier_without_settings_uses_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")
    tier = open_tier("s3://bucket/data")
    assert isinstance(tier, S3Tier) and tier.client._base_url.host == "127.0.0.1:9"


@pytest.mark.parametrize(
    ("url", "fix"), [("http://h:9000/bucket", "has a path"), ("ftp://h", "not an endpoint URL"), ("http://", "not")]
)
def test_a_bad_endpoint_names_the_variable_it_came_from(monkeypatch: pytest.MonkeyPatch, url: str, fix: str) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", url)
    with pytest.raises(SpecError, match=rf"^AWS_ENDPOINT_URL_S3: .*{fix}"):
        S3Settings.from_env()


# ---------------------------------------------------------------- connections


def test_a_connection_with_a_login_uses_it_and_its_endpoint_and_region(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://ignored:1")
    conn = connection(
        login="AKIAEXAMPLE",
        password=SECRET,
        extra={"endpoint_url": "http://minio:9000", "region_name": "us-east-1", "aws_session_token": "tok"},
    )
    s = settings_for(conn)
    assert (s.endpoint, s.secure, s.region) == ("minio:9000", False, "us-east-1")
    assert isinstance(s.credentials, StaticProvider)
    creds = s.credentials.retrieve()
    assert (creds.access_key, creds.secret_key, creds.session_token) == ("AKIAEXAMPLE", SECRET, "tok")
    assert "connection 'cold'" in s.source


def test_a_connection_host_and_port_or_else_the_environment_give_the_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    assert settings_for(connection(host="minio", port=9000)).endpoint == "minio:9000"
    assert settings_for(connection(host="https://s3.example.com")).endpoint == "s3.example.com"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://from-env:9000")
    assert settings_for(connection()).endpoint == "from-env:9000"
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    s = settings_for(connection(extra={"region_name": "ap-south-1"}))
    assert (s.endpoint, s.region) == ("s3.ap-south-1.amazonaws.com", "ap-south-1")


def test_a_connection_without_a_login_walks_the_chain_from_its_profile() -> None:
    s = settings_for(connection(extra={"endpoint_url": "http://minio:9000", "profile_name": "staging"}))
    assert isinstance(s.credentials, CredentialChain)
    assert "profile 'staging'" in repr(s.credentials)
    assert "chain" in s.source and "connection 'cold' has no login" in s.source


def test_half_a_login_is_refused_naming_the_connection() -> None:
    with pytest.raises(SpecError, match=r"connection 'cold': has a login but no password"):
        settings_for(connection(login="AKIAEXAMPLE", extra={"endpoint_url": "http://minio:9000"}))


# ---------------------------------------------------------------- the chain


def test_the_chain_takes_the_environment_first_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAENV")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    chain = credential_chain({"AWS_ACCESS_KEY_ID": "AKIAENV"})
    with caplog.at_level(logging.INFO, logger="trainyard.storage.s3auth"):
        assert chain.retrieve().access_key == "AKIAENV"
    assert chain.found is not None and chain.found.startswith("the environment")
    assert "s3 credentials from the environment" in caplog.text


def test_the_chain_reads_a_named_profile_of_the_shared_credentials_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "credentials"
    path.write_text(
        f"[default]\naws_access_key_id = AKIADEFAULT\naws_secret_access_key = x\n\n"
        f"[staging]\naws_access_key_id = AKIASTAGING\naws_secret_access_key = {SECRET}\n"
    )
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(path))
    monkeypatch.setenv("AWS_PROFILE", "staging")
    import os

    assert credential_chain(os.environ).retrieve().access_key == "AKIASTAGING"
    # A connection's profile_name extra wins over AWS_PROFILE.
    assert credential_chain(os.environ, profile="default").retrieve().access_key == "AKIADEFAULT"


def test_no_credentials_anywhere_is_one_error_that_lists_each_link_and_the_fix(tmp_path: Path) -> None:
    import os

    chain = credential_chain(os.environ, profile="ml", context="connection 'cold' has no login")
    with pytest.raises(CredentialsNotFound) as caught:
        chain.retrieve()
    message = str(caught.value)
    assert isinstance(caught.value, SpecError) and "\n" not in message
    assert message.startswith("no S3 credentials found (connection 'cold' has no login; tried the environment")
    assert "profile 'ml' of ~/.aws/credentials" in message
    assert "EC2 instance metadata: skipped (AWS_EC2_METADATA_DISABLED=true)" in message
    for fix in ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "profile_name", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN"):
        assert fix in message


def test_an_unreachable_sts_is_reported_without_the_web_identity_token(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    token = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJzeXN0ZW06c2EifQ.c2VjcmV0LXNpZ25hdHVyZQ"
    (tmp_path / "token").write_text(token)
    with socket.socket() as s:  # a port nobody listens on: refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(tmp_path / "token"))
    monkeypatch.setenv("AWS_ROLE_ARN", "arn:aws:iam::123456789012:role/trainyard")
    monkeypatch.setenv("AWS_ENDPOINT_URL_STS", f"http://127.0.0.1:{port}")
    import os

    with pytest.raises(CredentialsNotFound) as caught:
        credential_chain(os.environ).retrieve()
    message = str(caught.value)
    assert f"web identity (AWS_WEB_IDENTITY_TOKEN_FILE {tmp_path / 'token'}" in message
    assert f"STS http://127.0.0.1:{port}" in message
    assert token not in message and "c2VjcmV0" not in message


def test_unreachable_instance_metadata_is_one_more_link_in_the_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.delenv("AWS_EC2_METADATA_DISABLED")
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(CredentialsNotFound, match=rf"EC2 instance metadata \(http://127\.0\.0\.1:{port}\): \w+"):
        credential_chain(os.environ).retrieve()


def test_redact_drops_every_query_string() -> None:
    exc = ValueError("http://sts/?Action=X&WebIdentityToken=eyJsecret failed with HTTP status code 403")
    assert redact(exc) == "http://sts/?… failed with HTTP status code 403"


# ---------------------------------------------------------------- secrets stay out of sight


def test_settings_repr_str_and_log_lines_never_hold_the_secret(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAENV")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9000")
    with caplog.at_level(logging.DEBUG):
        shown = [
            S3Settings.from_env(),
            S3Settings.from_endpoint_url("http://127.0.0.1:9000", "AKIA", SECRET, session_token=SECRET),
            settings_for(connection(login="AKIA", password=SECRET, extra={"aws_session_token": SECRET})),
            settings_for(connection(extra={"endpoint_url": "http://127.0.0.1:9000"})),
        ]
        for s in shown:
            s.credentials.retrieve()
    for s in shown:
        for text in (repr(s), str(s), repr(s.credentials), f"{s}"):
            assert SECRET not in text
        assert "127.0.0.1:9000" in repr(s)
    assert caplog.records and SECRET not in caplog.text
    assert "s3 endpoint 127.0.0.1:9000 (http), credentials from" in caplog.text
