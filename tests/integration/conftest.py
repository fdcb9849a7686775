"""Servers the integration tests share: an S3 server over HTTP on 127.0.0.1 (moto's), reached with
the real ``minio`` client, and a PostgreSQL cluster for the metadata DBs of Airflow deployments."""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from airflow_helpers import sqlite_service_settings
from minio import Minio
from moto.server import ThreadedMotoServer

from tools import localpg
from trainyard.storage.s3auth import S3Settings

logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise


@dataclass
class S3Server:
    server: ThreadedMotoServer
    port: int
    access_key: str = "testing-key"
    secret_key: str = "testing-secret"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def settings(self) -> S3Settings:
        return S3Settings.from_endpoint_url(self.url, self.access_key, self.secret_key, "us-east-1")

    def client(self) -> Minio:
        s = self.settings
        return Minio(s.endpoint, self.access_key, self.secret_key, secure=False, region=s.region)

    def stop(self) -> None:
        self.server.stop()

    def start(self) -> None:
        """Start again on the same port; moto keeps its buckets in this process."""
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    s3 = S3Server(server, server._server.server_address[1])
    yield s3
    s3.server.stop()


@pytest.fixture
def bucket(s3_server: S3Server, request: pytest.FixtureRequest) -> str:
    """A fresh bucket per test, named after it."""
    name = "t-" + request.node.name.lower().replace("_", "-")[:40].strip("-")
    client = s3_server.client()
    if not client.bucket_exists(name):
        client.make_bucket(name)
    return name


@dataclass
class Postgres:
    """The session's PostgreSQL cluster (``folder``), or why there is none (``unavailable``)."""

    folder: Path | None
    unavailable: str = ""


@pytest.fixture(scope="session")
def postgres() -> Iterator[Postgres]:
    """A throwaway PostgreSQL cluster on 127.0.0.1 for the session, stopped and deleted after.

    Its folder is a new one right under the temp dir, not pytest's: as root the server runs as
    another user, who cannot enter pytest's root-only folders.
    """
    folder = Path(tempfile.mkdtemp(prefix="trainyard-pg-"))
    try:
        localpg.start(folder, fast=True)
    except localpg.PostgresUnavailable as exc:
        _discard(folder)
        yield Postgres(None, str(exc))
        return
    try:
        yield Postgres(folder)
    finally:
        _discard(folder)


def _discard(folder: Path) -> None:
    try:
        localpg.stop(folder)
    except localpg.PostgresUnavailable:  # never made, or not installed: nothing runs
        pass
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def metadata_db(postgres: Postgres, request: pytest.FixtureRequest) -> dict[str, str]:
    """``AIRFLOW__DATABASE__*`` settings of a new, empty metadata DB for one Airflow deployment:
    a database of its own in the session's PostgreSQL, as in production; where PostgreSQL is
    unavailable, SQLite in the deployment's AIRFLOW_HOME, with a warning that says why."""
    if postgres.folder is None:
        warnings.warn(
            f"PostgreSQL unavailable, {request.node.name} runs Airflow on SQLite: {postgres.unavailable}", stacklevel=1
        )
        return sqlite_service_settings()
    name = "t_" + re.sub(r"[^a-z0-9]+", "_", request.node.name.lower())[:40].strip("_")
    return {"AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": localpg.create_database(postgres.folder, name)}
