"""DCP's file writer, hashing every byte as it writes it: committing a checkpoint reads nothing back.

Before, the committing rank re-read and hashed every file of the checkpoint after all ranks had
written them, one file after another: for a 1 TB checkpoint at ~1.5 GB/s, 11 minutes per save on
one process, while the bytes had been in memory on every rank. Here each rank hashes (sha256, the
manifest's) the bytes of each file it writes, in the writing thread, while they are in the cache.
Its ``write_data`` returns the digests beside DCP's own write results, so they reach the coordinator
through DCP's gather (``finish``), which takes them out again before it writes ``.metadata``: the
checkpoint's files are DCP's own, readable by any DCP reader.

A file that was not written strictly front to back (a ``seek`` inside it) has no digest: the manifest
hashes that one from disk (``checkpoint.format.write_manifest``), as it does every file a writer
other than this one left in the folder.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
from collections.abc import Generator, Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

Digests = dict[str, tuple[int, str]]
"""A file's name in the checkpoint folder -> (size, sha256 hex) of the bytes written to it."""

_DIGESTS = "__trainyard_digests__"
"""The fqn of the one extra write result that carries a rank's digests to the coordinator."""


class _HashingStream(io.RawIOBase):
    """A file opened for writing whose every byte is hashed on its way in; a seek forfeits the digest."""

    def __init__(self, raw: Any):
        super().__init__()
        self.raw, self.sha, self.size, self.sequential = raw, hashlib.sha256(), 0, True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.sha.update(view)  # sha256 releases the GIL on a block this large: writer threads hash in parallel
        written: int = self.raw.write(view)
        self.size += len(view)
        return written

    def tell(self) -> int:
        return int(self.raw.tell())

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        position = int(self.raw.seek(offset, whence))
        self.sequential = self.sequential and position == self.size
        return position

    def fileno(self) -> int:
        return int(self.raw.fileno())

    def flush(self) -> None:
        if not self.raw.closed:  # DCP closes this stream before the file under it
            self.raw.flush()


class _HashingFileSystem(FileSystem):
    """DCP's local file system, its written streams hashed; what each wrote, by name in the folder."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: Digests = {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = _HashingStream(raw)
            yield stream
            stream.flush()
            whole = stream.sequential and stream.size == os.fstat(raw.fileno()).st_size
        with self._lock:
            if whole:
                self.digests[Path(path).name] = (stream.size, stream.sha.hexdigest())
            else:
                self.digests.pop(Path(path).name, None)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)  # DCP writes .metadata under a temporary name first
        with self._lock:
            if (known := self.digests.pop(Path(path).name, None)) is not None:
                self.digests[Path(new_path).name] = known

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        super().rm_file(path)
        with self._lock:
            self.digests.pop(Path(path).name, None)


class HashingWriter(FileSystemWriter):
    """``FileSystemWriter`` that hashes what it writes; on the coordinator, ``digests`` then holds every
    rank's files and ``.metadata`` once ``dcp.save`` has returned."""

    def __init__(self, path: str | os.PathLike[str], **kwargs: Any):
        super().__init__(path, **kwargs)
        self.fs: _HashingFileSystem = _HashingFileSystem()
        self.digests: Digests = {}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = super().write_data(plan, planner).wait()
        carrier = WriteResult(index=MetadataIndex(_DIGESTS), size_in_bytes=0, storage_data=dict(self.fs.digests))
        done: Future[list[WriteResult]] = Future()
        done.set_result([*results, carrier])
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self.digests = dict(_carried(results))
        super().finish(metadata, [[r for r in rank if r.index.fqn != _DIGESTS] for rank in results])
        self.digests.update(self.fs.digests)  # .metadata, written by finish itself


def _carried(results: list[list[WriteResult]]) -> Iterable[tuple[str, tuple[int, str]]]:
    for rank in results:
        for result in rank:
            if result.index.fqn == _DIGESTS:
                yield from result.storage_data.items()
