"""The Tier protocol: a flat namespace of objects under one URI root.

One implementation per scheme (DESIGN rule 5). Staging, publishing and
checkpoint tiering only ever talk to this protocol, so adding a scheme never
touches them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    version: str
    """Changes whenever the content may have changed (mtime for files, ETag for S3)."""
    sha256: str | None = None
    """Content hash when the tier stores one beside the object."""
    digest: str | None = None
    """A digest recorded earlier (``"<algo>:<value>"``), passed back as ``expect`` so a re-fetch is checked against it."""


@dataclass(frozen=True)
class Landed:
    size: int
    digest: str  # "<algo>:<value>": "sha256:<hex>", "crc32c:<b64>", "crc64nvme:<b64>",
    # "md5:<hex>", "md5-multipart:<hex>-<N>", "xxh3-128:<hex>" ...
    check: str  # how the bytes were verified: "s3-checksum", "sha256-metadata",
    # "etag-md5", "etag-multipart", "first-fetch" (nothing to check
    # against: trusted, hash recorded), "recorded" (checked against the
    # digest recorded at the first fetch), "local-copy"


class Tier(Protocol):
    uri: str

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object under ``prefix``, sorted by key."""
        ...

    def download(self, key: str, dest: Path, expect: ObjectInfo | None = None) -> Landed:
        """Copy one object to ``dest`` (temporary name, verified, renamed); says what landed and how it was checked."""
        ...

    def upload(self, src: Path, key: str) -> tuple[int, str]:
        """Copy a local file to ``key``, verified; returns (size, sha256)."""
        ...

    def write_bytes(self, key: str, data: bytes) -> None:
        """Replace ``key`` with ``data`` at once: a reader sees the old object or the new, whole (a pointer)."""
        ...

    def read_bytes(self, key: str, limit: int = 1 << 20) -> bytes | None:
        """A small object's bytes (at most ``limit``), or None if there is no such object."""
        ...
