"""Streaming sha256 and the copy that verifies what it wrote."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Protocol

from trainyard.atomic import open_new, temp_name

BLOCK = 1 << 20


class Readable(Protocol):
    """What ``write_verified`` reads from: a file, or an HTTP response body."""

    def read(self, size: int, /) -> bytes: ...


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, streamed in 1 MiB blocks into one reused buffer."""
    digest = hashlib.sha256()
    buffer = bytearray(BLOCK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def write_verified(
    stream: Readable, final: Path, expect_size: int | None = None, expect_sha256: str | None = None
) -> tuple[int, str]:
    """Copy ``stream`` to ``final`` through a temporary file, verify, then rename.

    The bytes are hashed as they are written, once; the size on disk and that
    hash must match what the source promised. Returns ``(size, sha256)``.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(final)
    digest, size = hashlib.sha256(), 0
    try:
        with open_new(tmp) as out:
            while block := stream.read(BLOCK):
                digest.update(block)
                out.write(block)
                size += len(block)
            out.flush()
            os.fsync(out.fileno())
        actual = digest.hexdigest()
        commit_verified(
            tmp, final, size if expect_size is None else expect_size, expect_sha256 or actual, actual_sha256=actual
        )
        return size, actual
    finally:
        tmp.unlink(missing_ok=True)


def copy_file_verified(
    src: Path, final: Path, expect_size: int | None = None, expect_sha256: str | None = None
) -> tuple[int, str]:
    """Copy a local file to ``final`` in the kernel, hash what landed, verify, rename.

    One hash pass over the copy (not two: re-reading right after writing reads
    the page cache, so it proves nothing the write did not). The source must not
    change during the copy, and must match ``expect_*`` where the tier knows them.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(final)
    before = src.stat()
    try:
        with src.open("rb") as fin, open_new(tmp) as fout:
            shutil.copyfileobj(fin, fout, BLOCK)  # sendfile/copy_file_range on Linux: no user-space copy
            fout.flush()
            os.fsync(fout.fileno())
        after = src.stat()
        if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
            raise OSError(f"copy to {final} failed verification: {src} changed during the copy")
        actual = sha256_file(tmp)
        size = before.st_size if expect_size is None else expect_size
        commit_verified(tmp, final, size, expect_sha256 or actual, actual_sha256=actual)
        return size, actual
    finally:
        tmp.unlink(missing_ok=True)


def commit_verified(tmp: Path, final: Path, size: int, sha256: str, actual_sha256: str | None = None) -> None:
    """Rename ``tmp`` to ``final`` only if the file on disk has ``size`` and ``sha256``.

    ``actual_sha256`` spares a second hash pass when the caller hashed ``tmp``
    already. Raises ``OSError`` naming every mismatch; the caller removes ``tmp``.
    """
    problems = []
    actual = tmp.stat().st_size
    if actual != size:
        problems.append(f"size {actual} != expected {size}")
    elif (actual_sha256 or sha256_file(tmp)) != sha256:
        problems.append(f"sha256 of the written file != expected {sha256[:12]}...")
    if problems:
        raise OSError(f"copy to {final} failed verification: {'; '.join(problems)}")
    os.replace(tmp, final)
