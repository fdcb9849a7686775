"""``tools.seaweed``: the suite's S3 server listens on 127.0.0.1 only and leaves nothing behind."""

from __future__ import annotations

import io
import os
import signal
import socket
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


def test_a_server_that_cannot_start_says_why_with_its_log_and_leaves_nothing(tmp_path: Path) -> None:
    server = seaweed.Seaweed(tmp_path, dict(zip(seaweed.SERVICES, seaweed.free_ports(5), strict=True)))
    with socket.socket() as taken:  # its S3 port taken after it was chosen: the others bind, then it fails
        taken.bind(("127.0.0.1", server.port))
        taken.listen()
        with pytest.raises(
            seaweed.SeaweedUnavailable, match=r"(?s)exited with .*\n.*port \d+ for S3 .* is not available"
        ):
            server.start()
    assert server.process is None and not leftovers(server)


def test_start_chooses_ports_again_when_one_is_taken_before_it_binds(monkeypatch: pytest.MonkeyPatch) -> None:
    real, tries = seaweed.free_ports, []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()

        def choose(count: int) -> list[int]:  # the first choice loses its S3 port to another process
            tries.append(real(count))
            if len(tries) == 1:
                tries[0][seaweed.SERVICES.index("s3")] = taken.getsockname()[1]
            return tries[-1]

        monkeypatch.setattr(seaweed, "free_ports", choose)
        server = seaweed.start()
        try:
            assert len(tries) == 2 and server.ports == dict(zip(seaweed.SERVICES, tries[1], strict=True))
        finally:
            server.discard()


def test_the_demo_s3_environment_reaches_the_server_with_no_secret_in_the_connection(
    s3_server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """What ``make demo-s3`` hands Airflow: a connection with the endpoint only; the keys through the chain."""
    import json

    from airflow.sdk import Connection

    from tools import demo_s3
    from trainyard.storage.s3 import S3Tier
    from trainyard.storage.s3auth import CHAIN_VARS, settings_for

    for name in CHAIN_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    seaweed.make_buckets(s3_server.server, [demo_s3.BUCKET])
    dags = demo_s3.dags_folder(tmp_path)
    assert (dags / "pipelines" / "s3_pretrain.yaml").read_text() == demo_s3.SPEC.read_text()
    env = demo_s3.environment(s3_server.server, dags)
    conn_env = env["AIRFLOW_CONN_TRAINYARD_COLD"]
    assert s3_server.secret_key not in conn_env
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"):
        monkeypatch.setenv(name, env[name])
    conn = json.loads(conn_env)
    settings = settings_for(Connection(conn_id="trainyard_cold", conn_type="aws", extra=json.dumps(conn["extra"])))
    assert S3Tier(f"s3://{demo_s3.BUCKET}/tokens", settings).list() == []


def test_a_server_in_a_folder_too_deep_for_a_unix_socket_starts_and_leaves_nothing(tmp_path: Path) -> None:
    # pytest's tmp_path under an xdist worker, with a bench's own temp folder in it, was past a socket's 107 bytes:
    # the filer died with 'bind: invalid argument' and the staging bench's smoke failed CI.
    deep = tmp_path / ("d" * (120 - len(str(tmp_path))))
    server = seaweed.start(deep)
    try:
        moved = [s for s in server.sockets() if s.name.startswith("trainyard-seaweed-")]
        assert len(moved) == 2 and all(s.exists() for s in moved)  # the s3 and filer local sockets, in /tmp
    finally:
        server.stop()
    assert not any(s.exists() for s in server.sockets())
