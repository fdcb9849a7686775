"""Streaming sha256 and the copy that verifies what it wrote."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import BinaryIO

from trainyard.atomic import temp_name

BLOCK = 1 << 20


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, streamed in 1 MiB blocks into one reused buffer."""
    digest = hashlib.sha256()
    buffer = bytearray(BLOCK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def write_verified(stream: BinaryIO, final: Path, expect_size: int | None = None, expect_sha256: str | None = None) -> tuple[int, str]:
    """Copy ``stream`` to ``final`` through a temporary file, verify, then rename.

    The source is hashed as it is read and the written file is hashed again
    after fsync, so a short write or a bad disk cannot pass as a good copy.
    Returns ``(size, sha256)``.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(final)
    digest, size = hashlib.sha256(), 0
    try:
        with tmp.open("wb") as out:
            while block := stream.read(BLOCK):
                digest.update(block)
                out.write(block)
                size += len(block)
            out.flush()
            os.fsync(out.fileno())
        sha = expect_sha256 if expect_sha256 is not None else digest.hexdigest()
        problems = [] if digest.hexdigest() == sha else [f"sha256 of the bytes read {digest.hexdigest()[:12]}... != {sha[:12]}..."]
        commit_verified(tmp, final, size if expect_size is None else expect_size, sha, problems)
        return size, sha
    finally:
        tmp.unlink(missing_ok=True)


def commit_verified(tmp: Path, final: Path, size: int, sha256: str, problems: list[str] | None = None) -> None:
    """Rename ``tmp`` to ``final`` only if the file on disk has ``size`` and ``sha256``.

    Raises ``OSError`` naming every mismatch; the caller removes ``tmp``.
    """
    problems = list(problems or [])
    actual = tmp.stat().st_size
    if actual != size:
        problems.append(f"size {actual} != expected {size}")
    elif sha256_file(tmp) != sha256:
        problems.append(f"sha256 of the written file != expected {sha256[:12]}...")
    if problems:
        raise OSError(f"copy to {final} failed verification: {'; '.join(problems)}")
    os.replace(tmp, final)
