"""Read a checkpoint file once, front to back, hashing every byte that is handed on to be checked.

A rank can change a file between two opens (or rewrite it in place between two reads), so a check that
hashes in one pass and parses in another proves nothing about the bytes it parsed (issue 49). Every
reader that interprets a checkpoint file (the inspector's DCP and ``torch.save`` loaders,
``checkpoint.safetensor``) reads it through ``Once``: the bytes it parses are the bytes it hashed, and the
digest it reports (size and sha256 of everything read, to the end of the file) is compared with the
manifest. Reads go forward only (a range before the position cannot be read again), so each byte is read
from the disk once, as a plain hash would; the hash runs on a second thread while the caller parses.

The path is opened without following a link at any level below the checkpoint's folder, and must be a
regular file (a FIFO or a device would block or never end). Torch-free: the orchestrator uses it too.
"""

from __future__ import annotations

import hashlib
import os
import stat
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import IO

CHUNK = 64 << 20
"""Bytes read at a time where nothing needs them whole (skipped ranges, the rest of a file)."""
_pools: dict[int, ThreadPoolExecutor] = {}


def _hasher() -> ThreadPoolExecutor:
    # One per process, made on first use: a fork (the inspector's server forks per checkpoint) inherits no
    # thread, so it must never submit to its parent's pool. One thread per core: files read side by side hash
    # side by side (each file's updates stay in order).
    pool = _pools.get(os.getpid())
    if pool is None:
        pool = _pools[os.getpid()] = ThreadPoolExecutor(max_workers=os.cpu_count() or 2, thread_name_prefix="sha256")
    return pool


def open_under(folder: Path, rel: str) -> int:
    """A read descriptor of ``folder/rel``, no link followed below ``folder`` (``OSError`` otherwise)."""
    parts = PurePosixPath(rel).parts
    if not parts or PurePosixPath(rel).is_absolute() or ".." in parts:
        raise OSError(f"{rel!r} is not a path inside the checkpoint")
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts[:-1]:
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = inner
        # O_NONBLOCK: opening a FIFO planted under the name must not wait for a writer.
        return os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    finally:
        os.close(fd)


class Once:
    """One file read forward once; ``read`` returns bytes that are hashed, ``digest`` the size and sha256 of
    every byte read (``finish`` reads to the end first)."""

    def __init__(self, folder: Path, rel: str):
        fd = open_under(folder, rel)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(f"{rel} is not a regular file")
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        self.size = st.st_size
        """The size when opened (the file may still change: the digest covers what was read)."""
        self.pos = 0
        self._fh: IO[bytes] = os.fdopen(fd, "rb")
        self._sha = hashlib.sha256()
        self._pending: Future[None] | None = None

    def __enter__(self) -> Once:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _hash(self, data: bytes) -> None:
        # One update in flight at a time: the order is kept and at most two reads are held in memory.
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        if len(data) > 1 << 16:  # hashlib lets go of the GIL for large buffers: the caller parses meanwhile
            self._pending = _hasher().submit(self._sha.update, data)
        else:
            self._sha.update(data)

    def read(self, length: int) -> bytes:
        """The next ``length`` bytes (fewer at the end of the file), hashed."""
        data = self._fh.read(length)
        self.pos += len(data)
        self._hash(data)
        return data

    def skip_to(self, offset: int) -> None:
        """Read (and hash) up to ``offset``; ``ValueError`` if that is behind the position."""
        if offset < self.pos:
            raise ValueError(f"byte {offset} is behind the bytes already read ({self.pos})")
        while self.pos < offset:
            if not self.read(min(CHUNK, offset - self.pos)):
                return  # the end of the file came first

    def finish(self) -> tuple[int, str]:
        """Read the rest of the file; its size and sha256 as read."""
        while self.read(CHUNK):
            pass
        return self.digest()

    def digest(self) -> tuple[int, str]:
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        return self.pos, self._sha.hexdigest()

    def close(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        self._fh.close()
