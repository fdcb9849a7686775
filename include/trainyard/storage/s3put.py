"""What an upload to an ``s3://`` tier sends beside its bytes, and how the stored object is checked against them.

The put side of ``s3.S3Tier`` (``upload``, ``write_bytes``): the sha256 as user metadata and, on a single
PUT, as an S3 checksum (``put_headers``); the file hashed once as minio reads it to send (``ReadHashing``);
and the comparison of the store's answer (a HEAD after the PUT) with what was written (``stored_problems``),
as a download would check the object.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO

from trainyard.errors import ContentChanged
from trainyard.storage.checksums import Check, Digester, PartDigest, available_algorithms, choose_check
from trainyard.storage.hashing import changed_message, digest_file

SHA_META = "sha256"
"""The user metadata key (``x-amz-meta-sha256``) an upload stores its sha256 under."""
Metadata = dict[str, str | list[str] | tuple[str]]
"""What minio's ``metadata=`` takes: user metadata, and x-amz-* headers sent as they are."""


def stored_problems(
    meta: dict[str, str],
    stored_size: int | None,
    etag: str | None,
    size: int,
    sha: str,
    written: Callable[[Check], Sequence[str]],
    part_size: int | None = None,
) -> list[str]:
    """How the stored object (its HEAD: lower-cased ``meta``, ``stored_size``, ``etag``) differs from what was
    written (``size``, ``sha``, ``written``: the bytes' digests for a check); empty if it does not.

    The sha256 metadata only echoes what was sent; the store's own digest of what it received is its
    checksum, else its ETag (MD5, or MD5 of part MD5s with ``part_size``). Ceph RGW Pacific keeps no
    checksum and answers CompleteMultipartUpload with an empty ETag, so the ETag comes from the HEAD.
    """
    stored_sum = meta.get("x-amz-checksum-sha256")
    problems = []
    if stored_size != size:
        problems.append(f"size {stored_size}, wrote {size}")
    if meta.get(f"x-amz-meta-{SHA_META}") != sha:
        problems.append(f"sha256 metadata {meta.get(f'x-amz-meta-{SHA_META}')}, wrote {sha}")
    if stored_sum and "-" not in stored_sum and stored_sum != _b64(sha):
        problems.append(f"x-amz-checksum-sha256 {stored_sum}, wrote {_b64(sha)}")
    elif not problems:
        problems += _store_digest_problems(meta, etag, size, written, part_size)
    return problems


def _store_digest_problems(
    headers: dict[str, str],
    etag: str | None,
    size: int,
    written: Callable[[Check], Sequence[str]],
    part_size: int | None,
) -> list[str]:
    """What the store's own digest (a checksum, else the ETag) says that the bytes written (``written``: their
    digests for a check) do not give."""
    unechoed = {k: v for k, v in headers.items() if k != f"x-amz-meta-{SHA_META}"}
    check = choose_check(unechoed, etag, size, None, part_size, available_algorithms())
    if check.expected is None:  # nothing of the store's own (an SSE-KMS ETag): the metadata is all there is
        return []
    found = written(check)
    if check.expected in found:
        return []
    return [f"{check.source} says {check.expected}, the bytes written give {' or '.join(found)}"]


def digests_of(check: Check, data: bytes) -> list[str]:
    digester = Digester(check)
    digester.update(data)
    return digester.digests()


class ReadHashing:
    """A file as minio reads it to upload it, hashed as it is read: its sha256, and the MD5 of the whole (a
    single PUT's ETag) or of each part (a multipart ETag), so the upload and its check read it once."""

    def __init__(self, fh: BinaryIO, size: int, part_size: int, expect: str, dest: str, src: Path):
        self.fh, self.size, self.part_size, self.expect, self.dest, self.src = fh, size, part_size, expect, dest, src
        self.sha = hashlib.sha256()
        self.md5 = hashlib.md5() if size <= part_size else None
        self.parts = PartDigest("md5", part_size) if size > part_size else None
        self.read_so_far = 0

    def read(self, n: int = -1) -> bytes:
        data = self.fh.read(n)
        self.sha.update(data)
        (self.md5 or self.parts).update(data)  # type: ignore[union-attr]  # one of them, by the size
        self.read_so_far += len(data)
        if data and self.read_so_far >= self.size and (got := self.sha.hexdigest()) != self.expect:
            raise ContentChanged(changed_message(self.src, got, self.expect, self.dest))  # before it is stored
        return data

    def digests_for(self, check: Check) -> list[str]:
        """``check``'s digests of what was read, where it hashed them; otherwise read again (a checksum only AWS
        keeps, say)."""
        if self.read_so_far != self.size:
            raise ContentChanged(f"{self.src}: {self.read_so_far} of {self.size} bytes were read; nothing was kept")
        if check.algo == "sha256" and check.style == "full":
            return [f"sha256:{self.sha.hexdigest()}"]
        if check.algo == "md5" and check.style == "full" and self.md5 is not None:
            return [f"md5:{self.md5.hexdigest()}"]
        if check.style == "multipart" and self.parts is not None and self.part_size in check.part_sizes:
            raw, count = self.parts.finish()
            return [f"md5-multipart:{raw.hex()}-{count}"]
        return digest_file(self.src, check).digests()


def _b64(sha_hex: str) -> str:
    return base64.b64encode(bytes.fromhex(sha_hex)).decode()


def put_headers(sha: str) -> Metadata:
    """sha256 user metadata, and the same sha256 as an S3 checksum the server checks on receipt and keeps.

    ``x-amz-sdk-checksum-algorithm`` is what the AWS SDKs send beside it; moto stores a checksum only then.
    """
    return {SHA_META: sha, "x-amz-checksum-sha256": _b64(sha), "x-amz-sdk-checksum-algorithm": "SHA256"}
