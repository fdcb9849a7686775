"""Servers the integration tests share: a real S3 server (SeaweedFS, ``tools.seaweed``) over HTTP on
127.0.0.1, reached with the real ``minio`` client; moto's S3 for the few tests that need what a real
server will not do (``moto_server``); and a PostgreSQL cluster for the metadata DBs of Airflow
deployments. ``TRAINYARD_TEST_S3=rgw`` (``make test-rgw``) puts Ceph RGW (``tools.rgw``) behind ``s3_server``
instead: a second S3 implementation, one that keeps no flexible checksums."""

from __future__ import annotations

import logging
import os
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

from tools import localpg, rgw, seaweed
from trainyard.storage.s3auth import S3Settings

logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise


class _Endpoint:
    """What the tests use of either server: its URL, trainyard's settings for it and a minio client."""

    port: int
    access_key: str
    secret_key: str
    keeps_checksums = True
    """Whether it stores and returns flexible checksums (``x-amz-checksum-*``); Ceph RGW Pacific does not."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def settings(self) -> S3Settings:
        return S3Settings.from_endpoint_url(self.url, self.access_key, self.secret_key, "us-east-1")

    def client(self) -> Minio:
        return Minio(f"127.0.0.1:{self.port}", self.access_key, self.secret_key, secure=False, region="us-east-1")


@dataclass
class S3Server(_Endpoint):
    """The session's real S3 server, SeaweedFS (or Ceph RGW): it checks every signature against its one identity
    (these keys); ``stop()`` and ``start()`` act on its S3 gateway, on the same ports, and keep its buckets."""

    server: seaweed.Seaweed | rgw.Rgw

    @property
    def keeps_checksums(self) -> bool:  # type: ignore[override]
        return not isinstance(self.server, rgw.Rgw)  # RGW Pacific keeps no flexible checksums

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def access_key(self) -> str:
        return self.server.access_key

    @property
    def secret_key(self) -> str:
        return self.server.secret_key

    def stop(self) -> None:
        self.server.stop()

    def start(self) -> None:
        self.server.start()


ON_RGW = os.environ.get("TRAINYARD_TEST_S3", "seaweed") == "rgw"


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """SeaweedFS (or Ceph RGW, ``TRAINYARD_TEST_S3=rgw``) for the session, one per xdist worker, deleted after."""
    if ON_RGW:
        cluster = rgw.start()
        try:
            yield S3Server(cluster)
        finally:
            cluster.discard()
        return
    server = seaweed.start()
    try:
        yield S3Server(server)
    finally:
        server.discard()


@dataclass
class MotoServer(_Endpoint):
    """moto's S3, for what a real server will not do: accept any signature (so a test records which key
    the credential chain chose, with temporary keys from moto's STS or instance metadata that no real
    server knows), or keep a checksum that does not match the bytes (a real server refuses the PUT)."""

    server: ThreadedMotoServer
    port: int
    access_key: str = "testing-key"
    secret_key: str = "testing-secret"


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    yield MotoServer(server, server._server.server_address[1])
    server.stop()


def _bucket_for(server: _Endpoint, request: pytest.FixtureRequest) -> str:
    """A bucket on ``server`` named after the test (made if missing)."""
    name = "t-" + re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower())[:40].strip("-")
    client = server.client()
    if not client.bucket_exists(name):
        client.make_bucket(name)
    return name


@pytest.fixture
def bucket(s3_server: S3Server, request: pytest.FixtureRequest) -> str:
    """A fresh bucket per test, named after it."""
    return _bucket_for(s3_server, request)


@pytest.fixture
def moto_bucket(moto_server: MotoServer, request: pytest.FixtureRequest) -> str:
    """A fresh bucket per test in moto's S3."""
    return _bucket_for(moto_server, request)


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
