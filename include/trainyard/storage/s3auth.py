"""Where an S3 endpoint is and as whom to reach it: the standard AWS chain, through minio's providers.

Endpoint: an Airflow aws connection's ``endpoint_url`` extra (or its host and
port); else ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, ``TRAINYARD_S3_ENDPOINT``
(an alias kept for old setups); else AWS S3 itself, regional when a region is known.

Credentials: a connection's login and password when it has them; otherwise the
chain every AWS tool walks: the environment (``AWS_ACCESS_KEY_ID`` ...), a
profile of the shared credentials file, then web identity (IRSA), ECS
container credentials or EC2 instance metadata. Nothing here ever logs or
shows a secret: reprs name where credentials come from, never what they are.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import urllib3
from minio.credentials import (
    AWSConfigProvider,
    ChainedProvider,
    Credentials,
    EnvAWSProvider,
    IamAwsProvider,
    Provider,
    StaticProvider,
)

from trainyard.errors import SpecError

log = logging.getLogger(__name__)

ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "TRAINYARD_S3_ENDPOINT")
"""Looked at in this order when no connection names an endpoint (the last one: an alias)."""
REGION_VARS = ("AWS_REGION", "AWS_DEFAULT_REGION")
CHAIN_VARS = (
    *("AWS_ACCESS_KEY_ID", "AWS_ACCESS_KEY", "AWS_SECRET_ACCESS_KEY", "AWS_SECRET_KEY", "AWS_SESSION_TOKEN"),
    *("AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE"),
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
"""Every environment variable that decides the endpoint or the credentials (minio's providers read them too)."""
FIX = (
    "give the connection a login (access key) and password (secret key), or set AWS_ACCESS_KEY_ID and"
    " AWS_SECRET_ACCESS_KEY, or name a profile of the shared credentials file (AWS_PROFILE, or the"
    " connection's profile_name extra; AWS_SHARED_CREDENTIALS_FILE), or AWS_WEB_IDENTITY_TOKEN_FILE"
    " with AWS_ROLE_ARN (IRSA), or run where instance metadata answers"
)


class CredentialsNotFound(SpecError):
    """No link of the chain gave credentials: the message lists each one tried and how to fix it."""


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
        settings = cls(endpoint, credential_chain(env, region=region), secure, region, "the AWS credential chain")
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


def settings_for(connection: Any) -> S3Settings:
    """``S3Settings`` from an Airflow connection object (type aws).

    ``endpoint_url`` (or host and port) and ``region_name`` in it win over the
    environment; a login and password are used as they are (``aws_session_token``
    extra for temporary keys); without a login, the credential chain is walked,
    starting from the ``profile_name`` extra if there is one.
    """
    extra = connection.extra_dejson or {}
    conn_id = connection.conn_id
    region = extra.get("region_name") or region_from(os.environ)
    url = extra.get("endpoint_url") or _host_url(connection.host, connection.port)
    where = f"connection {conn_id!r}: endpoint_url"
    endpoint, secure = parse_endpoint(url, where) if url else endpoint_from(os.environ, region)
    if connection.login or connection.password:
        if not (connection.login and connection.password):
            raise SpecError(
                [
                    f"connection {conn_id!r}: has a login but no password (or a password but no login);"
                    " set both, or neither to use the AWS credential chain"
                ]
            )
        provider: Provider = StaticProvider(connection.login, connection.password, extra.get("aws_session_token"))
        source = f"connection {conn_id!r} (its login)"
    else:
        provider = credential_chain(
            os.environ,
            region=region,
            profile=extra.get("profile_name"),
            context=f"connection {conn_id!r} has no login",
        )
        source = f"the AWS credential chain (connection {conn_id!r} has no login)"
    settings = S3Settings(endpoint, provider, secure, region, source)
    log.info("s3 endpoint %s (%s), credentials from %s", endpoint, "https" if secure else "http", source)
    return settings


def _host_url(host: str | None, port: int | None) -> str | None:
    if not host:
        return None
    base = host if "://" in host else f"http://{host}"
    return f"{base}:{port}" if port else base


def credential_chain(
    env: Mapping[str, str], *, region: str | None = None, profile: str | None = None, context: str = ""
) -> CredentialChain:
    """minio's providers in the AWS order; ``env`` decides which apply and how they are described.

    The providers read ``os.environ`` themselves (they always do), so pass ``os.environ``.
    """
    skipped: list[str] = []
    links: list[tuple[str, Provider]] = [
        ("the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)", EnvAWSProvider())
    ]
    config = AWSConfigProvider(profile=profile or None)
    profile_name = profile or env.get("AWS_PROFILE") or "default"
    credentials_file = env.get("AWS_SHARED_CREDENTIALS_FILE") or "~/.aws/credentials"
    links.append((f"profile {profile_name!r} of {credentials_file}", config))
    # Off EC2 the metadata address never answers and a user waits for the error: one short try, as the
    # AWS SDKs do. STS is a real service across a network: longer, and retried on its 5xx answers.
    local = urllib3.PoolManager(timeout=urllib3.Timeout(connect=1, read=2), retries=urllib3.Retry(total=1))
    remote = urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=10, read=30),
        retries=urllib3.Retry(total=2, backoff_factor=0.2, status_forcelist=[500, 502, 503, 504]),
    )
    if env.get("AWS_WEB_IDENTITY_TOKEN_FILE"):
        sts = env.get("AWS_ENDPOINT_URL_STS")
        what = (
            f"web identity (AWS_WEB_IDENTITY_TOKEN_FILE {env['AWS_WEB_IDENTITY_TOKEN_FILE']},"
            f" role {env.get('AWS_ROLE_ARN') or '(AWS_ROLE_ARN not set)'}, STS {sts or 'of AWS'})"
        )
        links.append((what, IamAwsProvider(custom_endpoint=sts, http_client=remote, region=region)))
    elif env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI") or env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        links.append(("ECS container credentials", IamAwsProvider(http_client=local, region=region)))
    elif env.get("AWS_EC2_METADATA_DISABLED", "").lower() == "true":
        skipped.append("EC2 instance metadata: skipped (AWS_EC2_METADATA_DISABLED=true)")
    else:
        imds = env.get("AWS_EC2_METADATA_SERVICE_ENDPOINT")
        links.append(
            (
                f"EC2 instance metadata ({imds or 'http://169.254.169.254'})",
                IamAwsProvider(custom_endpoint=imds, http_client=local, region=region),
            )
        )
    return CredentialChain(links, context, skipped)


class CredentialChain(ChainedProvider):
    """minio's chain that says, when no link answers, what each one said and how to fix it.

    minio's own ``ChainedProvider`` only skips a link on ``ValueError``; an
    unreachable metadata address raises a urllib3 error and its message says
    nothing of the other links. Thread-safe: a tier's transfers share one chain.
    """

    def __init__(self, links: list[tuple[str, Provider]], context: str = "", skipped: list[str] | None = None):
        super().__init__([p for _, p in links])
        self._links = links
        self._context = context
        self._skipped = skipped or []
        self._lock = threading.Lock()
        self.found: str | None = None
        """The link that answered last (its description), for logs."""

    def __repr__(self) -> str:
        return f"CredentialChain({[name for name, _ in self._links]!r})"

    def retrieve(self) -> Credentials:
        with self._lock:
            if self._credentials and not self._credentials.is_expired():
                return self._credentials
            # The link that answered before goes first: its keys expired, it refreshes them.
            order = sorted(self._links, key=lambda link: link[0] != self.found)
            tried: list[str] = []
            for name, provider in order:
                try:
                    credentials = provider.retrieve()
                except (ValueError, OSError, KeyError, TypeError, urllib3.exceptions.HTTPError) as exc:
                    tried.append(f"{name}: {redact(exc)}")
                    continue
                if self.found != name:
                    log.info("s3 credentials from %s", name)
                self._credentials, self.found = credentials, name
                return credentials
            context = f"{self._context}; " if self._context else ""
            said = "; ".join(tried + self._skipped)
            raise CredentialsNotFound([f"no S3 credentials found ({context}tried {said}). To fix: {FIX}"])


def redact(exc: BaseException) -> str:
    """One line of an exception, with every URL's query dropped (a web identity token travels in one)."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return re.sub(r"\?[^\s)'\"]*", "?…", text)[:300]
