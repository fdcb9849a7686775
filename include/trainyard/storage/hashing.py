"""Streaming hashes, and the copies that verify what they wrote."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from trainyard.atomic import open_new, temp_name, write_bytes_atomic
from trainyard.errors import DataError
from trainyard.storage.checksums import FIRST_FETCH, Check, Digester, Hasher, encode, new_hasher
from trainyard.storage.tier import Landed

BLOCK = 1 << 20


class Readable(Protocol):
    """What ``write_verified`` reads from: a file, or an HTTP response body."""

    def read(self, size: int, /) -> bytes: ...


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file."""
    return file_digest(Path(path), "sha256").removeprefix("sha256:")


def file_digest(path: Path, algo: str) -> str:
    """``<algo>:<value>`` of a file, written as a staged manifest records it (hex; base64 for the CRCs)."""
    hasher = new_hasher(algo)
    _feed(path, hasher.update)
    return f"{algo}:{encode(algo, hasher.digest())}"


def _feed(path: Path, update: Callable[[memoryview], object]) -> None:
    """Stream a file in 1 MiB blocks, through one reused buffer, into ``update``."""
    buffer = bytearray(BLOCK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buffer):
            update(view[:n])


def write_verified(
    stream: Readable,
    final: Path,
    check: Check = FIRST_FETCH,
    expect_size: int | None = None,
    where: str | None = None,
    durable: bool = True,
) -> Landed:
    """Copy ``stream`` to ``final`` through a temporary file, verify, then rename.

    The bytes are hashed as they are written, once, with the digest ``check``
    names; the size and that digest must be what the source promised, else a
    ``DataError`` naming ``where`` (default: ``final``) and both digests, and
    nothing is left under ``final``. ``durable``: fsynced before the rename
    (staging passes False when it records the boot instead: ``storage.boot``).
    """
    tmp = temp_name(final)
    digester, size, replaced = Digester(check), 0, False
    try:
        with open_new(tmp) as out:  # makes the folder if missing
            while block := stream.read(BLOCK):
                digester.update(block)
                out.write(block)
                size += len(block)
            out.flush()
            if durable:
                os.fsync(out.fileno())
        landed = settle(check, digester, size, expect_size, where or str(final))
        os.replace(tmp, final)
        replaced = True
        return landed
    finally:
        if not replaced:  # thousands of small objects a stage: no failing unlink after each that landed
            tmp.unlink(missing_ok=True)


def land_bytes(
    data: bytes, final: Path, check: Check, expect_size: int | None, where: str, durable: bool = True
) -> Landed:
    """``write_verified`` for bytes already in memory (a small object's whole body): verified first, so a body
    that fails leaves not even a temporary file; then written whole under ``final`` (``atomic.write_bytes_atomic``)."""
    digester = Digester(check)
    digester.update(data)
    landed = settle(check, digester, len(data), expect_size, where)
    write_bytes_atomic(final, data, durable=durable)
    return landed


def changed_message(src: Path, got: str, expected: str, dest: str) -> str:
    """What an upload refused for a file whose sha256 is not the one expected says (``ContentChanged``)."""
    return (
        f"{src}: its sha256 is {got[:16]}..., not {expected[:16]}... as expected: it changed since it was hashed;"
        f" nothing was stored under {dest}"
    )


def digest_file(path: Path, check: Check) -> Digester:
    """``check``'s digest of a file already written (the ranged download's one hash pass)."""
    digester = Digester(check)
    _feed(path, digester.update)
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


LOCAL_ALGO = "xxh3-128"
"""The hash of local -> local copies: nothing outside trainyard reads it, and it runs at memory speed.
Measured here (268 MB, 4 threads, copy and hash, no fsync): xxh3-128 0.09 s, blake3 0.17 s,
sha256 0.26 s, ``cp -r`` 0.13 s."""
COPY_BLOCK = 1 << 18  # 256 KiB: the block stays in the CPU cache from its hash to its write
_buffers = threading.local()


def copy_file_verified(
    src: Path,
    final: Path,
    expect_size: int | None = None,
    expect_digest: str | None = None,
    algo: str = LOCAL_ALGO,
    durable: bool = True,
) -> tuple[int, str]:
    """Copy a local file to ``final`` in one pass, hashing each block as it is written; verify; rename.

    Returns ``(size, "<algo>:<hex>")``. One read of the source into a reused
    buffer, one hash of that buffer, one write of it: the bytes written are
    the bytes hashed. The copy lands under a temporary name and (``durable``)
    is fsynced before the rename, so ``final`` only ever names a whole, durable
    copy; without ``durable`` it is whole for every reader until a crash
    (staging records the boot instead: ``storage.boot``).
    Refused (``OSError``, nothing left behind) if the source changes during
    the copy, or if the copy does not match ``expect_size``/``expect_digest``;
    ``expect_digest``'s algorithm, where given, is the one computed.
    """
    if expect_digest:
        algo = expect_digest.partition(":")[0]
    hasher = new_hasher(algo)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(final)
    try:
        with open(src, "rb", buffering=0) as fin, open_new(tmp) as fout:
            before = os.fstat(fin.fileno())
            size = _copy_hashing(fin.fileno(), fout.fileno(), hasher)
            after = os.fstat(fin.fileno())
            # A writer still appending or rewriting the source: what we copied is no one version of it.
            if size != before.st_size or (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
                raise OSError(
                    f"copy of {src} to {final} refused: {src} changed during the copy (size {before.st_size} -> "
                    f"{after.st_size}, {size} bytes read); stage again once nothing writes to it"
                )
            if durable:
                os.fsync(fout.fileno())
        digest = f"{algo}:{encode(algo, hasher.digest())}"
        problems = []
        if expect_size is not None and size != expect_size:
            problems.append(f"size {size} != expected {expect_size}")
        if expect_digest and digest != expect_digest:
            problems.append(f"{algo} of the copy != expected {expect_digest.partition(':')[2][:12]}...")
        if problems:
            raise OSError(f"copy of {src} to {final} failed verification: {'; '.join(problems)}")
        os.replace(tmp, final)
        return size, digest
    finally:
        tmp.unlink(missing_ok=True)


def _copy_hashing(fd_in: int, fd_out: int, hasher: Hasher) -> int:
    """Copy ``fd_in`` to ``fd_out`` block by block through one reused buffer, hashing each block; bytes copied.

    The hash of a block runs while it is in the CPU's cache, between its read and
    its write; xxh3, blake3 and sha256 release the GIL on blocks this large, so
    copies in parallel threads use every core.
    """
    if (buffer := getattr(_buffers, "block", None)) is None:
        buffer = _buffers.block = bytearray(COPY_BLOCK)  # one per thread, reused by each copy it makes
    view = memoryview(buffer)
    size = 0
    while n := os.readv(fd_in, [buffer]):
        block = view[:n]
        hasher.update(block)
        while block:
            block = block[os.write(fd_out, block) :]
        size += n
    return size
