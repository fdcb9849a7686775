"""``trainyard upload`` and ``trainyard ls``: a local file or folder into ``s3://bucket/prefix``, and back out as a list.

Each object goes through ``S3Tier.upload`` (sha256 metadata, checked after the
PUT). A run is resumable: an object already at the destination with the same
size and sha256 is skipped, so a run that was interrupted sends only what is
missing when started again. One LIST finds what is there; only objects whose
size matches cost a HEAD (for their sha256) and a local hash.
"""

from __future__ import annotations

import base64
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TextIO

from trainyard.errors import DataError, SpecError
from trainyard.storage.hashing import sha256_file
from trainyard.storage.keys import check_key
from trainyard.storage.s3 import S3Tier
from trainyard.storage.tier import ObjectInfo

MB = 1 << 20


@dataclass(frozen=True)
class LocalFile:
    key: str
    path: Path
    size: int


@dataclass(frozen=True)
class UploadResult:
    uploaded: int
    skipped: int
    bytes_uploaded: int
    bytes_skipped: int
    seconds: float

    def summary(self, dest: str) -> str:
        rate = self.bytes_uploaded / MB / self.seconds if self.seconds > 0 else 0.0
        return (
            f"{dest}: uploaded {self.uploaded} object(s) ({self.bytes_uploaded / MB:.1f} MB),"
            f" skipped {self.skipped} already there ({self.bytes_skipped / MB:.1f} MB),"
            f" in {self.seconds:.1f} s ({rate:.1f} MB/s)"
        )


def split_s3_uri(uri: str) -> tuple[str, str]:
    """(bucket, prefix) of ``s3://bucket/prefix``; a ``SpecError`` saying the expected form otherwise."""
    if not uri.startswith("s3://") or not uri.removeprefix("s3://").split("/", 1)[0]:
        raise SpecError([f"{uri!r}: expected s3://bucket or s3://bucket/prefix"])
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    return bucket, prefix.strip("/")


def local_files(src: Path) -> list[LocalFile]:
    """What to upload: a file under its own name, or every file of a folder under its relative POSIX path."""
    if src.is_file():
        return [LocalFile(check_key(src.name), src, src.stat().st_size)]
    if not src.is_dir():
        raise DataError(f"{src}: no such file or folder")
    found = []
    for root, dirs, files in os.walk(src):
        dirs.sort()
        for name in sorted(files):
            path = Path(root, name)
            if path.is_file():  # a dangling link or a socket is not data
                found.append(LocalFile(check_key(path.relative_to(src).as_posix()), path, path.stat().st_size))
    if not found:
        raise DataError(f"{src}: the folder holds no files")
    return found


def has_sha256(info: ObjectInfo, sha_hex: str | None = None) -> bool:
    """Whether the object carries a sha256 (metadata or S3 checksum); with ``sha_hex``: that one."""
    digest = getattr(info, "digest", None)  # ObjectInfo.digest: "sha256:<hex>" or an S3 checksum's base64
    candidates = [info.sha256] if info.sha256 else []
    if isinstance(digest, str) and digest.startswith("sha256:"):
        candidates.append(digest.removeprefix("sha256:"))
    if sha_hex is None:
        return bool(candidates)
    b64 = base64.b64encode(bytes.fromhex(sha_hex)).decode()
    return any(c.lower() == sha_hex or c == b64 for c in candidates)


class Progress(Protocol):
    def start(self, objects: int, total_bytes: int) -> None: ...
    def advance(self, nbytes: int, skipped: bool) -> None: ...
    def finish(self) -> None: ...


class PlainProgress:
    """Log lines (objects, bytes, MB/s) at most every ``every_s`` seconds, for logs and pipes."""

    def __init__(self, out: TextIO, every_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.out, self.every_s, self.clock = out, every_s, clock
        self.lock = threading.Lock()
        self.done = self.sent = self.objects = self.total = 0
        self.t0 = self.last = 0.0

    def start(self, objects: int, total_bytes: int) -> None:
        self.objects, self.total = objects, total_bytes
        self.t0 = self.last = self.clock()
        print(f"{objects} object(s), {total_bytes / MB:.1f} MB to check", file=self.out, flush=True)

    def advance(self, nbytes: int, skipped: bool) -> None:
        with self.lock:
            self.done += 1
            self.sent += 0 if skipped else nbytes
            now = self.clock()
            if now - self.last >= self.every_s and self.done < self.objects:
                self.last = now
                rate = self.sent / MB / max(now - self.t0, 1e-9)
                print(
                    f"{self.done}/{self.objects} objects, {self.sent / MB:.1f} MB sent, {rate:.1f} MB/s",
                    file=self.out,
                    flush=True,
                )

    def finish(self) -> None:
        pass


class BarProgress:
    """A rich progress bar over bytes, objects counted in its description, for a terminal."""

    def __init__(self) -> None:
        from rich.progress import BarColumn, DownloadColumn, TimeRemainingColumn, TransferSpeedColumn
        from rich.progress import Progress as Bar

        self.bar = Bar(
            "[progress.description]{task.description}",
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
        )
        self.task = self.bar.add_task("upload", total=0)
        self.lock = threading.Lock()
        self.done = self.objects = 0

    def start(self, objects: int, total_bytes: int) -> None:
        self.objects = objects
        self.bar.update(self.task, total=total_bytes, description=f"0/{objects} objects")
        self.bar.start()

    def advance(self, nbytes: int, skipped: bool) -> None:
        with self.lock:
            self.done += 1
            self.bar.update(self.task, advance=nbytes, description=f"{self.done}/{self.objects} objects")

    def finish(self) -> None:
        self.bar.stop()


def progress_for(out: TextIO) -> Progress:
    return BarProgress() if out.isatty() else PlainProgress(out)


def upload(src: Path, tier: S3Tier, jobs: int = 8, progress: Progress | None = None) -> UploadResult:
    """Upload ``src`` (a file or a folder) under ``tier``; objects already there, whole and equal, are skipped."""
    if jobs < 1:
        raise SpecError([f"--jobs {jobs}: must be at least 1"])
    files = local_files(src)
    started = time.monotonic()
    there = {o.key: o for o in tier.list()}  # one LIST (a missing bucket is a DataError naming it)
    progress = progress or PlainProgress(sys.stdout)
    progress.start(len(files), sum(f.size for f in files))
    counts = {"uploaded": 0, "skipped": 0, "bytes_uploaded": 0, "bytes_skipped": 0}
    lock = threading.Lock()

    def one(f: LocalFile) -> None:
        skipped = already_there(tier, f, there.get(f.key))
        if not skipped:
            tier.upload(f.path, f.key)
        with lock:
            counts["skipped" if skipped else "uploaded"] += 1
            counts["bytes_skipped" if skipped else "bytes_uploaded"] += f.size
        progress.advance(f.size, skipped)

    with _finished(progress):
        pool = ThreadPoolExecutor(min(jobs, len(files)))
        try:
            for _ in pool.map(one, files):
                pass
        except BaseException:
            # The first failure ends the run: objects not started yet are not tried (a rerun resumes).
            pool.shutdown(cancel_futures=True)
            raise
        pool.shutdown()
    return UploadResult(seconds=time.monotonic() - started, **counts)


def already_there(tier: S3Tier, f: LocalFile, listed: ObjectInfo | None) -> bool:
    """The same size and the same sha256 at the destination (a HEAD and a local hash only when sizes match)."""
    if listed is None or listed.size != f.size:
        return False
    stored = tier.stat(f.key)
    if stored is None or stored.size != f.size or not has_sha256(stored):
        return False  # written by another tool without a sha256: rewritten, so it carries one
    return has_sha256(stored, sha256_file(f.path))


@contextmanager
def _finished(progress: Progress) -> Iterator[None]:
    try:
        yield
    finally:
        progress.finish()


@dataclass(frozen=True)
class Listed:
    name: str
    """The full object name in the bucket (prefix included), as ``aws s3 ls --recursive`` prints it."""
    size: int
    sha256: bool


def listing(tier: S3Tier, jobs: int = 8) -> list[Listed]:
    """Every object under the tier's prefix, with whether it carries a sha256 (one HEAD each, in parallel)."""
    objects = tier.list()
    base = f"{tier.prefix}/" if tier.prefix else ""

    def one(o: ObjectInfo) -> Listed:
        stored = tier.stat(o.key)
        return Listed(base + o.key, o.size, bool(stored and has_sha256(stored)))

    if not objects:
        return []
    with ThreadPoolExecutor(min(jobs, len(objects))) as pool:
        return list(pool.map(one, objects))
