"""The Tier protocol: a flat namespace of objects under one URI root.

One implementation per scheme (docs/architecture.md, storage). Staging, publishing and
checkpoint tiering only ever talk to this protocol, so adding a scheme never
touches them.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    version: str
    """Changes whenever the content may have changed (mtime for files, ETag for S3)."""
    sha256: str | None = None
    """Content hash when the tier stores one beside the object."""
    digest: str | None = None
    """A digest recorded at an earlier fetch of this version (``Landed.digest``): a re-fetch is checked against it."""


@dataclass(frozen=True)
class Landed:
    """What ``Tier.download`` put on disk and how it knows the bytes are right."""

    size: int
    digest: str
    """``<algo>:<value>``: ``sha256:<hex>``, ``crc32c:<b64>``, ``md5-multipart:<hex>-<N>`` ..."""
    check: str
    """How the bytes were verified: ``s3-checksum``, ``sha256-metadata``, ``etag-md5``, ``etag-multipart``,
    ``first-fetch`` (nothing to check against: trusted, digest recorded), ``recorded`` (checked against the
    digest recorded at the first fetch), ``local-copy``."""


class Tier(Protocol):
    uri: str

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object under ``prefix``, sorted by key."""
        ...

    def download(
        self, key: str, dest: Path, expect: ObjectInfo | None = None, durable: bool = True, split: bool = True
    ) -> Landed:
        """Copy one object to ``dest`` (temporary name, verified, renamed).

        ``durable``: fsynced before the rename. Staging passes False where it records the boot
        instead (``storage.boot``); everything else keeps the default. ``split``: a large
        object may come in parallel ranges; staging passes False while every stream has an
        object of its own, where ranges would only add requests.
        """
        ...

    def upload(self, src: Path, key: str, expect_sha256: str | None = None) -> tuple[int, str]:
        """Copy a local file to ``key``, verified; returns (size, sha256). With ``expect_sha256`` (a checkpoint's
        manifest says it), a file whose bytes do not give it is refused (``ContentChanged``), nothing kept."""
        ...

    def write_bytes(self, key: str, data: bytes) -> None:
        """Replace ``key`` with ``data`` at once: a reader sees the old object or the new, whole (a pointer)."""
        ...

    def read_bytes(self, key: str, limit: int = 1 << 20) -> bytes | None:
        """A small object's bytes (at most ``limit``), or None if there is no such object."""
        ...


@runtime_checkable
class SmallInBulk(Protocol):
    """A tier that fetches many small objects at once better than one call of ``download`` each (S3's event loop:
    ``storage.s3get``). Staging hands it every object under ``transfer.SMALL_OBJECT``."""

    def download_small(
        self, objects: Sequence[tuple[ObjectInfo, Path, Future[Landed]]], connections: int, durable: bool = True
    ) -> None:
        """Land each ``(object, dest, done)`` as ``download`` would, ``connections`` at once, setting ``done`` to what
        landed or to the object's error; skip one whose ``done`` was cancelled before its turn. Where it raises,
        the futures it did not settle are the caller's to settle."""
        ...
