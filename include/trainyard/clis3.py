"""What ``trainyard upload`` and ``trainyard ls`` share: the tier they open (from the environment, ``--endpoint-url``
or an Airflow connection) and the exit code of each way S3 can fail.

A bad argument (a malformed URI or endpoint, a bucket that does not exist) is the user's to fix: exit 2. S3,
credentials and the network are infrastructure: exit 3. Neither ever shows a traceback or a secret.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from trainyard.errors import InfrastructureError, SpecError, TrainyardError, UsageError

if TYPE_CHECKING:
    from trainyard.storage.s3 import S3Tier
    from trainyard.storage.s3auth import S3Settings


def add_s3_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--jobs", type=int, default=8, help="objects at once (default 8)")
    parser.add_argument(
        "--endpoint-url",
        help="the S3 API, e.g. http://127.0.0.1:9000 (default: the connection's, else AWS_ENDPOINT_URL_S3,"
        " AWS_ENDPOINT_URL, else AWS)",
    )
    parser.add_argument(
        "--connection",
        metavar="ID",
        help="an Airflow connection (type aws) for the endpoint and credentials, resolved as a spec's"
        " dataset.connection is (default: the environment and the AWS credential chain)",
    )


def s3_tier(args: argparse.Namespace) -> S3Tier:
    """The tier of ``args.dest``, its credentials asked for now (a missing key is one line before any transfer)."""
    from trainyard.storage.s3 import S3Tier
    from trainyard.storage.s3auth import parse_endpoint
    from trainyard.storage.upload import split_s3_uri

    try:
        split_s3_uri(args.dest)
        if args.endpoint_url:
            parse_endpoint(args.endpoint_url, "--endpoint-url")
    except SpecError as exc:
        raise UsageError(str(exc)) from None
    if args.jobs < 1:
        raise UsageError(f"--jobs {args.jobs}: must be at least 1")
    settings = _settings(args)
    settings.credentials.retrieve()
    tier = S3Tier(args.dest, settings)
    if not tier.client.bucket_exists(tier.bucket):
        raise UsageError(f"{args.dest}: bucket {tier.bucket!r} does not exist at {settings.endpoint}; create it first")
    return tier


def _settings(args: argparse.Namespace) -> S3Settings:
    import dataclasses

    from trainyard.storage.s3auth import S3Settings, parse_endpoint, settings_for

    if not args.connection:
        return S3Settings.from_env(args.endpoint_url)
    settings = settings_for(_connection(args.connection))
    if args.endpoint_url:  # the flag wins over the connection's endpoint, as it does over the environment's
        endpoint, secure = parse_endpoint(args.endpoint_url, "--endpoint-url")
        settings = dataclasses.replace(settings, endpoint=endpoint, secure=secure)
    return settings


def _connection(conn_id: str) -> object:
    """The Airflow connection ``conn_id`` (environment, secrets backends, metadata DB), as a task reads it."""
    from airflow.sdk import Connection
    from airflow.sdk.exceptions import AirflowNotFoundException

    from trainyard.storage.s3auth import missing_connection

    _logs_to_stderr()
    try:
        return Connection.get(conn_id)
    except AirflowNotFoundException:
        raise UsageError(f"--connection: {missing_connection(conn_id)}") from None


def _logs_to_stderr() -> None:
    """Importing Airflow points the root logger at stdout, at INFO; stdout is the command's report (``-o json``),
    and a command's stderr is its one-line error, not a task log: warnings and errors only, on stderr (as before
    Airflow was imported; ``TRAINYARD_DEBUG=1`` keeps the info lines)."""
    if not os.environ.get("TRAINYARD_DEBUG"):
        logging.getLogger().setLevel(logging.WARNING)

    loggers = [
        logging.getLogger(),
        *(v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger)),
    ]
    for handler in (h for logger in loggers for h in logger.handlers):
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(_Stderr())


class _Stderr:
    """Whatever ``sys.stderr`` is when a record is written, not the object it was when the handler was moved: a
    process that swaps stderr later (a test's capture, a daemon redirecting it) keeps getting the log lines."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def s3_errors(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """An S3 command's failures as typed errors (one line, exit 2 or 3 by ``clikit.exit_code``); never a secret."""

    @functools.wraps(fn)
    def wrapped(args: argparse.Namespace) -> int:
        import urllib3
        from minio.error import MinioException

        from trainyard.storage.s3auth import CredentialsNotFound, redact

        try:
            return fn(args)
        except (UsageError, InfrastructureError, CredentialsNotFound, BrokenPipeError):
            raise  # already typed; a reader of stdout that left is no S3 failure
        except TrainyardError as exc:  # a connection's or the environment's settings: not the command line's
            raise InfrastructureError(str(exc)) from None
        except (MinioException, urllib3.exceptions.HTTPError, OSError) as exc:
            raise InfrastructureError(f"{args.dest}: {type(exc).__name__}: {redact(exc)}") from None
        except ValueError as exc:  # minio's own checks of the arguments (a bucket name S3 does not allow)
            raise UsageError(f"{args.dest}: {redact(exc)}") from None

    return wrapped
