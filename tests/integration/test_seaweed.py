"""``tools.seaweed``: the suite's S3 server listens on 127.0.0.1 only and leaves nothing behind."""

from __future__ import annotations

import io
import os
import signal
from pathlib import Path

import psutil
import pytest
from minio import Minio
from minio.error import S3Error

from tools import seaweed

pytestmark = pytest.mark.integration


def listening(pid: int) -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("inet") if c.status == "LISTEN"}


def leftovers(server: seaweed.Seaweed) -> list[Path]:
    ours = {f"-{port + seaweed.GRPC_OFFSET}.sock" for port in server.ports.values()}
    return [p for p in Path("/tmp").glob("seaweedfs-*.sock") if any(p.name.endswith(end) for end in ours)]


def test_two_servers_on_free_ports_of_127_0_0_1_only_then_nothing_is_left() -> None:
    first, second = seaweed.start(), seaweed.start()  # as two test workers do
    try:
        pids = [s.process.pid for s in (first, second) if s.process]
        for server, pid in zip((first, second), pids, strict=True):
            bound = listening(pid)
            assert {ip for ip, _ in bound} == {"127.0.0.1"}, bound  # nothing on 0.0.0.0 or another address
            wanted = {p for port in server.ports.values() for p in (port, port + seaweed.GRPC_OFFSET)}
            # Only ports chosen for it (its admin may still be starting: it comes up after S3 answers).
            assert server.port in {port for _, port in bound} <= wanted
            assert leftovers(server)  # its gRPC sockets, while it runs
        assert not set(first.ports.values()) & set(second.ports.values())

        client = Minio(f"127.0.0.1:{first.port}", first.access_key, first.secret_key, secure=False)
        client.make_bucket("kept")
        client.put_object("kept", "a", io.BytesIO(b"abc"), 3)
        with pytest.raises(S3Error, match="SignatureDoesNotMatch|AccessDenied|InvalidAccessKeyId"):
            Minio(f"127.0.0.1:{first.port}", first.access_key, "wrong", secure=False).list_buckets()
        first.stop()
        first.start()  # same ports, same folder: what it stored is still there
        assert client.get_object("kept", "a").read() == b"abc"
    finally:
        folders = [first.folder, second.folder]
        first.discard()
        second.discard()
    for server, pid in zip((first, second), pids, strict=True):
        assert not psutil.pid_exists(pid) and not leftovers(server)
    assert not [f for f in folders if f.exists()]


def test_a_server_that_ignores_sigterm_is_killed_and_its_sockets_removed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(seaweed, "STOP_TIMEOUT_S", 0.5)
    server = seaweed.start()
    assert server.process
    pid = server.process.pid
    os.kill(pid, signal.SIGSTOP)  # a stuck server: TERM does nothing, so it cannot clean up after itself
    server.discard()
    assert not psutil.pid_exists(pid) and not leftovers(server) and not server.folder.exists()


def test_a_server_that_cannot_start_says_why_with_its_log(tmp_path: Path) -> None:
    server = seaweed.Seaweed(tmp_path, dict.fromkeys(seaweed.SERVICES, 1))  # all on one port: they cannot all bind
    with pytest.raises(seaweed.SeaweedUnavailable, match=r"(?s)exited with .*within .*\n.+"):
        server.start()
    assert server.process is None
