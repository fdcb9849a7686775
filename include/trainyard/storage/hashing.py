"""Streaming hashes, and the copies that verify what they wrote."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Protocol

from trainyard.atomic import open_new, temp_name
from trainyard.errors import DataError
from trainyard.storage.checksums import FIRST_FETCH, Check, Digester
from trainyard.storage.tier import Landed

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
    stream: Readable,
    final: Path,
    check: Check = FIRST_FETCH,
    expect_size: int | None = None,
    where: str | None = None,
) -> Landed:
    """Copy ``stream`` to ``final`` through a temporary file, verify, then rename.

    The bytes are hashed as they are written, once, with the digest ``check``
    names; the size and that digest must be what the source promised, else a
    ``DataError`` naming ``where`` (default: ``final``) and both digests, and
    nothing is left under ``final``.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(final)
    digester, size = Digester(check), 0
    try:
        with open_new(tmp) as out:
            while block := stream.read(BLOCK):
                digester.update(block)
                out.write(block)
                size += len(block)
            out.flush()
            os.fsync(out.fileno())
        landed = settle(check, digester, size, expect_size, where or str(final))
        os.replace(tmp, final)
        return landed
    finally:
        tmp.unlink(missing_ok=True)


def digest_file(path: Path, check: Check) -> Digester:
    """``check``'s digest of a file already written (the ranged download's one hash pass)."""
    digester = Digester(check)
    buffer = bytearray(BLOCK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buffer):
            digester.update(view[:n])
    return digester


def settle(check: Check, digester: Digester, size: int, expect_size: int | None, where: str) -> Landed:
    """What landed, if its size and digest are what ``check`` expects; otherwise a ``DataError``."""
    if expect_size is not None and size != expect_size:
        raise DataError(
            f"{where}: failed verification: {size} bytes arrived, {expect_size} expected; nothing was kept"
            " (stage again: the object may have changed since it was listed)"
        )
    found = digester.digests()
    if check.expected is not None and check.expected not in found:
        hint = (
            "; the part sizes were guessed (the store did not say them): if the object is intact, re-upload it"
            " with a checksum or with `trainyard upload`"
            if "guessed" in check.source
            else "; re-upload the object, or restore it from a good copy"
        )
        raise DataError(
            f"{where}: failed verification: {check.source} says {check.expected}, the bytes give"
            f" {' or '.join(found)}; nothing was kept{hint}"
        )
    return Landed(size, digester.result(), check.how)


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
