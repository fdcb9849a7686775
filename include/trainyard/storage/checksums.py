"""Which check a downloaded S3 object gets, and the digests that make it.

An object in a bucket written by any tool carries some of: an S3 checksum
(asked for with ``x-amz-checksum-mode: ENABLED``), trainyard's sha256 user
metadata, an ETag that is a plain MD5 (single part, no SSE-KMS/SSE-C) or a
multipart ETag (the MD5 of the parts' MD5s). ``choose_check`` picks the best
one, a pure function of the response headers, so exactly one digest is
computed while the bytes are written. With none of them the object is
trusted on its first fetch and its sha256 recorded; a later fetch of the same
version is checked against that record.

Digests are written ``<algo>:<value>``: hex for sha256/sha1/md5 (as
``sha256sum`` prints them), base64 for the CRCs (as S3 shows them); a
checksum of parts ends in ``-<N>``: ``sha256-composite:<b64>-3``,
``md5-multipart:<hex>-3``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import math
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Protocol

MiB = 1 << 20
# Preferred first when a server sends several (it rarely does): the strongest one.
S3_ALGORITHMS = ("sha256", "crc64nvme", "crc32c", "sha1", "crc32")
HEX_ALGORITHMS = ("sha256", "sha1", "md5", "xxh3-128")
"""Written in hex (xxh3-128: local copies' hash, never an S3 checksum; sha256 etc. as ``sha256sum`` prints them)."""
CRC_ALGORITHMS = ("crc32", "crc32c", "crc64nvme")
WIDTH = {"sha256": 32, "sha1": 20, "md5": 16, "xxh3-128": 16, "crc32": 4, "crc32c": 4, "crc64nvme": 8}
# Part sizes tools use by default (boto3 / aws cli 8 MiB, rclone 5 MiB, mc 16 MiB ...) and powers of two.
STANDARD_PART_SIZES = tuple(
    sorted({5 * MiB, 8 * MiB, 16 * MiB, 64 * MiB, 100 * MiB} | {MiB << k for k in range(3, 13)})
)
MAX_CANDIDATES = 4
FIRST_FETCH_ALGO = "sha256"
_HEX = re.compile(r"[0-9a-f]+\Z")
_B64_PARTS = re.compile(r"([A-Za-z0-9+/]+={0,2})-([1-9][0-9]*)\Z")
_ETAG = re.compile(r"([0-9a-f]{32})(?:-([1-9][0-9]*))?\Z")
KMS = ("aws:kms", "aws:kms:dsse")


Buffer = bytes | bytearray | memoryview


class Hasher(Protocol):
    def update(self, data: Buffer, /) -> None: ...

    def digest(self) -> bytes: ...


class _Crc:
    """A running CRC from ``awscrt.checksums`` (the CRCs S3 uses, hardware-accelerated)."""

    def __init__(self, algo: str):
        from awscrt import checksums  # imported lazily: only objects with CRC checksums need it

        self._fn: Callable[[Buffer, int], int] = getattr(checksums, algo)
        self._width = WIDTH[algo]
        self._value = 0

    def update(self, data: Buffer, /) -> None:
        self._value = self._fn(data, self._value)

    def digest(self) -> bytes:
        return self._value.to_bytes(self._width, "big")


def new_hasher(algo: str) -> Hasher:
    if algo == "xxh3-128":
        import xxhash  # only local copies and their re-verification need it

        return xxhash.xxh3_128()
    if algo in HEX_ALGORITHMS:
        return hashlib.new(algo)
    if algo in CRC_ALGORITHMS:
        return _Crc(algo)
    raise ValueError(f"no hasher for {algo!r} (known: {', '.join(WIDTH)})")


@cache
def available_algorithms() -> frozenset[str]:
    """The algorithms this process can compute (the CRCs need the ``awscrt`` package)."""
    try:
        import awscrt.checksums  # noqa: F401
    except ImportError:
        return frozenset(HEX_ALGORITHMS)
    return frozenset(WIDTH)


def encode(algo: str, raw: bytes) -> str:
    return raw.hex() if algo in HEX_ALGORITHMS else base64.b64encode(raw).decode()


def _decode_b64(algo: str, value: str) -> bytes | None:
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw if len(raw) == WIDTH[algo] else None


class PartDigest:
    """``algo`` over each ``part_size`` slice, then over the concatenated raw part digests.

    That is S3's COMPOSITE checksum and, with md5, the multipart ETag.
    """

    def __init__(self, algo: str, part_size: int):
        self.algo, self.part_size = algo, part_size
        self.parts = 0
        self._digests = bytearray()
        self._part = new_hasher(algo)
        self._left = part_size

    def update(self, data: Buffer, /) -> None:
        view = memoryview(data)
        while len(view):
            n = min(len(view), self._left)
            self._part.update(view[:n])
            self._left -= n
            view = view[n:]
            if not self._left:
                self._close_part()

    def _close_part(self) -> None:
        self._digests += self._part.digest()
        self.parts += 1
        self._part = new_hasher(self.algo)
        self._left = self.part_size

    def finish(self) -> tuple[bytes, int]:
        """The digest of the part digests, and the number of parts."""
        if self._left < self.part_size:
            self._close_part()  # the last, shorter part
        combined = new_hasher(self.algo)
        combined.update(bytes(self._digests))
        return combined.digest(), self.parts


@dataclass(frozen=True)
class Check:
    """How one download is verified: what to compute while writing and what it must equal."""

    how: str
    """``Landed.check``: s3-checksum, sha256-metadata, etag-md5, etag-multipart, recorded, first-fetch."""
    algo: str
    expected: str | None
    """The digest the bytes must give (``<algo>:<value>``); None on a first fetch."""
    source: str
    """Where ``expected`` came from, for messages (``x-amz-checksum-crc32c``, ``ETag``, ...)."""
    part_sizes: tuple[int, ...] = ()
    """Non-empty: a checksum of parts; each candidate is computed in the same pass, a match is accepted."""
    style: str = "full"
    """``full``, ``composite`` (S3 COMPOSITE checksum) or ``multipart`` (multipart ETag)."""


FIRST_FETCH = Check("first-fetch", FIRST_FETCH_ALGO, None, "nothing (trusted on first fetch)")


class Digester:
    """Computes ``check``'s digest (or each candidate's) over the bytes fed to it, in one pass."""

    def __init__(self, check: Check):
        self.check = check
        self._whole = None if check.part_sizes else new_hasher(check.algo)
        self._parts = [PartDigest(check.algo, p) for p in check.part_sizes]

    def update(self, data: Buffer, /) -> None:
        if self._whole is not None:
            self._whole.update(data)
        for p in self._parts:
            p.update(data)

    def digests(self) -> list[str]:
        """The digest text of each candidate (one unless part sizes were guessed)."""
        if self._whole is not None:
            return [f"{self.check.algo}:{encode(self.check.algo, self._whole.digest())}"]
        out = []
        for p in self._parts:
            raw, n = p.finish()
            if self.check.style == "multipart":  # as the ETag shows it: hex
                out.append(f"md5-multipart:{raw.hex()}-{n}")
            else:  # as S3 shows a COMPOSITE checksum: base64
                out.append(f"{self.check.algo}-composite:{base64.b64encode(raw).decode()}-{n}")
        return out

    def result(self) -> str:
        """The digest to record: the candidate that matches ``expected``, else the first."""
        found = self.digests()
        return self.check.expected if self.check.expected in found else found[0]


def part_size_candidates(size: int, parts: int) -> tuple[int, ...]:
    """Standard part sizes that cut ``size`` bytes into exactly ``parts`` parts (at most a handful)."""
    if parts == 1:
        return (size,) if size else ()  # one part of any size: the part is the object
    fit = [p for p in STANDARD_PART_SIZES if math.ceil(size / p) == parts]
    return tuple(fit[:MAX_CANDIDATES])


def _lower(headers: Mapping[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


def _multipart_etag(etag: str | None) -> tuple[str, int | None] | None:
    """(md5 hex, parts or None) for an ETag that is an MD5, or None for anything else."""
    m = _ETAG.match((etag or "").strip('"').lower())
    if not m:
        return None
    return m.group(1), int(m.group(2)) if m.group(2) else None


def _etag_is_md5(h: dict[str, str]) -> bool:
    # With SSE-KMS or SSE-C the ETag is not a digest of the bytes (S3 documents this); SSE-S3 keeps it.
    return h.get("x-amz-server-side-encryption", "").lower() not in KMS and not any(
        k.startswith("x-amz-server-side-encryption-customer-") for k in h
    )


def _s3_checksum(h: dict[str, str], etag: str | None, algorithms: Collection[str]) -> tuple[str, str, int] | None:
    """(algo, value, parts) of the best usable S3 checksum; parts 0 for a FULL_OBJECT one."""
    kind = h.get("x-amz-checksum-type", "").upper()
    etag_parts = (_multipart_etag(etag) or ("", None))[1]
    for algo in S3_ALGORITHMS:
        value = h.get(f"x-amz-checksum-{algo}")
        if not value or algo not in algorithms:
            continue
        if m := _B64_PARTS.match(value):
            if _decode_b64(algo, m.group(1)) is not None and kind in ("", "COMPOSITE"):
                return algo, m.group(1), int(m.group(2))
            continue
        if _decode_b64(algo, value) is None:
            continue  # not a checksum we can read: never trust a half-parsed value
        if kind == "FULL_OBJECT" or (not kind and not etag_parts):
            return algo, value, 0
        # COMPOSITE without its -N, or a multipart object whose checksum type the server did not say
        # (moto's HEAD): it may be a checksum of parts without the count, so it is not used.
    return None


def parts_to_infer(
    headers: Mapping[str, str], etag: str | None, algorithms: Collection[str] = frozenset(WIDTH)
) -> int | None:
    """The number of parts when the best check is a checksum of parts, so the part size is worth a request."""
    h = _lower(headers)
    if found := _s3_checksum(h, etag, algorithms):
        return found[2] or None
    if _sha256_meta(h):
        return None
    md5 = _multipart_etag(etag)
    return md5[1] if md5 and _etag_is_md5(h) else None


def _sha256_meta(h: dict[str, str]) -> str | None:
    value = h.get("x-amz-meta-sha256", "").lower()
    return value if len(value) == 64 and _HEX.match(value) else None


def _part_sizes(size: int, parts: int, part_size: int | None) -> tuple[tuple[int, ...], bool]:
    """(candidates, guessed): the server's part size when it fits, else the standard sizes that fit."""
    if parts == 1:
        return ((size,) if size else ()), False
    if part_size is not None:
        # A first part that does not cut the object into ``parts`` equal parts: the parts differ in size,
        # and no single size can recompute the digest.
        return ((part_size,), False) if part_size > 0 and math.ceil(size / part_size) == parts else ((), False)
    return part_size_candidates(size, parts), True


def choose_check(
    headers: Mapping[str, str],
    etag: str | None,
    size: int,
    recorded: str | None = None,
    part_size: int | None = None,
    algorithms: Collection[str] = frozenset(WIDTH),
) -> Check:
    """The one check for a download, best first: S3 checksum, sha256 metadata, MD5 ETag, recorded digest.

    ``headers`` are the GET (or HEAD) response's, asked with checksum mode; ``part_size`` is the part
    size as the server said it (HEAD ``?partNumber=``), 0 when it said the parts differ in size, None
    when it could not say (then standard part sizes are tried); ``recorded`` is the digest recorded at an earlier fetch of this
    same object version; ``algorithms`` are those this process can compute.
    """
    h = _lower(headers)
    if found := _s3_checksum(h, etag, algorithms):
        algo, value, parts = found
        source = f"x-amz-checksum-{algo}"
        if not parts:
            raw = _decode_b64(algo, value)
            assert raw is not None  # _s3_checksum checked it
            return Check("s3-checksum", algo, f"{algo}:{encode(algo, raw)}", f"{source} (FULL_OBJECT)")
        sizes, _ = _part_sizes(size, parts, part_size)
        if sizes:
            expected = f"{algo}-composite:{value}-{parts}"
            return Check("s3-checksum", algo, expected, f"{source} (COMPOSITE)", sizes, "composite")
    if sha := _sha256_meta(h):
        return Check("sha256-metadata", "sha256", f"sha256:{sha}", "x-amz-meta-sha256")
    md5 = _multipart_etag(etag)
    if md5 and _etag_is_md5(h):
        hexd, etag_parts = md5
        if etag_parts is None:
            return Check("etag-md5", "md5", f"md5:{hexd}", "ETag (single-part MD5)")
        sizes, guessed = _part_sizes(size, etag_parts, part_size)
        if sizes:
            note = f"parts of {', '.join(_mib(p) for p in sizes)}" + (" (guessed)" if guessed else "")
            expected = f"md5-multipart:{hexd}-{etag_parts}"
            return Check("etag-multipart", "md5", expected, f"ETag ({note})", sizes, "multipart")
    if recorded and (algo := recorded.partition(":")[0]) in algorithms:
        return Check("recorded", algo, recorded, "the digest recorded at the first fetch")
    return FIRST_FETCH


def _mib(n: int) -> str:
    return f"{n / MiB:g} MiB" if n >= MiB else f"{n} B"
