"""An S3 server over HTTP on 127.0.0.1 (moto's), reached with the real ``minio`` client."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from minio import Minio
from moto.server import ThreadedMotoServer

from trainyard.storage.s3 import S3Settings

logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise


@dataclass
class S3Server:
    server: ThreadedMotoServer
    port: int

    @property
    def settings(self) -> S3Settings:
        return S3Settings.from_endpoint_url(f"http://127.0.0.1:{self.port}", "testing-key", "testing-secret", "us-east-1")

    def client(self) -> Minio:
        s = self.settings
        return Minio(s.endpoint, s.access_key, s.secret_key, secure=False, region=s.region)

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
