"""Staging: copy a dataset from a cold tier to a folder in the hot tier.

Plan, make room, transfer, commit. Only objects that are missing or changed
are copied; each lands under a temporary name, is verified and renamed, and
is then recorded in a journal, so a stage killed midway and run again skips
what it finished. The staged manifest is written last: a folder whose
manifest lists a file holds that file, whole.

Where the boot id is known (Linux), copies are not fsynced: the manifest and
each journal line record the boot instead, and one from another boot (a crash
or reboot since, which can take back unsynced copies) is not trusted: its
objects are copied again (``storage.boot``). Elsewhere each copy, and each
folder before its journal lines, is fsynced.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import stat
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from trainyard.atomic import fsync_dir, open_append, read_json, write_json_atomic
from trainyard.errors import DataError
from trainyard.events.ledger import Ledger
from trainyard.storage.boot import BOOT_ID, current_boot_id, entry_digest, trusted
from trainyard.storage.hot import JOURNAL, STAGED_MANIFEST, HotRoom, make_room, pin, touch
from trainyard.storage.keys import check_key, key_path
from trainyard.storage.tier import Landed, ObjectInfo, Tier

log = logging.getLogger(__name__)
# Objects below this size are latency-bound (one request each, a few KB): they run on more threads,
# SMALL_PER_STREAM per unit of ``concurrency`` (a large S3 object holds that many connections: its ranges).
SMALL_OBJECT = 1 << 20
SMALL_PER_STREAM = 4
# The journal is appended in batches (whatever landed while the last one was written), each after one
# fsync per folder its objects landed in, and at least this often while objects keep landing.
JOURNAL_EVERY_S = 0.5


@dataclass(frozen=True)
class StageResult:
    hot_dir: Path
    files: int
    bytes_total: int
    transferred: int
    bytes_transferred: int
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "hot_dir": str(self.hot_dir)}


def read_staged(hot_dir: Path) -> dict[str, dict[str, Any]]:
    """The committed manifest's entries by key (empty if nothing was staged)."""
    files: dict[str, dict[str, Any]] = _read_manifest(hot_dir).get("files", {})
    return files


def _read_manifest(hot_dir: Path) -> dict[str, Any]:
    """The committed manifest (``files``, and ``boot_id`` where it was written without fsyncs); {} if none."""
    path = hot_dir / STAGED_MANIFEST
    if not path.exists():
        return {}
    try:
        manifest = read_json(path)
        if not isinstance(manifest.get("files"), dict):
            raise KeyError("files")
        return dict(manifest)
    except (ValueError, KeyError, OSError, AttributeError):
        log.warning("%s is unreadable; staging everything again", path)
        return {}


def manifest_entry(landed: Landed, version: str) -> dict[str, Any]:
    """A staged manifest entry: size, version, digest and how it was checked (plus ``sha256`` where it is one)."""
    entry: dict[str, Any] = {"size": landed.size, "version": version, "digest": landed.digest, "check": landed.check}
    algo, _, value = landed.digest.partition(":")
    if algo == "sha256":
        entry["sha256"] = value  # quality/dataset.py shows it and compares shards by it
    return entry


def recorded_digest(entry: dict[str, Any] | None, obj: ObjectInfo) -> str | None:
    """The digest an earlier stage recorded for this very version of ``obj``, to check a re-fetch against."""
    if entry is None or entry.get("version") != obj.version or entry.get("size") != obj.size:
        return None
    return entry_digest(entry)


def _journal(hot_dir: Path, boot_id: str | None) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Objects a killed stage finished before it could commit the manifest: (trusted, from another boot).

    A line from another boot (``storage.boot.trusted``) may name a copy a crash took back: its object
    is copied again; its digest still says what the source held.
    """
    entries: dict[str, dict[str, Any]] = {}
    earlier: dict[str, dict[str, Any]] = {}
    path = hot_dir / JOURNAL
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
                key = record.pop("key")
            except (ValueError, KeyError, AttributeError):
                continue  # a torn last line: that object is simply copied again
            written_in = record.pop(BOOT_ID, None)
            if trusted(written_in, boot_id):
                entries[key] = record
                earlier.pop(key, None)
            else:
                earlier[key] = record
                entries.pop(key, None)
    return entries, earlier


def plan(objects: list[ObjectInfo], staged: dict[str, dict[str, Any]], hot_dir: Path) -> list[ObjectInfo]:
    """The objects to transfer: new, changed at the source, or missing or resized in the hot tier.

    One pass over the listing against the manifest, one ``lstat`` per object
    the manifest says is there, and one per folder above those: a staged file
    that is gone, resized or a link (or under a folder that became a link) is
    copied again, through ``key_path``'s check that it stays inside ``hot_dir``.
    """
    todo = []
    folders: dict[str, bool] = {}  # folder key -> a real folder (not a link), looked at once
    for obj in objects:
        entry = staged.get(obj.key)
        if entry is None or entry["version"] != obj.version or entry["size"] != obj.size:
            todo.append(obj)
            continue
        if _staged_size(hot_dir, obj.key, folders) != obj.size:
            todo.append(obj)
    return todo


def _staged_size(hot_dir: Path, key: str, folders: dict[str, bool]) -> int | None:
    """The size of ``key``'s regular file, reached through real folders only; None otherwise.

    No link below ``hot_dir`` means the path cannot leave it, so the full
    ``resolve`` of ``key_path`` (a few ``lstat`` calls per path part) is needed
    only where a link is found.
    """
    parts = PurePosixPath(check_key(key)).parts
    for depth in range(1, len(parts)):
        folder = "/".join(parts[:depth])
        if folder not in folders:
            try:
                folders[folder] = stat.S_ISDIR(os.lstat(hot_dir.joinpath(*parts[:depth])).st_mode)
            except OSError:
                folders[folder] = False
        if not folders[folder]:
            key_path(hot_dir, key)  # a link that leaves the hot folder is refused now, not later
            return None
    try:
        st = os.lstat(hot_dir.joinpath(*parts))
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


class Progress:
    """Bytes, MB/s and ETA in the task log (every few seconds) and the ledger (less often)."""

    def __init__(self, total_bytes: int, total_objects: int, ledger: Ledger | None, log_every_s: float = 2.0):
        self.total_bytes, self.total_objects, self.ledger = total_bytes, total_objects, ledger
        self.bytes = self.objects = 0
        self.started = self.logged = self.recorded = time.monotonic()
        self.log_every_s = log_every_s

    def add(self, nbytes: int) -> None:
        self.bytes += nbytes
        self.objects += 1
        now = time.monotonic()
        done = self.objects == self.total_objects
        if done or now - self.logged >= self.log_every_s:
            self.logged = now
            log.info("%s", self.line(now))
        if self.ledger and (done or now - self.recorded >= 5 * self.log_every_s):
            self.recorded = now
            self.ledger.append(
                "stage_dataset",
                "progress",
                objects=self.objects,
                bytes=self.bytes,
                total_bytes=self.total_bytes,
                mb_per_s=round(self.rate(now) / 1e6, 2),
            )

    def rate(self, now: float) -> float:
        return self.bytes / max(now - self.started, 1e-6)

    def line(self, now: float) -> str:
        rate = self.rate(now)
        eta = (self.total_bytes - self.bytes) / rate if rate else float("inf")
        return (
            f"staged {self.objects}/{self.total_objects} objects, {self.bytes / 1e6:.1f} of "
            f"{self.total_bytes / 1e6:.1f} MB, {rate / 1e6:.1f} MB/s, ETA {eta:.1f} s"
        )


def stage(
    source: Tier,
    hot_dir: Path,
    ledger: Ledger | None = None,
    concurrency: int = 4,
    room: HotRoom | None = None,
) -> StageResult:
    started = time.monotonic()
    objects = [o for o in source.list() if o.key != STAGED_MANIFEST]
    if not objects:
        raise DataError(f"{source.uri} holds no objects to stage; check dataset.source and the partition date")
    boot_id = current_boot_id()
    durable = boot_id is None  # no boot to record: each copy is fsynced instead
    manifest = _read_manifest(hot_dir)
    staged: dict[str, dict[str, Any]] = manifest.get("files", {})
    journaled, journal_earlier = _journal(hot_dir, boot_id)
    manifest_trusted = trusted(manifest.get(BOOT_ID), boot_id)
    known = {**(staged if manifest_trusted else {}), **journaled}
    earlier = {k: e for k, e in {**({} if manifest_trusted else staged), **journal_earlier}.items() if k not in known}
    if earlier:
        _say_earlier_boot(hot_dir, manifest.get(BOOT_ID), len(staged) if not manifest_trusted else 0, earlier, ledger)
    recorded = {**earlier, **known}  # a digest says what the source held, whichever boot recorded it
    todo = [
        dataclasses.replace(o, digest=recorded_digest(recorded.get(o.key), o)) for o in plan(objects, known, hot_dir)
    ]
    dests = {o.key: key_path(hot_dir, o.key) for o in todo}  # a key escaping the hot folder fails here
    need = sum(o.size for o in todo)
    if ledger:
        ledger.append(
            "stage_dataset", "plan", source=source.uri, objects=len(objects), to_transfer=len(todo), bytes=need
        )
    log.info(
        "staging %s -> %s: %d objects, %d to transfer (%.1f MB)",
        source.uri,
        hot_dir,
        len(objects),
        len(todo),
        need / 1e6,
    )
    if room:
        pin(hot_dir, room.holder)  # before making room, so a parallel stage cannot evict us
        make_room(room, hot_dir, need - sum(recorded[o.key]["size"] for o in todo if o.key in recorded), ledger)
    touch(hot_dir)

    todo_keys = {o.key for o in todo}
    entries = {o.key: known[o.key] for o in objects if o.key not in todo_keys}
    progress = Progress(need, len(todo), ledger)
    if todo or set(staged) != set(entries):
        if not durable and manifest and manifest.get(BOOT_ID) is None and todo_keys & set(staged):
            # A manifest from fsyncing staging is trusted in any boot: before unsynced copies replace files
            # it lists, it says this boot, so a crash midway makes the next stage copy them all again.
            write_json_atomic(hot_dir / STAGED_MANIFEST, {**manifest, BOOT_ID: boot_id})
        _transfer(source, hot_dir, todo, dests, entries, progress, concurrency, boot_id)
        _say_trusted(source, [o.key for o in todo if entries[o.key].get("check") == "first-fetch"], ledger)
        written = {"source": source.uri, "staged_at": time.time(), "files": entries}
        write_json_atomic(hot_dir / STAGED_MANIFEST, written if durable else {**written, BOOT_ID: boot_id})
        os.unlink(hot_dir / JOURNAL)
        for stale in set(staged) - set(entries):
            key_path(hot_dir, stale).unlink(missing_ok=True)  # gone at the source: not part of this dataset
    result = StageResult(
        hot_dir=hot_dir,
        files=len(objects),
        bytes_total=sum(o.size for o in objects),
        transferred=len(todo),
        bytes_transferred=progress.bytes,
        seconds=round(time.monotonic() - started, 3),
    )
    if ledger:
        ledger.append("stage_dataset", "staged", **result.as_dict())
    return result


def concurrency_for(todo: list[ObjectInfo], concurrency: int) -> tuple[int, int]:
    """Threads for large and for small objects: ``concurrency`` streams, and more for requests of a few KB.

    A small object's time is round trips, not bandwidth, so ``SMALL_PER_STREAM``
    of them per stream keep the link (and the server) busy where ``concurrency``
    would leave it idle between requests: the connections ``concurrency`` large
    objects would hold with their ranges. ``concurrency: 1`` stays one object at
    a time (a server that must not see parallel requests).
    """
    large = sum(1 for o in todo if o.size >= SMALL_OBJECT)
    small = len(todo) - large
    per_stream = SMALL_PER_STREAM if concurrency > 1 else 1
    return (min(concurrency, large), min(concurrency * per_stream, 64, small))


class _Journal:
    """Finished objects, appended in batches to the stage's journal.

    A journal line says "this file is whole". With ``boot_id`` None, its data
    was fsynced by the tier's copy and its rename is made durable here (one
    fsync per folder per batch) before the line is written, so a crash can lose
    lines (those objects are copied again), never keep a line whose file is not
    there. With a ``boot_id``, nothing is fsynced: each line names the boot, and
    a line from another boot is not trusted (``_journal``).
    """

    def __init__(self, hot_dir: Path, boot_id: str | None = None):
        self.file = open_append(hot_dir / JOURNAL, "a")
        self.boot_id = boot_id
        self.lines: list[str] = []
        self.folders: set[Path] = set()
        self.flushed = time.monotonic()

    def add(self, key: str, path: Path, entry: dict[str, Any]) -> None:
        line = {"key": key, **entry} if self.boot_id is None else {"key": key, **entry, BOOT_ID: self.boot_id}
        self.lines.append(json.dumps(line) + "\n")
        if self.boot_id is None:
            self.folders.add(path.parent)
        if time.monotonic() - self.flushed >= JOURNAL_EVERY_S:
            self.flush()

    def flush(self) -> None:
        if not self.lines:
            return
        for folder in sorted(self.folders):
            fsync_dir(folder)
        self.file.write("".join(self.lines))
        self.file.flush()
        self.lines, self.folders, self.flushed = [], set(), time.monotonic()

    def close(self) -> None:
        self.file.close()


def _transfer(
    source: Tier,
    hot_dir: Path,
    todo: list[ObjectInfo],
    dests: dict[str, Path],
    entries: dict[str, dict[str, Any]],
    progress: Progress,
    concurrency: int,
    boot_id: str | None = None,
) -> None:
    """Copy ``todo`` in parallel, journaling objects in batches as they land (``entries`` is filled in).

    Large objects run ``concurrency`` at a time, small ones on a pool of their own
    (``concurrency_for``), so a few large objects never queue thousands of small ones.
    On return every object copied is whole under its final name: durable, or (with a
    ``boot_id``) in this boot's page cache, unsynced.
    """
    large_threads, small_threads = concurrency_for(todo, concurrency)
    durable = boot_id is None
    journal = _Journal(hot_dir, boot_id)
    pools = [ThreadPoolExecutor(max_workers=max(1, n)) for n in (large_threads, small_threads)]
    futures: dict[Future[Landed], ObjectInfo] = {}

    def record(future: Future[Landed]) -> None:
        obj = futures.pop(future)
        landed = future.result()
        entries[obj.key] = manifest_entry(landed, obj.version)
        journal.add(obj.key, dests[obj.key], entries[obj.key])
        progress.add(landed.size)

    large = sorted((o for o in todo if o.size >= SMALL_OBJECT), key=lambda o: -o.size)  # the longest start first
    # While each of the large pool's threads has an object of its own, ranges would only add requests (and on
    # a server that reads the whole object for each range, work): only the last objects, which would leave
    # threads idle, may come in parallel ranges.
    whole = len(large) - large_threads
    try:
        for i, obj in enumerate([*large, *(o for o in todo if o.size < SMALL_OBJECT)]):
            pool = pools[obj.size < SMALL_OBJECT]
            split = i >= whole
            futures[pool.submit(source.download, obj.key, dests[obj.key], obj, durable=durable, split=split)] = obj
        arrivals: queue.SimpleQueue[Future[Landed]] = queue.SimpleQueue()  # O(1) per object, unlike wait()
        for future in futures:
            future.add_done_callback(arrivals.put)
        for _ in range(len(futures)):
            try:
                future = arrivals.get_nowait()
            except queue.Empty:
                journal.flush()  # nothing more has landed: make the batch durable before waiting
                future = arrivals.get()
            record(future)
    except BaseException:
        for future in futures:
            future.cancel()  # one failure ends the stage; queued transfers would only fail slowly
        for pool in pools:
            pool.shutdown(wait=True)  # those already running finish, and what they landed is kept for a rerun
        for future in [f for f in futures if not f.cancelled() and f.exception() is None]:
            record(future)
        raise
    finally:
        for pool in pools:
            pool.shutdown(wait=True)
        journal.flush()
        journal.close()


def _say_earlier_boot(
    hot_dir: Path,
    manifest_boot: object,
    manifest_objects: int,
    earlier: dict[str, dict[str, Any]],
    ledger: Ledger | None,
    shown: int = 20,
) -> None:
    """What an earlier boot staged without fsyncs is copied again: say so, once per stage."""
    log.warning(
        "%s: %d objects were staged in an earlier boot (manifest boot %s; %d from the manifest, the rest from"
        " the journal) without fsyncs: a crash or reboot since may have taken them back; copying them again: %s",
        hot_dir,
        len(earlier),
        manifest_boot,
        manifest_objects,
        ", ".join(sorted(earlier)[:shown]) + (" ..." if len(earlier) > shown else ""),
    )
    if ledger:
        ledger.append(
            "stage_dataset",
            "earlier_boot",
            hot_dir=str(hot_dir),
            objects=len(earlier),
            manifest_objects=manifest_objects,
            keys=sorted(earlier)[:shown],
        )


def _say_trusted(source: Tier, keys: list[str], ledger: Ledger | None, shown: int = 20) -> None:
    """Objects with nothing to check them against were trusted as they came: say so, once per stage."""
    if not keys:
        return
    log.warning(
        "%s: %d objects have no checksum, sha256 metadata or MD5 ETag to check; trusted on this first fetch,"
        " their sha256 recorded in the staged manifest and checked on every later fetch: %s",
        source.uri,
        len(keys),
        ", ".join(keys[:shown]) + (" ..." if len(keys) > shown else ""),
    )
    if ledger:
        ledger.append(
            "stage_dataset", "trust_on_first_fetch", source=source.uri, objects=len(keys), keys=sorted(keys)[:shown]
        )


def upload_tree(src: Path, tier: Tier, prefix: str, last: str | None = None, concurrency: int = 4) -> int:
    """Upload every file under ``src`` to ``prefix/``, in parallel, verified; ``last`` goes after all others.

    Returns the bytes uploaded. ``last`` is a manifest: without it the copy does not exist.
    """
    keys = [p.relative_to(src).as_posix() for p in sorted(src.rglob("*")) if p.is_file()]
    first = [k for k in keys if k != last]
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        sizes = list(pool.map(lambda k: tier.upload(src / k, f"{prefix}/{k}")[0], first))
    if last is not None:
        sizes.append(tier.upload(src / last, f"{prefix}/{last}")[0])
    return sum(sizes)
