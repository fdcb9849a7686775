"""S3 tiers over HTTP (SeaweedFS on 127.0.0.1, the real minio client)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import io
import ipaddress
import json
import os
import socket
import ssl
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest
from dcp_helpers import gate_passed, save_as_ranks
from minio.error import S3Error

from trainyard.errors import ContentChanged, DataError, TransientError
from trainyard.storage import LocalTier, S3Tier, s3list
from trainyard.storage.hot import JOURNAL, STAGED_MANIFEST
from trainyard.storage.s3auth import S3Settings
from trainyard.storage.s3retry import Retry
from trainyard.storage.staging import stage
from trainyard.storage.tier import Landed, ObjectInfo

pytestmark = pytest.mark.integration
FAST = Retry(attempts=3, backoff_s=0.05)


def put(client, bucket: str, key: str, data: bytes, sha: bool = True) -> None:
    meta = {"sha256": hashlib.sha256(data).hexdigest()} if sha else None
    client.put_object(bucket, key, io.BytesIO(data), len(data), metadata=meta)


def fill(s3_server, bucket: str, n: int = 6, size: int = 50_000, prefix: str = "ds/") -> dict[str, bytes]:
    client = s3_server.client()
    files = {f"shard_{i:03d}.tok": os.urandom(size) for i in range(n)}
    for key, data in files.items():
        put(client, bucket, prefix + key, data)
    return files


def tier(s3_server, bucket: str, prefix: str = "ds", **kw) -> S3Tier:
    return S3Tier(f"s3://{bucket}/{prefix}", s3_server.settings, retry=kw.pop("retry", FAST), **kw)


def test_stage_from_s3_verifies_and_restages_nothing(s3_server, bucket: str, tmp_path: Path) -> None:
    files = fill(s3_server, bucket)
    first = stage(tier(s3_server, bucket), tmp_path / "hot")
    assert (first.files, first.transferred) == (6, 6)
    for key, data in files.items():
        assert (tmp_path / "hot" / key).read_bytes() == data
    again = stage(tier(s3_server, bucket), tmp_path / "hot")
    assert (again.transferred, again.bytes_transferred) == (0, 0)


def test_plan_transfers_only_new_and_changed_objects(s3_server, bucket: str, tmp_path: Path) -> None:
    fill(s3_server, bucket, n=4)
    stage(tier(s3_server, bucket), tmp_path / "hot")
    client = s3_server.client()
    put(client, bucket, "ds/shard_001.tok", b"changed" * 100)
    put(client, bucket, "ds/shard_new.tok", b"new" * 100)
    result = stage(tier(s3_server, bucket), tmp_path / "hot")
    assert (result.files, result.transferred, result.bytes_transferred) == (5, 2, 1000)
    assert (tmp_path / "hot" / "shard_001.tok").read_bytes() == b"changed" * 100


def test_large_objects_move_in_parallel_ranges_and_parts(s3_server, bucket: str, tmp_path: Path) -> None:
    data = os.urandom(13 << 20)
    (tmp_path / "big.bin").write_bytes(data)
    up = tier(s3_server, bucket, part_size=5 << 20)
    size, sha = up.upload(tmp_path / "big.bin", "big.bin")  # multipart: its ETag is no MD5
    assert (size, sha) == (len(data), hashlib.sha256(data).hexdigest())
    assert up.stat("big.bin").sha256 == sha and "-" in up.stat("big.bin").version
    result = stage(tier(s3_server, bucket, part_size=4 << 20), tmp_path / "hot")  # 4 ranges
    assert result.bytes_transferred == len(data)
    assert (tmp_path / "hot" / "big.bin").read_bytes() == data


@pytest.mark.parametrize("size", [300_000, (11 << 20) + 4321], ids=["single-put", "multipart"])
def test_an_upload_with_its_sha256_known_reads_the_file_once(
    s3_server, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    data = os.urandom(size)
    src = tmp_path / "shard.distcp"
    src.write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()

    def read_again(*args, **kwargs):
        raise AssertionError("the file was read a second time")

    monkeypatch.setattr("trainyard.storage.s3.sha256_file", read_again)
    monkeypatch.setattr("trainyard.storage.s3.digest_file", read_again)
    up = tier(s3_server, bucket, part_size=5 << 20)
    assert up.upload(src, "ok.distcp", expect_sha256=sha) == (size, sha)  # checked against the store's ETag too
    assert up.stat("ok.distcp").sha256 == sha
    with pytest.raises(ContentChanged, match=r"shard\.distcp: its sha256 is .* nothing was stored under .*/bad"):
        up.upload(src, "bad.distcp", expect_sha256="0" * 64)  # refused at its last byte, before it is stored
    assert up.stat("bad.distcp") is None
    assert list(s3_server.client()._list_multipart_uploads(bucket).uploads) == []  # the multipart one aborted


def test_a_stage_with_a_stream_per_large_object_fetches_them_whole(s3_server, bucket: str, tmp_path: Path) -> None:
    blobs = {f"big-{i}.bin": os.urandom((6 << 20) + i) for i in range(3)}
    up = tier(s3_server, bucket, part_size=5 << 20)
    for name, data in blobs.items():
        (tmp_path / name).write_bytes(data)
        up.upload(tmp_path / name, name)
    down = tier(s3_server, bucket, part_size=4 << 20)
    ranged: list[str] = []
    whole_ranged = down._ranged

    def counting(key, dest, expect, durable=True):
        ranged.append(key)
        return whole_ranged(key, dest, expect, durable)

    down._ranged = counting  # type: ignore[method-assign]
    stage(down, tmp_path / "hot", concurrency=2)
    # three objects over a part on two streams: the largest has a stream to itself throughout; the last two
    # would leave a stream idle, so they may come in ranges
    assert sorted(ranged) == ["big-0.bin", "big-1.bin"]
    assert {n: (tmp_path / "hot" / n).read_bytes() == d for n, d in blobs.items()} == dict.fromkeys(blobs, True)


def test_a_corrupt_object_fails_verification_and_leaves_nothing(s3_server, bucket: str, tmp_path: Path) -> None:
    client = s3_server.client()
    client.put_object(bucket, "ds/bad.tok", io.BytesIO(b"real bytes"), 10, metadata={"sha256": "0" * 64})
    with pytest.raises(DataError, match=r"/bad\.tok: failed verification: x-amz-meta-sha256 says sha256:0000"):
        stage(tier(s3_server, bucket), tmp_path / "hot")
    assert not (tmp_path / "hot" / "bad.tok").exists() and not (tmp_path / "hot" / STAGED_MANIFEST).exists()


class Connections:
    """Counts the connections the small-object loop opens (``asyncio.open_connection``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.opened = 0
        open_connection = asyncio.open_connection

        async def counted(*args, **kwargs):
            self.opened += 1
            return await open_connection(*args, **kwargs)

        monkeypatch.setattr(asyncio, "open_connection", counted)


def no_minio_get(source: S3Tier, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records each object minio's ``get_object`` is asked for (the path of every request but small GETs)."""
    asked: list[str] = []
    get_object = source.client.get_object

    def recorded(bucket: str, name: str, *args, **kwargs):
        asked.append(name)
        return get_object(bucket, name, *args, **kwargs)

    monkeypatch.setattr(source.client, "get_object", recorded)
    return asked


def in_bulk(source: S3Tier, listed: list[ObjectInfo], hot: Path, connections: int = 1) -> list[Future[Landed]]:
    """``download_small`` of ``listed`` into ``hot``; each object's future, settled."""
    bulk = [(o, hot / o.key, Future[Landed]()) for o in listed]
    source.download_small(bulk, connections)
    return [done for _, _, done in bulk]


def test_a_listing_of_several_pages_names_every_object_once(
    s3_server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keys that need encoding, a folder marker, an object beside the prefix, and pages of two (the store's
    continuation tokens): the listing is exactly the objects under the prefix, keyed relative to it."""
    monkeypatch.setattr(s3list, "PAGE", 2)
    client = s3_server.client()
    keys = ["a b.bin", "a+b.bin", "ünï/こ.txt", "100%.bin", "deep/er/x.tok", "~t.bin", "z=1&y.bin"]
    for i, key in enumerate(keys):
        put(client, bucket, f"ds/{key}", bytes([i]) * (i + 1))
    put(client, bucket, "ds/folder/", b"")
    put(client, bucket, "ds-beside/a.bin", b"x")
    listed = tier(s3_server, bucket).list()
    assert [(o.key, o.size) for o in listed] == sorted((k, i + 1) for i, k in enumerate(keys))
    assert all(len(o.version) == 32 for o in listed)  # the ETag, unquoted: an MD5 for a single PUT


def test_small_objects_come_in_one_request_each_on_a_kept_connection(
    s3_server, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = fill(s3_server, bucket, n=20, size=4096)
    source = tier(s3_server, bucket)
    asked, connections = no_minio_get(source, monkeypatch), Connections(monkeypatch)
    result = stage(source, tmp_path / "hot", concurrency=1)  # one request at a time for the small objects
    assert result.transferred == 20 and all((tmp_path / "hot" / k).read_bytes() == d for k, d in files.items())
    assert asked == [] and connections.opened == 1
    entries = json.loads((tmp_path / "hot" / STAGED_MANIFEST).read_text())["files"]
    assert {e["check"] for e in entries.values()} == {"sha256-metadata"}  # verified as minio's path verifies


def test_many_small_objects_come_on_several_connections_at_once(
    s3_server, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = fill(s3_server, bucket, n=40, size=3000)
    source = tier(s3_server, bucket)
    asked, connections = no_minio_get(source, monkeypatch), Connections(monkeypatch)
    landed = in_bulk(source, source.list(), tmp_path / "hot", connections=8)
    assert [f.result().size for f in landed] == [3000] * 40 and asked == [] and connections.opened == 8
    assert all((tmp_path / "hot" / k).read_bytes() == d for k, d in files.items())


class Relay:
    """A TCP relay on 127.0.0.1 in front of the S3 server. With ``tls``: HTTPS ends here, as at a load balancer
    before a store. With ``one_request``: each connection serves one request and is closed when the client sends
    another, a server whose keep-alive ended between two requests (nginx's ``keepalive_requests``)."""

    def __init__(self, port: int, tls: ssl.SSLContext | None = None, one_request: bool = False):
        self.upstream, self.tls, self.one_request = port, tls, one_request
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self) -> None:
        while True:
            raw, _ = self.listener.accept()
            threading.Thread(target=self.serve, args=(raw,), daemon=True).start()

    def serve(self, raw: socket.socket) -> None:
        with contextlib.suppress(OSError), self.tls.wrap_socket(raw, server_side=True) if self.tls else raw as client:
            with socket.create_connection(("127.0.0.1", self.upstream)) as server:
                back = threading.Thread(target=self.back, args=(server, client), daemon=True)
                if not self.one_request:
                    back.start()
                    while data := client.recv(65536):
                        server.sendall(data)
                    return
                request = b""
                while b"\r\n\r\n" not in request:  # a GET has no body: its head is the whole request
                    request += client.recv(65536) or b"\r\n\r\n"
                server.sendall(request)
                back.start()
                client.recv(65536)  # the next request on this connection (or its end): the connection ends here
                client.shutdown(socket.SHUT_RDWR)

    @staticmethod
    def back(server: socket.socket, client: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := server.recv(65536):
                client.sendall(data)


def test_a_kept_connection_the_server_closed_is_opened_again_once(
    s3_server, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = fill(s3_server, bucket, n=3, size=4096)
    relay = Relay(s3_server.port, one_request=True)
    settings = S3Settings.from_endpoint_url(
        f"http://127.0.0.1:{relay.port}", s3_server.access_key, s3_server.secret_key, s3_server.settings.region
    )
    source = S3Tier(f"s3://{bucket}/ds", settings, retry=FAST)
    asked, connections = no_minio_get(source, monkeypatch), Connections(monkeypatch)
    landed = in_bulk(source, source.list(), tmp_path / "hot")
    assert [f.result().size for f in landed] == [4096] * 3
    assert all((tmp_path / "hot" / k).read_bytes() == d for k, d in files.items())
    assert asked == [] and connections.opened == 3  # each object after the first: its kept connection, then a new one


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (its own CA) and its key, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_pem, key_pem = folder / "cert.pem", folder / "key.pem"
    cert_pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_pem.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_pem, key_pem


def test_small_objects_come_over_tls_verified_against_the_systems_trust(
    s3_server, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = fill(s3_server, bucket, n=12, size=4096)
    cert, key = self_signed(tmp_path)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    front = Relay(s3_server.port, tls=tls)
    endpoint = f"https://127.0.0.1:{front.port}"

    def over_tls() -> S3Tier:
        settings = S3Settings.from_endpoint_url(endpoint, s3_server.access_key, s3_server.secret_key, "us-east-1")
        return S3Tier(f"s3://{bucket}/ds", settings, retry=Retry(attempts=1))

    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # trusted as a private CA is, through OpenSSL's own setting
    source = over_tls()
    asked, connections = no_minio_get(source, monkeypatch), Connections(monkeypatch)
    result = stage(source, tmp_path / "hot", concurrency=1)
    assert result.transferred == 12 and all((tmp_path / "hot" / k).read_bytes() == d for k, d in files.items())
    assert asked == [] and connections.opened == 1  # every object on the loop's one TLS connection
    listed = source.list()
    monkeypatch.delenv("SSL_CERT_FILE")
    untrusted = over_tls()  # the same server, its certificate no longer trusted
    for done in in_bulk(untrusted, listed, tmp_path / "untrusted", connections=4):
        with pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED"):
            done.result()
    assert not (tmp_path / "untrusted").exists()


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: \xb2\r\n\r\n",  # a digit str.isdigit() takes and int() refuses
        b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n",
        b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n" + b"X: " + b"y" * (70 << 10) + b"\r\n\r\n",  # a head past any S3 answer's
    ],
    ids=["unicode-digit", "negative", "not-http", "endless-head"],
)
def test_an_answer_that_is_not_plain_http_goes_to_minios_path_and_lands_nothing(tmp_path: Path, answer: bytes) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    asked: list[bytes] = []

    def serve() -> None:  # the same answer to every request, as a broken proxy might give
        while True:
            conn, _ = listener.accept()
            with conn, contextlib.suppress(OSError):
                asked.append(conn.recv(65536))
                conn.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    settings = S3Settings.from_endpoint_url(f"http://127.0.0.1:{listener.getsockname()[1]}", "k", "s", "us-east-1")
    source = S3Tier("s3://bucket/ds", settings, retry=Retry(attempts=1))
    [done] = in_bulk(source, [ObjectInfo("a.tok", 4, '"etag"')], tmp_path)
    assert done.exception() is not None  # whatever minio makes of it: its path, its errors
    assert len(asked) >= 2 and not (tmp_path / "a.tok").exists()  # the loop's GET refused it, then minio asked


def test_an_error_answer_to_a_small_get_is_minios_error(
    s3_server, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fill(s3_server, bucket, n=2, size=4096)
    source = tier(s3_server, bucket)
    listed = source.list()
    s3_server.client().remove_object(bucket, "ds/shard_000.tok")  # gone since it was listed
    asked = no_minio_get(source, monkeypatch)
    gone, kept = in_bulk(source, listed, tmp_path)
    with pytest.raises(S3Error) as error:
        gone.result()
    assert error.value.code == "NoSuchKey" and asked == ["ds/shard_000.tok"]  # asked again through minio
    assert not (tmp_path / "shard_000.tok").exists() and kept.result().size == 4096


def test_a_small_object_grown_since_its_listing_is_refused_unread_and_the_connection_is_not_reused(
    s3_server, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = fill(s3_server, bucket, n=2, size=4096)
    source = tier(s3_server, bucket)
    listed = source.list()
    s3_server.client().put_object(bucket, "ds/shard_000.tok", io.BytesIO(b"x" * 65536), 65536)  # after the LIST
    connections = Connections(monkeypatch)
    grown, _ = in_bulk(source, listed, tmp_path / "hot")
    with pytest.raises(DataError, match=r"shard_000\.tok: failed verification: 4097 bytes arrived, 4096 expected"):
        grown.result()
    assert not (tmp_path / "hot" / "shard_000.tok").exists()  # checked in memory: not even a temporary file
    assert (tmp_path / "hot" / "shard_001.tok").read_bytes() == files["shard_001.tok"]
    assert connections.opened == 2  # its 60 KB left unread: that connection was not used again


def test_a_failed_stage_cancels_the_small_objects_still_queued(
    s3_server, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = s3_server.client()
    client.put_object(bucket, "ds/a-bad.tok", io.BytesIO(b"real bytes"), 10, metadata={"sha256": "0" * 64})
    fill(s3_server, bucket, n=200, size=100)
    source = tier(s3_server, bucket)
    asked = no_minio_get(source, monkeypatch)
    with pytest.raises(DataError, match=r"a-bad\.tok: failed verification"):
        stage(source, tmp_path / "hot", concurrency=1)  # one at a time: the bad one first
    assert asked == [] and len(list((tmp_path / "hot").glob("shard_*"))) < 200  # the queue was not worked off


def test_escaping_keys_are_refused_and_nothing_lands_outside(moto_server, moto_bucket: str, tmp_path: Path) -> None:
    # AWS S3 stores such a key, so a bucket may hold one. SeaweedFS refuses to write it (InvalidRequest), so
    # the object is put in moto's S3, which stores it as AWS does. minio's client refuses it too: boto3 writes it.
    import boto3

    s = moto_server.settings
    boto3.client(
        "s3",
        endpoint_url=f"http://{s.endpoint}",
        aws_access_key_id=moto_server.access_key,
        aws_secret_access_key=moto_server.secret_key,
        region_name=s.region,
    ).put_object(Bucket=moto_bucket, Key="ds/../../escape.tok", Body=b"evil")
    with pytest.raises(DataError, match="would escape the tier root"):
        stage(tier(moto_server, moto_bucket), tmp_path / "root" / "hot")
    assert not list(tmp_path.rglob("escape.tok"))


def test_the_s3_server_refuses_to_store_an_escaping_key(s3_server, bucket: str) -> None:
    """Why the test above writes to moto: the real server here will not store such a key at all."""
    if not s3_server.keeps_checksums:
        pytest.skip("Ceph RGW stores keys with '..' segments; trainyard's own refusal is the test above (moto)")
    import boto3
    from botocore.exceptions import ClientError

    client = boto3.client(
        "s3",
        endpoint_url=s3_server.url,
        aws_access_key_id=s3_server.access_key,
        aws_secret_access_key=s3_server.secret_key,
        region_name="us-east-1",
    )
    with pytest.raises(ClientError, match="InvalidRequest"):
        client.put_object(Bucket=bucket, Key="ds/../../escape.tok", Body=b"evil")


def test_missing_bucket_is_a_clear_error(s3_server, tmp_path: Path) -> None:
    with pytest.raises(DataError, match="bucket 'no-such-bucket' does not exist"):
        stage(S3Tier("s3://no-such-bucket/x", s3_server.settings, retry=FAST), tmp_path / "hot")


def test_lifecycle_rule_on_the_prefix_keeps_other_rules(s3_server, bucket: str) -> None:
    cold = tier(s3_server, bucket, prefix="ckpt")
    cold.set_lifecycle("other", 7, None, None)
    cold.set_lifecycle("trainyard-x", 30, None, None)
    cold.set_lifecycle("trainyard-x", 45, None, None)  # replaces its own rule, once
    rules = {r.rule_id: r for r in s3_server.client().get_bucket_lifecycle(bucket).rules}
    assert set(rules) == {"other", "trainyard-x"}
    assert rules["trainyard-x"].expiration.days == 45 and rules["trainyard-x"].rule_filter.prefix == "ckpt/"


def test_server_outage_gives_bounded_retries_then_rerun_completes(s3_server, bucket: str, tmp_path: Path) -> None:
    fill(s3_server, bucket, n=5)
    source = tier(s3_server, bucket)
    checked: list[str] = []
    original = source._check

    def check_then_outage(name, *args, **kwargs):  # each object's answer is checked, then it lands
        checked.append(name)
        if len(checked) == 2:
            s3_server.stop()  # the server goes away mid-stage
        return original(name, *args, **kwargs)

    source._check = check_then_outage  # type: ignore[method-assign]
    try:
        with pytest.raises(TransientError, match=r"gave up after 3 tries"):
            stage(source, tmp_path / "hot", concurrency=1)
    finally:
        s3_server.start()
    assert not (tmp_path / "hot" / STAGED_MANIFEST).exists()
    result = stage(tier(s3_server, bucket), tmp_path / "hot")
    assert (result.files, result.transferred) == (5, 3)  # the two finished before the outage are kept


def test_a_killed_stage_resumes_without_repeating_finished_shards(s3_server, bucket: str, tmp_path: Path) -> None:
    files = fill(s3_server, bucket, n=6)
    hot = tmp_path / "hot"
    script = textwrap.dedent(f"""
        import os, signal, time
        from pathlib import Path
        from trainyard.storage.s3 import S3Tier
        from trainyard.storage.s3auth import S3Settings
        from trainyard.storage.staging import stage
        s = S3Settings.from_endpoint_url(
            "http://127.0.0.1:{s3_server.port}", os.environ["KEY"], os.environ["SECRET"], "us-east-1"
        )
        tier = S3Tier("s3://{bucket}/ds", s)
        real, count = tier._check, [0]
        def check(name, *args, **kwargs):  # each object's answer is checked, then it lands
            if count[0] == 3:
                time.sleep(1.0)  # the stage's thread journals the three that landed (it would within 0.5 s)
                os.kill(os.getpid(), signal.SIGKILL)  # killed mid-stage, like an evicted worker
            count[0] += 1
            return real(name, *args, **kwargs)
        tier._check = check
        stage(tier, Path({str(hot)!r}), concurrency=1)
    """)
    keys = {"KEY": s3_server.access_key, "SECRET": s3_server.secret_key}  # never on a command line
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, env={**os.environ, **keys})
    assert killed.returncode == -9
    assert not (hot / STAGED_MANIFEST).exists()
    finished = [json.loads(line)["key"] for line in (hot / JOURNAL).read_text().splitlines()]
    assert sorted(finished) == sorted(files)[:3]
    for path in hot.iterdir():  # whatever has a final name is whole
        if path.name in files:
            assert path.read_bytes() == files[path.name]
    result = stage(tier(s3_server, bucket), hot)
    assert (result.files, result.transferred) == (6, 6 - len(finished))
    assert not (hot / JOURNAL).exists()
    assert {k: (hot / k).read_bytes() for k in files} == files


def test_local_and_s3_tiers_agree_on_listing(s3_server, bucket: str, tmp_path: Path) -> None:
    files = fill(s3_server, bucket, n=3, size=10)
    local = tmp_path / "cold"
    local.mkdir()
    for key, data in files.items():
        (local / key).write_bytes(data)
    assert [(o.key, o.size) for o in LocalTier(local).list()] == [
        (o.key, o.size) for o in tier(s3_server, bucket).list()
    ]


# Publishing checkpoints to an S3 cold tier: a copy under a prefix of its own, then the pointer object.

CKPT_SPEC = """\
dataset: {{source: "file://{root}/cold/tokens", name: tokens}}
nodes: {{count: 1}}
training: {{max_steps: 2, global_batch: 2, micro_batch: 1, checkpoint_every: 1}}
checkpoint: {{hot: "file://{root}/hot", cold: "s3://{bucket}/checkpoints", connection: cold}}
runs_root: "file://{root}/runs"
"""


def s3_run(s3_server, bucket: str, root: Path):
    from trainyard.pipeline.run import open_run

    (root / "pipe.yaml").write_text(CKPT_SPEC.format(root=root, bucket=bucket))
    return open_run(root / "pipe.yaml", "pipe", "manual__1", "2026-01-01", connections=lambda _: s3_server.settings)


def fetch(s3_server, uri: str, dest: Path) -> Path:
    """Download every object under a published ``uri`` into ``dest/step_NNNNNN``: the copy as a reader gets it."""
    source = S3Tier(uri, s3_server.settings, retry=FAST)
    folder = dest / uri.rstrip("/").rsplit("/", 1)[1].split(".")[0]
    for obj in source.list():
        source.download(obj.key, folder / obj.key, obj)
    return folder


def test_s3_republish_at_a_smaller_world_size_leaves_no_stale_shards(s3_server, bucket: str, tmp_path: Path) -> None:
    from trainyard.checkpoint.format import read_manifest, verify
    from trainyard.checkpoint.validate import validate
    from trainyard.pipeline import stages

    run = s3_run(s3_server, bucket, tmp_path)
    stages.publish(run, gate_passed(run, save_as_ranks(tmp_path / "a", 10, ranks=2)))
    result = stages.publish(run, gate_passed(run, save_as_ranks(tmp_path / "b", 10, ranks=1)))
    copy = fetch(s3_server, result.uri, tmp_path / "fetched")
    assert verify(copy) == [], "the re-published copy mixes two saves"
    assert read_manifest(copy)["world_size"] == 1 and validate(copy).valid
    from trainyard.checkpoint import cold

    tier = S3Tier(f"s3://{bucket}/checkpoints/pipe", s3_server.settings, retry=FAST)
    assert cold.published(tier) == result.uri.rsplit("/", 1)[1]
    assert tier.stat(cold.POINTER).sha256  # the pointer is an object like the others, verified on write


def test_s3_interrupted_republish_leaves_the_published_copy_whole_and_pointed_to(
    s3_server, bucket: str, tmp_path: Path, monkeypatch
) -> None:
    from trainyard.checkpoint.format import read_manifest, verify
    from trainyard.pipeline import stages

    run = s3_run(s3_server, bucket, tmp_path)
    first = stages.publish(run, gate_passed(run, save_as_ranks(tmp_path / "a", 10, ranks=2)))
    uploaded: list[str] = []
    real = S3Tier.upload

    def dies_after_one(self, src, key, expect_sha256=None):
        if uploaded:
            raise TransientError(f"upload {key}: gave up after 4 tries: connection reset")
        uploaded.append(key)
        return real(self, src, key, expect_sha256)

    monkeypatch.setattr(S3Tier, "upload", dies_after_one)
    with pytest.raises(TransientError):
        stages.publish(run, gate_passed(run, save_as_ranks(tmp_path / "b", 10, ranks=1)))
    monkeypatch.undo()
    old = fetch(s3_server, first.uri, tmp_path / "fetched")
    assert verify(old) == [] and read_manifest(old)["world_size"] == 2, "the published copy was written over"
    from trainyard.checkpoint import cold

    tier = S3Tier(f"s3://{bucket}/checkpoints/pipe", s3_server.settings, retry=FAST)
    assert cold.published(tier) == first.uri.rsplit("/", 1)[1]


def test_bucket_keys_named_like_the_hot_tiers_own_files_are_never_staged(
    s3_server, bucket: str, tmp_path: Path
) -> None:
    """As from a folder (tests/unit/test_staging.py), whatever the bucket's spelling of the key."""
    from trainyard.storage.hot import staged_datasets

    files = fill(s3_server, bucket, n=2)
    client = s3_server.client()
    planted = [".pins/someone", "deep/.pins/someone", JOURNAL, "sub/_staged.json", "sub//_staged.json"]
    for key in planted:
        put(client, bucket, "ds/" + key, b'{"files": {}}')
    hot = tmp_path / "hot" / "tokens"
    result = stage(tier(s3_server, bucket), hot)
    assert (result.files, result.transferred) == (len(files), len(files))
    assert {p.relative_to(hot).as_posix() for p in hot.rglob("*")} == {
        *files,
        STAGED_MANIFEST,
        ".last_used",
    }
    [found] = staged_datasets(tmp_path / "hot")
    assert found.pinned_by == ()
