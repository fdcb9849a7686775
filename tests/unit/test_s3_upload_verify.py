"""Upload verification on a store that keeps no checksum and answers a multipart completion with an empty
ETag (Ceph RGW Pacific): the bytes written must give the ETag the store's HEAD answers with, since the
sha256 metadata only echoes what was sent."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from trainyard.errors import DataError
from trainyard.storage.s3 import S3Tier
from trainyard.storage.s3auth import S3Settings
from trainyard.storage.s3retry import Retry

MiB = 1 << 20
PART = 5 * MiB


def md5_etag(data: bytes, part_size: int | None = None) -> str:
    if part_size is None or len(data) <= part_size:
        return hashlib.md5(data).hexdigest()
    parts = [data[i : i + part_size] for i in range(0, len(data), part_size)]
    return hashlib.md5(b"".join(hashlib.md5(p).digest() for p in parts)).hexdigest() + f"-{len(parts)}"


class RgwLike:
    """Stores what it is sent, keeps no checksum, completes a multipart upload with an empty ETag;
    ``stored`` is what a HEAD answers from (the bytes the store holds, corrupted if a test says so)."""

    def __init__(self, corrupt: bool = False) -> None:
        self.corrupt, self.meta, self.stored = corrupt, {}, b""

    def _keep(self, data: bytes, metadata: dict[str, str]) -> SimpleNamespace:
        # The first byte flipped: a fixed b"X" left random data whose first byte was already "X" (1 in 256) intact.
        self.stored = (bytes([data[0] ^ 0xFF]) + data[1:]) if self.corrupt and data else data
        self.meta = {f"X-Amz-Meta-{k}": v for k, v in metadata.items() if not k.lower().startswith("x-amz-")}
        return SimpleNamespace(etag="")  # the completion reply's empty ETag: never relied on

    def put_object(self, bucket, name, data, length, metadata, part_size=None, num_parallel_uploads=1):
        # in parts, as minio reads a stream: each part read whole before it is sent
        self.part_size = part_size if part_size and length > part_size else None
        step = self.part_size or length
        return self._keep(b"".join(data.read(min(step, length - i)) for i in range(0, length, step)), metadata)

    def stat_object(self, bucket, name, extra_headers=None):
        etag = md5_etag(self.stored, self.part_size)
        return SimpleNamespace(size=len(self.stored), etag=etag, metadata={"ETag": f'"{etag}"', **self.meta})


def tier_on(client: RgwLike) -> S3Tier:
    # Minio connects on the first request only; the client is replaced before any.
    tier = S3Tier(
        "s3://bucket/ckpt",
        S3Settings.from_endpoint_url("http://127.0.0.1:9", "k", "s"),
        part_size=PART,
        retry=Retry(attempts=1),
    )
    tier.client = client  # type: ignore[assignment]
    return tier


@pytest.mark.parametrize("size", [300_000, 12 * MiB + 4321], ids=["single-put", "multipart"])
def test_upload_is_checked_against_the_stores_etag(tmp_path: Path, size: int) -> None:
    src = tmp_path / "shard.pt"
    src.write_bytes(os.urandom(size))
    assert tier_on(RgwLike()).upload(src, "shard.pt") == (size, hashlib.sha256(src.read_bytes()).hexdigest())
    with pytest.raises(DataError, match=r"ckpt/shard\.pt: the stored object differs .* ETag .* the bytes written give"):
        tier_on(RgwLike(corrupt=True)).upload(src, "shard.pt")


def test_write_bytes_is_checked_against_the_stores_etag() -> None:
    tier_on(RgwLike()).write_bytes("PUBLISHED", b"step-100")
    with pytest.raises(DataError, match=r"ckpt/PUBLISHED: the stored object differs .* ETag"):
        tier_on(RgwLike(corrupt=True)).write_bytes("PUBLISHED", b"step-100")
