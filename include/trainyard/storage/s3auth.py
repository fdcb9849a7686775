"""Where an S3 endpoint is and as whom to reach it: botocore's credential chain, handed to minio.

Endpoint: an Airflow aws connection's ``service_config.s3.endpoint_url`` or
``endpoint_url`` extra (or its host and port); else ``AWS_ENDPOINT_URL_S3``,
``AWS_ENDPOINT_URL``, ``TRAINYARD_S3_ENDPOINT`` (an alias kept for old setups);
else AWS S3 itself, regional when a region is known.

Credentials, first answer wins:

1. a connection's login and password (else its ``aws_access_key_id`` /
   ``aws_secret_access_key`` extras), with its ``aws_session_token`` extra;
2. else botocore's chain, exactly as the AWS CLI walks it: the environment
   (``AWS_ACCESS_KEY_ID`` ...; skipped when a connection names a
   ``profile_name``, as botocore skips it for an explicit profile), a profile's
   ``role_arn`` (assumed with its ``source_profile`` or ``credential_source``),
   web identity (IRSA), SSO, the shared credentials and config files
   (``AWS_PROFILE``, ``AWS_SHARED_CREDENTIALS_FILE``, ``AWS_CONFIG_FILE``), a
   ``credential_process``, container credentials (ECS, EKS Pod Identity), EC2
   instance metadata;
3. a connection's ``role_arn`` extra is then assumed at STS with what 1 or 2
   gave (``assume_role_kwargs`` passed on; its STS endpoint only from
   ``service_config.sts.endpoint_url``, as the Amazon provider does).

botocore refreshes what expires (assumed roles, web identity, containers,
instance metadata, SSO); minio asks ``retrieve`` at each request, which hands
over botocore's current keys. Nothing here logs or shows a secret: reprs name
where credentials come from, and botocore's wire dumps (request parameters,
STS response bodies, canonical requests), which carry keys at DEBUG, are
dropped from the logs.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import botocore.exceptions
import botocore.session
from botocore.config import Config
from botocore.credentials import AssumeRoleCredentialFetcher, DeferredRefreshableCredentials
from botocore.credentials import Credentials as BotocoreCredentials
from minio.credentials import Credentials, Provider, StaticProvider

from trainyard.errors import SpecError, TransientError

log = logging.getLogger(__name__)

ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "TRAINYARD_S3_ENDPOINT")
"""Looked at in this order when no connection names an endpoint (the last one: an alias)."""
REGION_VARS = ("AWS_REGION", "AWS_DEFAULT_REGION")
CHAIN_VARS = (
    *("AWS_ACCESS_KEY_ID", "AWS_ACCESS_KEY", "AWS_SECRET_ACCESS_KEY", "AWS_SECRET_KEY", "AWS_SESSION_TOKEN"),
    *("AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"),
    *("AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN", "AWS_ROLE_SESSION_NAME", "AWS_ENDPOINT_URL_STS"),
    *("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI"),
    *(
        "AWS_CONTAINER_AUTHORIZATION_TOKEN",
        "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
        "AWS_EC2_METADATA_SERVICE_ENDPOINT",
    ),
    *ENDPOINT_VARS,
    *REGION_VARS,
)
"""Every environment variable that decides the endpoint or the credentials (botocore reads them itself)."""
FIX = (
    "give the connection a login (access key) and password (secret key), or set AWS_ACCESS_KEY_ID and"
    " AWS_SECRET_ACCESS_KEY, or name a profile of the shared credentials or config file (AWS_PROFILE, or the"
    " connection's profile_name extra; AWS_SHARED_CREDENTIALS_FILE, AWS_CONFIG_FILE), or"
    " AWS_WEB_IDENTITY_TOKEN_FILE with AWS_ROLE_ARN (IRSA), or run where container credentials or"
    " instance metadata answer"
)
METHODS = {
    "env": "the environment (AWS_ACCESS_KEY_ID)",
    "shared-credentials-file": "the shared credentials file",
    "config-file": "the shared config file",
    "assume-role": "an assumed role",
    "assume-role-with-web-identity": "web identity (AWS_WEB_IDENTITY_TOKEN_FILE)",
    "sso": "SSO (IAM Identity Center)",
    "custom-process": "a credential_process",
    "container-role": "container credentials (ECS, EKS Pod Identity)",
    "iam-role": "EC2 instance metadata",
}
"""botocore's ``Credentials.method`` in words, for the log line that says where keys came from."""
# STS and SSO are services across a network: retried on their 5xx and throttling, each try bounded.
STS_CONFIG = Config(connect_timeout=10, read_timeout=30, retries={"mode": "standard", "max_attempts": 3})


class CredentialsNotFound(SpecError):
    """No link of the chain gave credentials, or they were refused: the message says what and how to fix it."""


@dataclass(frozen=True)
class S3Settings:
    """Where and as whom to reach the object store. ``credentials`` never shows in a repr."""

    endpoint: str
    """``host:port`` of the S3 API."""
    credentials: Provider = field(repr=False, compare=False)
    """A minio credentials provider; asked for (and refreshing) keys at each request."""
    secure: bool = True
    region: str | None = None
    source: str = ""
    """Where the credentials come from, in words (a connection, the chain): for logs and errors."""

    @classmethod
    def from_endpoint_url(
        cls,
        url: str,
        access_key: str,
        secret_key: str,
        region: str | None = None,
        session_token: str | None = None,
    ) -> S3Settings:
        """Fixed keys for an endpoint URL (tests, benches, a connection with a login)."""
        endpoint, secure = parse_endpoint(url, "endpoint_url")
        return cls(endpoint, StaticProvider(access_key, secret_key, session_token), secure, region, "static keys")

    @classmethod
    def from_env(cls, endpoint_url: str | None = None) -> S3Settings:
        """Outside Airflow: the endpoint from ``endpoint_url`` or the environment, credentials from the chain."""
        env = os.environ
        region = region_from(env)
        endpoint, secure = (
            parse_endpoint(endpoint_url, "--endpoint-url") if endpoint_url else endpoint_from(env, region)
        )
        settings = cls(endpoint, credential_chain(region=region), secure, region, "the AWS credential chain")
        log.info("s3 endpoint %s (%s), credentials from %s", endpoint, "https" if secure else "http", settings.source)
        return settings


def parse_endpoint(url: str, where: str) -> tuple[str, bool]:
    """(``host:port``, https?) of an endpoint URL; ``where`` names the setting it came from."""
    parsed = urlparse(url if "://" in url else f"https://{url}")
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise SpecError([f"{where}: {url!r} is not an endpoint URL (expected e.g. http://127.0.0.1:9000)"])
    if parsed.path.strip("/") or parsed.query:
        # minio addresses buckets itself; a path here would silently be dropped.
        raise SpecError([f"{where}: {url!r} has a path; give only scheme, host and port (e.g. https://s3.example.com)"])
    port = f":{parsed.port}" if parsed.port else ""
    return f"{parsed.hostname}{port}", parsed.scheme == "https"


def region_from(env: Mapping[str, str]) -> str | None:
    return next((env[n] for n in REGION_VARS if env.get(n)), None)


def endpoint_from(env: Mapping[str, str], region: str | None) -> tuple[str, bool]:
    """The first endpoint variable set, else AWS S3 itself (regional when the region is known)."""
    for name in ENDPOINT_VARS:
        if env.get(name):
            return parse_endpoint(env[name], name)
    if not region:
        return "s3.amazonaws.com", True
    return f"s3.{region}.amazonaws.com{'.cn' if region.startswith('cn-') else ''}", True


def missing_connection(conn_id: str) -> str:
    """What to do about a connection id that Airflow does not know (a task's spec, the CLI's ``--connection``)."""
    return (
        f"connection {conn_id!r} is not defined: add it (type aws) in the Airflow UI, airflow_settings.yaml"
        f" or AIRFLOW_CONN_{conn_id.upper()}; with no login it uses the AWS credential chain"
    )


def settings_for(connection: Any) -> S3Settings:
    """``S3Settings`` from an Airflow connection object (type aws), its extras read as the Amazon provider does.

    ``endpoint_url`` (``service_config.s3.endpoint_url`` first; else host and
    port) and ``region_name`` win over the environment; keys (login and
    password, else the ``aws_access_key_id`` / ``aws_secret_access_key``
    extras; ``aws_session_token``) are used as they are; without them,
    botocore's chain from the ``profile_name`` extra if there is one. A
    ``role_arn`` extra is assumed with those (``assume_role_kwargs``, STS at
    ``service_config.sts.endpoint_url``).
    """
    extra = connection.extra_dejson or {}
    conn_id = connection.conn_id
    services = _mapping(extra, "service_config", conn_id)
    region = extra.get("region_name") or region_from(os.environ)
    url = (services.get("s3") or {}).get("endpoint_url") or extra.get("endpoint_url")
    url = url or _host_url(connection.host, connection.port)
    where = f"connection {conn_id!r}: endpoint_url"
    endpoint, secure = parse_endpoint(url, where) if url else endpoint_from(os.environ, region)
    keys = _connection_keys(connection, extra)
    profile = extra.get("profile_name")
    role_arn = extra.get("role_arn")
    if role_arn:
        method = extra.get("assume_role_method") or "assume_role"
        if method != "assume_role":
            raise SpecError(
                [f"connection {conn_id!r}: assume_role_method {method!r} is not supported; leave it out (assume_role)"]
            )
        by = "its keys" if keys else "the AWS credential chain"
        provider: Provider = assumed_role(
            role_arn,
            keys=keys,
            profile=profile,
            region=region,
            sts_endpoint=(services.get("sts") or {}).get("endpoint_url"),
            extra_args={"RoleSessionName": _session_name(conn_id), **_mapping(extra, "assume_role_kwargs", conn_id)},
            context=f"connection {conn_id!r}",
        )
        source = f"role {role_arn} assumed with {by} (connection {conn_id!r})"
    elif keys:
        provider = StaticProvider(*keys)
        source = f"connection {conn_id!r} (its keys)"
    else:
        provider = credential_chain(region=region, profile=profile, context=f"connection {conn_id!r} has no login")
        source = f"the AWS credential chain (connection {conn_id!r} has no login)"
    settings = S3Settings(endpoint, provider, secure, region, source)
    log.info("s3 endpoint %s (%s), credentials from %s", endpoint, "https" if secure else "http", source)
    return settings


def _connection_keys(connection: Any, extra: Mapping[str, Any]) -> tuple[str, str, str | None] | None:
    """(access key, secret key, session token) a connection carries, or None to use the chain."""
    login, password = connection.login, connection.password
    if login or password:
        if not (login and password):
            raise SpecError(
                [
                    f"connection {connection.conn_id!r}: has a login but no password (or a password but no login);"
                    " set both, or neither to use the AWS credential chain"
                ]
            )
    else:
        login, password = extra.get("aws_access_key_id"), extra.get("aws_secret_access_key")
    return (login, password, extra.get("aws_session_token")) if login and password else None


def _mapping(extra: Mapping[str, Any], key: str, conn_id: str) -> Mapping[str, Any]:
    value = extra.get(key) or {}
    if not isinstance(value, Mapping):
        raise SpecError([f"connection {conn_id!r}: extra {key!r} must be a JSON object, not {type(value).__name__}"])
    return value


def _session_name(conn_id: str) -> str:
    """The Amazon provider's default RoleSessionName, cut to what STS accepts."""
    return re.sub(r"[^\w+=,.@-]", "", f"Airflow_{conn_id}")[:64]


def _host_url(host: str | None, port: int | None) -> str | None:
    if not host:
        return None
    base = host if "://" in host else f"http://{host}"
    return f"{base}:{port}" if port else base


def _session(profile: str | None, region: str | None) -> botocore.session.Session:
    session = botocore.session.Session(profile=profile or None)
    if region:
        session.set_config_variable("region", region)
    session.set_default_client_config(STS_CONFIG)
    return session


def credential_chain(*, region: str | None = None, profile: str | None = None, context: str = "") -> ChainProvider:
    """botocore's chain (``profile``: an explicit profile, which skips the environment, as botocore does)."""
    return ChainProvider(lambda: _session(profile, region).get_credentials(), _chain_words(profile), context)


def assumed_role(
    role_arn: str,
    *,
    keys: tuple[str, str, str | None] | None = None,
    profile: str | None = None,
    region: str | None = None,
    sts_endpoint: str | None = None,
    extra_args: Mapping[str, Any] | None = None,
    context: str = "",
) -> ChainProvider:
    """``role_arn`` assumed at STS with ``keys``, else with what botocore's chain finds; refreshed before it expires."""

    def resolve() -> BotocoreCredentials | None:
        session = _session(profile, region)
        source = BotocoreCredentials(*keys) if keys else session.get_credentials()
        if source is None:
            return None

        def sts(service: str, **kwargs: Any) -> Any:
            return session.create_client(service, endpoint_url=sts_endpoint, **kwargs)

        fetcher = AssumeRoleCredentialFetcher(sts, source, role_arn, extra_args=dict(extra_args or {}))
        return DeferredRefreshableCredentials(fetcher.fetch_credentials, "assume-role")

    by = "the connection's keys" if keys else _chain_words(profile)
    sts_words = sts_endpoint or "(AWS_ENDPOINT_URL_STS, else AWS's)"
    return ChainProvider(resolve, f"role {role_arn} assumed at STS {sts_words} with {by}", context)


def _chain_words(profile: str | None) -> str:
    """botocore's chain, in words, for errors: what it looks at here."""
    env = os.environ
    name = profile or env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default"
    files = (
        env.get("AWS_SHARED_CREDENTIALS_FILE") or "~/.aws/credentials",
        env.get("AWS_CONFIG_FILE") or "~/.aws/config",
    )
    imds = env.get("AWS_EC2_METADATA_SERVICE_ENDPOINT") or "http://169.254.169.254"
    if env.get("AWS_EC2_METADATA_DISABLED", "").lower() == "true":
        imds_words = "EC2 instance metadata: skipped (AWS_EC2_METADATA_DISABLED=true)"
    else:
        imds_words = f"EC2 instance metadata ({imds})"
    return ", ".join(
        [
            *(["the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)"] if not profile else []),
            f"profile {name!r} of {files[0]} and {files[1]} (keys, role_arn, SSO, credential_process)",
            # An explicit profile makes botocore read web identity from the profile alone, not the environment.
            "web identity (its web_identity_token_file)" if profile else "web identity (AWS_WEB_IDENTITY_TOKEN_FILE)",
            "container credentials (AWS_CONTAINER_CREDENTIALS_*)",
            imds_words,
        ]
    )


class ChainProvider(Provider):
    """minio's provider over botocore's credentials: found at the first request, then asked at each one.

    ``retrieve`` returns botocore's current (frozen) keys every time, so
    refreshing credentials refresh; botocore's refresh is thread-safe and a
    tier's transfers share one provider. Errors are one line, without secrets.
    """

    def __init__(self, resolve: Callable[[], BotocoreCredentials | None], what: str, context: str = "") -> None:
        self._resolve = resolve
        self._what = what
        self._context = context
        self._lock = threading.Lock()
        self._credentials: BotocoreCredentials | None = None
        self.found: str | None = None
        """Where the keys came from (botocore's method, in words), once found: for logs and tests."""

    def __repr__(self) -> str:
        return f"ChainProvider({self._what!r})"

    def retrieve(self) -> Credentials:
        try:
            frozen = self._botocore().get_frozen_credentials()
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, OSError) as exc:
            # OSError: a web identity or container token file that cannot be read.
            if _transient(exc):
                raise TransientError(f"s3 credentials from {self._what}: {redact(exc)}") from None
            raise self._error(redact(exc)) from None
        return Credentials(frozen.access_key, frozen.secret_key, frozen.token or None)

    def _botocore(self) -> BotocoreCredentials:
        with self._lock:
            if self._credentials is None:
                credentials = self._resolve()
                if credentials is None:
                    raise self._error("none answered")
                self._credentials = credentials
                self.found = METHODS.get(credentials.method, credentials.method)
                log.info("s3 credentials from %s", self.found)
            return self._credentials

    def _error(self, said: str) -> CredentialsNotFound:
        context = f"{self._context}; " if self._context else ""
        return CredentialsNotFound([f"no S3 credentials found ({context}tried {self._what}: {said}). To fix: {FIX}"])


def _transient(exc: Exception) -> bool:
    """An STS (or SSO, container, metadata) service that did not answer, or answered 5xx or throttled: retry later."""
    if isinstance(exc, botocore.exceptions.ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return status >= 500 or exc.response.get("Error", {}).get("Code") in ("Throttling", "ThrottlingException")
    return isinstance(exc, (botocore.exceptions.HTTPClientError, botocore.exceptions.ConnectionError)) and not (
        isinstance(exc, botocore.exceptions.SSLError)  # a certificate is fixed, not waited out
    )


def redact(exc: BaseException) -> str:
    """One line of an exception, with every URL's query dropped (a web identity token travels in one)."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return re.sub(r"\?[^\s)'\"]*", "?…", text)[:300]


class _NoWireDumps(logging.Filter):
    """Drops botocore's DEBUG dumps of requests and responses: STS answers carry secret keys and tokens."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.DEBUG


for _name in ("botocore.parsers", "botocore.endpoint", "botocore.auth"):
    logging.getLogger(_name).addFilter(_NoWireDumps())
