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
        sha = digest.hexdigest()
        problems = []
        if expect_size is not None and size != expect_size:
            problems.append(f"size {size} != expected {expect_size}")
        if expect_sha256 is not None and sha != expect_sha256:
            problems.append(f"sha256 {sha[:12]}... != expected {expect_sha256[:12]}...")
        if tmp.stat().st_size != size or sha256_file(tmp) != sha:
            problems.append("the written file differs from the bytes read")
        if problems:
            raise OSError(f"copy to {final} failed verification: {'; '.join(problems)}")
        os.replace(tmp, final)
        return size, sha
    finally:
        tmp.unlink(missing_ok=True)
