"""Where the S3 endpoint is and whose credentials: the standard AWS rules, decided without a server.

STS is botocore's ``Stubber`` (``sts_helpers``): each assumed role is answered in process and recorded.
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from minio.credentials import StaticProvider
from sts_helpers import in_, stub_sts

from trainyard.errors import SpecError, TransientError
from trainyard.storage import open_tier
from trainyard.storage.s3 import S3Tier
from trainyard.storage.s3auth import (
    CHAIN_VARS,
    ChainProvider,
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
    assert isinstance(s.credentials, ChainProvider)


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
    assert isinstance(s.credentials, ChainProvider)
    assert "profile 'staging'" in repr(s.credentials)
    assert "chain" in s.source and "connection 'cold' has no login" in s.source


def test_a_connection_takes_keys_from_its_extras_and_the_s3_endpoint_from_its_service_config() -> None:
    extra = {
        "aws_access_key_id": "AKIAEXTRA",
        "aws_secret_access_key": SECRET,
        "endpoint_url": "http://all-services:1",
        "service_config": {"s3": {"endpoint_url": "https://s3-only:9443"}},
    }
    s = settings_for(connection(extra=extra))
    assert (s.endpoint, s.secure) == ("s3-only:9443", True)
    assert isinstance(s.credentials, StaticProvider) and s.credentials.retrieve().access_key == "AKIAEXTRA"


def test_a_connection_role_is_assumed_with_its_keys_at_the_sts_of_its_service_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sts = stub_sts(monkeypatch, ("ASIAASSUMED", SECRET, "token-1", in_(3600)))
    role = "arn:aws:iam::123456789012:role/trainyard"
    extra = {
        "endpoint_url": "http://minio:9000",  # S3's, not STS's: the provider never sends AssumeRole there
        "region_name": "eu-west-1",
        "role_arn": role,
        "assume_role_kwargs": {"DurationSeconds": 900},
        "service_config": {"sts": {"endpoint_url": "http://sts.internal:8080"}},
    }
    s = settings_for(connection(login="AKIACONN", password="conn-secret", extra=extra))
    assert not sts.calls  # nothing is asked before the first request
    creds = s.credentials.retrieve()
    assert (creds.access_key, creds.secret_key, creds.session_token) == ("ASIAASSUMED", SECRET, "token-1")
    assert sts.calls == [{"RoleArn": role, "RoleSessionName": "Airflow_cold", "DurationSeconds": 900}]
    assert sts.clients == [
        {"endpoint_url": "http://sts.internal:8080", "region": "eu-west-1", "access_key": "AKIACONN"}
    ]
    assert s.endpoint == "minio:9000" and f"role {role} assumed with its keys" in s.source
    assert getattr(s.credentials, "found", None) == "an assumed role"


def test_a_connection_role_without_keys_is_assumed_with_what_the_chain_finds(monkeypatch: pytest.MonkeyPatch) -> None:
    sts = stub_sts(monkeypatch, ("ASIAASSUMED", SECRET, "t", in_(3600)))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAENV")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret")
    extra = {"role_arn": "arn:aws:iam::123456789012:role/r", "assume_role_kwargs": {"RoleSessionName": "mine"}}
    s = settings_for(connection(extra=extra))
    assert s.credentials.retrieve().access_key == "ASIAASSUMED"
    assert sts.calls[0]["RoleSessionName"] == "mine"  # assume_role_kwargs win over the default name
    assert sts.clients[0]["access_key"] == "AKIAENV" and sts.clients[0]["endpoint_url"] is None


def test_an_assume_role_method_other_than_assume_role_is_refused_naming_the_extra() -> None:
    extra = {"role_arn": "arn:aws:iam::1:role/r", "assume_role_method": "assume_role_with_saml"}
    with pytest.raises(SpecError, match=r"connection 'cold': assume_role_method 'assume_role_with_saml'"):
        settings_for(connection(extra=extra))


def test_half_a_login_is_refused_naming_the_connection() -> None:
    with pytest.raises(SpecError, match=r"connection 'cold': has a login but no password"):
        settings_for(connection(login="AKIAEXAMPLE", extra={"endpoint_url": "http://minio:9000"}))


# ---------------------------------------------------------------- the chain (botocore's)


def write_aws_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, credentials: str, config: str = "") -> None:
    (tmp_path / "credentials").write_text(credentials)
    (tmp_path / "config").write_text(config)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))


PROFILES = (
    "[default]\naws_access_key_id = AKIADEFAULT\naws_secret_access_key = x\n\n"
    f"[staging]\naws_access_key_id = AKIASTAGING\naws_secret_access_key = {SECRET}\n"
)


def test_the_chain_takes_the_environment_first_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    write_aws_files(tmp_path, monkeypatch, PROFILES)
    monkeypatch.setenv("AWS_PROFILE", "staging")  # botocore: keys in the environment win over AWS_PROFILE
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAENV")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    chain = credential_chain()
    with caplog.at_level(logging.INFO, logger="trainyard.storage.s3auth"):
        assert chain.retrieve().access_key == "AKIAENV"
    assert chain.found is not None and chain.found.startswith("the environment")
    assert "s3 credentials from the environment" in caplog.text


def test_the_chain_reads_a_named_profile_and_an_explicit_profile_wins_over_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    write_aws_files(tmp_path, monkeypatch, PROFILES)
    monkeypatch.setenv("AWS_PROFILE", "staging")
    assert credential_chain().retrieve().access_key == "AKIASTAGING"
    # A connection's profile_name is botocore's explicit profile: it wins over AWS_PROFILE and the environment.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAENV")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret")
    chain = credential_chain(profile="default")
    assert chain.retrieve().access_key == "AKIADEFAULT" and chain.found == "the shared credentials file"


def test_a_profile_role_is_assumed_with_its_source_profile_and_refreshed_before_it_expires(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    role = "arn:aws:iam::123456789012:role/datasets"
    write_aws_files(
        tmp_path,
        monkeypatch,
        "[base]\naws_access_key_id = AKIABASE\naws_secret_access_key = base-secret\n",
        f"[profile datasets]\nrole_arn = {role}\nsource_profile = base\nrole_session_name = nightly\n",
    )
    monkeypatch.setenv("AWS_PROFILE", "datasets")
    # The first keys expire within botocore's mandatory refresh window (10 min): the next request refreshes.
    sts = stub_sts(monkeypatch, ("ASIAFIRST", "s1", "t1", in_(300)), ("ASIASECOND", "s2", "t2", in_(3600)))
    chain = credential_chain(region="us-east-1")
    assert [chain.retrieve().access_key for _ in range(3)] == ["ASIAFIRST", "ASIASECOND", "ASIASECOND"]
    assert [c["RoleArn"] for c in sts.calls] == [role, role] and sts.calls[0]["RoleSessionName"] == "nightly"
    assert {c["access_key"] for c in sts.clients} == {"AKIABASE"}
    assert chain.found == "an assumed role"


def test_eks_pod_identity_container_credentials_are_fetched_with_the_token_and_refreshed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The container endpoint as EKS Pod Identity sets it up (a full URI and a token file), served on 127.0.0.1."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    answers = [("ASIAPODFIRST", in_(300)), ("ASIAPODSECOND", in_(3600))]
    seen: list[str] = []

    class Agent(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization", ""))
            key, expires = answers.pop(0) if len(answers) > 1 else answers[0]
            body = json.dumps(
                {"AccessKeyId": key, "SecretAccessKey": SECRET, "Token": "t", "Expiration": expires.isoformat()}
            ).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Agent)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        (tmp_path / "eks-pod-identity-token").write_text("pod-identity-token")
        url = f"http://127.0.0.1:{server.server_port}/v1/credentials"
        monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", url)
        monkeypatch.setenv("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", str(tmp_path / "eks-pod-identity-token"))
        chain = credential_chain()
        # The first keys expire within botocore's refresh window: they are fetched again before any request.
        assert [chain.retrieve().access_key for _ in range(3)] == ["ASIAPODSECOND"] * 3
        assert seen == ["pod-identity-token", "pod-identity-token"]  # twice, then kept
        assert chain.found == "container credentials (ECS, EKS Pod Identity)"
    finally:
        server.shutdown()
        server.server_close()


def test_an_sso_profile_with_a_cached_login_gets_role_credentials_from_sso(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """As after ``aws sso login``: the token in ~/.aws/sso/cache, exchanged at the SSO portal (stubbed)."""
    import hashlib
    import json

    import botocore.credentials
    import botocore.session
    from botocore.stub import Stubber

    start = "https://example.awsapps.com/start"
    cache = tmp_path / "home" / ".aws" / "sso" / "cache"
    cache.mkdir(parents=True)
    token = {
        "startUrl": start,
        "region": "eu-west-1",
        "accessToken": "sso-access-token",
        "expiresAt": "2099-01-01T00:00:00Z",
    }
    (cache / f"{hashlib.sha1(start.encode()).hexdigest()}.json").write_text(json.dumps(token))
    config = f"[profile ml]\nsso_start_url = {start}\nsso_region = eu-west-1\nsso_account_id = 123456789012\n"
    write_aws_files(tmp_path, monkeypatch, "", config + "sso_role_name = datasets\n")
    asked: list[dict[str, Any]] = []
    real = botocore.session.Session.create_client

    def create_client(self: Any, service_name: str, *args: Any, **kwargs: Any) -> Any:
        client = real(self, service_name, *args, **kwargs)
        if service_name == "sso":
            stubber = Stubber(client)
            expires = int(in_(3600).timestamp() * 1000)
            answer = {"accessKeyId": "ASIASSO", "secretAccessKey": SECRET, "sessionToken": "t", "expiration": expires}
            stubber.add_response("get_role_credentials", {"roleCredentials": answer})
            client.meta.events.register(
                "provide-client-params.sso.GetRoleCredentials", lambda params, **_: asked.append(dict(params))
            )
            stubber.activate()
        return client

    monkeypatch.setattr(botocore.session.Session, "create_client", create_client)
    # botocore expands ~/.aws/sso/cache once, at import, before this test's HOME.
    monkeypatch.setattr(botocore.credentials.SSOProvider, "_SSO_TOKEN_CACHE_DIR", str(cache))
    chain = credential_chain(profile="ml")
    assert chain.retrieve().access_key == "ASIASSO" and chain.found == "SSO (IAM Identity Center)"
    assert asked == [{"roleName": "datasets", "accountId": "123456789012", "accessToken": "sso-access-token"}]


def test_no_credentials_anywhere_is_one_error_that_lists_the_chain_and_the_fix() -> None:
    chain = credential_chain(profile="ml", context="connection 'cold' has no login")
    with pytest.raises(CredentialsNotFound) as caught:
        chain.retrieve()
    message = str(caught.value)
    assert isinstance(caught.value, SpecError) and "\n" not in message
    assert message.startswith("no S3 credentials found (connection 'cold' has no login; tried profile 'ml' of")
    assert "~/.aws/credentials and ~/.aws/config" in message and "web identity" in message
    assert "EC2 instance metadata: skipped (AWS_EC2_METADATA_DISABLED=true)" in message
    for fix in ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "profile_name", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN"):
        assert fix in message
    with pytest.raises(CredentialsNotFound, match=r"tried the environment \(AWS_ACCESS_KEY_ID"):
        credential_chain().retrieve()


def test_a_profile_that_does_not_exist_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    write_aws_files(tmp_path, monkeypatch, PROFILES)
    with pytest.raises(CredentialsNotFound, match=r"profile \(nowhere\) could not be found"):
        credential_chain(profile="nowhere").retrieve()


def test_an_unreachable_sts_is_transient_and_reported_without_the_web_identity_token(
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
    with pytest.raises(TransientError) as caught:
        credential_chain(region="us-east-1").retrieve()
    message = str(caught.value)
    assert f"http://127.0.0.1:{port}" in message
    assert token not in message and "c2VjcmV0" not in message


def test_an_unreadable_web_identity_token_file_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(tmp_path / "no-token"))
    monkeypatch.setenv("AWS_ROLE_ARN", "arn:aws:iam::123456789012:role/trainyard")
    with pytest.raises(CredentialsNotFound, match=r"No such file or directory: '.*no-token'"):
        credential_chain(region="us-east-1").retrieve()


def test_connection_extras_that_are_not_objects_are_refused_naming_them() -> None:
    extra = {"role_arn": "arn:aws:iam::1:role/r", "assume_role_kwargs": "DurationSeconds=900"}
    with pytest.raises(SpecError, match=r"connection 'cold': extra 'assume_role_kwargs' must be a JSON object"):
        settings_for(connection(extra=extra))


def test_unreachable_instance_metadata_is_named_in_the_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.delenv("AWS_EC2_METADATA_DISABLED")
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(CredentialsNotFound, match=rf"EC2 instance metadata \(http://127\.0\.0\.1:{port}\)"):
        credential_chain().retrieve()


def test_redact_drops_every_query_string() -> None:
    exc = ValueError("http://sts/?Action=X&WebIdentityToken=eyJsecret failed with HTTP status code 403")
    assert redact(exc) == "http://sts/?… failed with HTTP status code 403"


# ---------------------------------------------------------------- secrets stay out of sight


def test_settings_repr_str_errors_and_debug_logs_never_hold_a_secret(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for name in ("botocore", "trainyard", "minio", "urllib3"):
        caplog.set_level(logging.DEBUG, logger=name)
    caplog.set_level(logging.DEBUG)
    assumed = "assumed-secret-never-to-be-seen"
    stub_sts(monkeypatch, ("ASIAASSUMED", assumed, "assumed-token-never-seen", in_(3600)))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAENV")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9000")
    role = {"role_arn": "arn:aws:iam::123456789012:role/r", "endpoint_url": "http://127.0.0.1:9000"}
    shown = [
        S3Settings.from_env(),
        S3Settings.from_endpoint_url("http://127.0.0.1:9000", "AKIA", SECRET, session_token=SECRET),
        settings_for(connection(login="AKIA", password=SECRET, extra={"aws_session_token": SECRET})),
        settings_for(connection(extra={"endpoint_url": "http://127.0.0.1:9000"})),
        settings_for(connection(login="AKIA", password=SECRET, extra=role)),
    ]
    for s in shown:
        s.credentials.retrieve()
    refused = settings_for(connection(extra={"profile_name": "nowhere", "endpoint_url": "http://127.0.0.1:9000"}))
    with pytest.raises(CredentialsNotFound) as caught:
        refused.credentials.retrieve()
    secrets = (SECRET, assumed, "assumed-token-never-seen")
    for s in [*shown, refused]:
        for text in (repr(s), str(s), repr(s.credentials), f"{s}", s.source):
            assert not any(secret in text for secret in secrets)
        assert "127.0.0.1:9000" in repr(s)
    assert not any(secret in text for secret in secrets for text in (str(caught.value), repr(caught.value)))
    assert caplog.records and not any(secret in caplog.text for secret in secrets)
    assert "s3 endpoint 127.0.0.1:9000 (http), credentials from" in caplog.text
