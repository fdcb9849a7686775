"""The run ledger: append-only JSON-lines event logs per pipeline run, read back as one.

The orchestrator (stages, supervisor) appends to the run's ``events.jsonl``;
every other writer (rank 0 of the training workload, a drill) appends to a
file of its own, ``events.d/<writer>.jsonl`` (``EventWriter``), since the run
folder may be a shared volume that several hosts write at once and
``O_APPEND`` is atomic on one machine only. ``Ledger.events()`` merges the
files by time stamp (stable: equal times keep ``events.jsonl`` first, then the
writers' files by name; each file keeps its own order). Reports, SLO figures
and resumption read it back; nothing is inferred from log text. One event is
one ``write`` on an ``O_APPEND`` descriptor.

The writers' files are written by training code (untrusted; docs/architecture.md, untrusted input):
only regular files are read there (a link, FIFO or folder dropped into
``events.d`` is skipped with a warning, never followed or waited on), and only
the ``train`` events a training process writes (``schema.WORKER_EVENTS``, their
fields as declared) are taken from them, so a pod cannot forge the orchestrator's decisions.
Each is read in bounded chunks and only so far (``trainyard.events.tail``), and a
name or line a pod chose is quoted in a warning only as printable text (``trainyard.text``).

Every append is checked against the event schema (``trainyard.events.schema``):
an undeclared kind or a wrongly typed field raises ``EventSchemaError`` where
it is written. Readers keep what they parsed (``trainyard.events.tail``): a
ledger is read once, then only the bytes appended since; a malformed line is
skipped with one warning naming the file and the line.

An append that the disk does not take whole raises ``LedgerWriteError``: an
event is recorded or the caller hears that it was not, never lost silently.
The bytes that did land are closed with a newline (right away, or by the next
append, which checks the file's last byte), so they stay one malformed line
that readers skip with a warning and never swallow the next event. (When all
but the newline landed, closing the line completes that event.) The ledger is
opened without following links (``trainyard.atomic``): the run folder is
shared with training code.
"""

from __future__ import annotations

import errno
import hashlib
import heapq
import itertools
import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any

from trainyard.atomic import append_fd
from trainyard.events import schema
from trainyard.events.tail import WORKER_FILE_BYTES, WRITERS_BYTES, Events, read
from trainyard.text import printable

LEDGER_FILE = "events.jsonl"
EVENTS_DIR = "events.d"
"""Beside ``events.jsonl``: one ``<writer>.jsonl`` per writer other than the orchestrator."""
MAX_WRITERS = 10_000
"""Writer files read per run; more (training code making files) are left out with a warning."""
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
log = logging.getLogger("trainyard.events.ledger")


_KEEP = 200  # characters of an id kept in its folder name; with the suffix, well under NAME_MAX (255)
_MARK = "~"  # never in a kept name: a name with a digest cannot equal an id kept as it is


def safe_name(text: str) -> str:
    """A file-system-safe folder name for a DAG or run id, distinct for distinct ids.

    An id that is already safe (letters, digits, '.', '_', '-'; no '.' or '_'
    at either end) is its own name, so existing folders keep theirs. Any other
    id is cleaned and gets ``~`` and a digest of the id itself: cleaning is
    lossy (``nightly_`` and ``nightly``, ``a/b`` and ``a_b``), and two ids must
    never share a folder (``manual__2026-11-29T02:00:00+00:00`` ->
    ``manual__2026-11-29T02_00_00_00_00~<16 hex>``).
    """
    cleaned = _UNSAFE.sub("_", text).strip("._")
    if cleaned == text and len(text) <= _KEEP:
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{cleaned[:_KEEP] or '_'}{_MARK}{digest}"


def legacy_name(text: str) -> str:
    """The folder name trainyard gave an id before names were made distinct (a lossy cleaning).

    Only for finding runs written then; such a folder is used only when its
    ``spec.json`` names the same ids, since another id may have shared it.
    """
    return _UNSAFE.sub("_", text).strip("._") or "_"


def run_dir(runs_root: str | Path, dag_id: str, run_id: str) -> Path:
    """Where one run keeps its files: keyed by DAG and run, so runs never share files."""
    return Path(runs_root) / safe_name(dag_id) / safe_name(run_id)


class LedgerWriteError(OSError):
    """An event the ledger file did not take whole (a full disk, a quota): it is not recorded."""


class Ledger:
    """Append the orchestrator's events of one run (``<run_dir>/events.jsonl``) and read all of the run's."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    @classmethod
    def in_dir(cls, directory: str | Path) -> Ledger:
        return cls(Path(directory) / LEDGER_FILE)

    @property
    def events_dir(self) -> Path:
        """Where the other writers' files are (``TRAINYARD_EVENTS_DIR``)."""
        return self.path.parent / EVENTS_DIR

    def writer(self, name: str) -> EventWriter:
        """The file of writer ``name`` in this run's ``events.d``."""
        return EventWriter.in_dir(self.events_dir, name)

    def append(self, stage: str, event: str, **fields: Any) -> dict[str, Any]:
        return _append(self.path, stage, event, fields)

    def events(self, stage: str | None = None, event: str | None = None) -> Iterator[dict[str, Any]]:
        """Events of every file in time order, optionally filtered (copies: the parsed events are shared)."""
        for record in _merged(self.path, self.events_dir):
            if stage is not None and record.get("stage") != stage:
                continue
            if event is not None and record.get("event") != event:
                continue
            yield dict(record)

    def stamp(self) -> Hashable:
        """Changes whenever an event may have been added to any file (a key for caches of what was read)."""
        own = (self.path.name, *_size_and_time(self.path, strict=True))  # a ledger gone: FileNotFoundError
        return (own, *((p.name, *_size_and_time(p)) for p in _writer_files(self.events_dir)))

    def events_since(self, position: int) -> tuple[list[dict[str, Any]], int]:
        """The orchestrator's own events (``events.jsonl``, not the writers' files) after the first ``position`` of them, and the position after those (copies).

        A reader that keeps the position parses and copies only what was appended since its last look.
        """
        records, _ = read(self.path)
        new = records[position:] if isinstance(records, list) else list(islice(records, position, None))
        return [dict(r) for r in new], position + len(new)


class EventWriter:
    """Append the events of one writer other than the orchestrator, to its own file in ``events.d``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    @classmethod
    def in_dir(cls, events_dir: str | Path, name: str) -> EventWriter:
        return cls(Path(events_dir) / f"{safe_name(name)}.jsonl")

    def append(self, stage: str, event: str, **fields: Any) -> dict[str, Any]:
        return _append(self.path, stage, event, fields)


def _append(path: Path, stage: str, event: str, fields: dict[str, Any]) -> dict[str, Any]:
    schema.check(stage, event, fields)  # a kind or field the schema does not declare: a bug, raised here
    record = {"ts": time.time(), "stage": stage, "event": event, **fields}
    line = (json.dumps(record, sort_keys=True, default=str) + "\n").encode()
    fd = append_fd(path)
    try:
        _write(path, fd, _after_tear(fd) + line, f"{stage}/{event}")
    finally:
        os.close(fd)
    return record


def _write(path: Path, fd: int, data: bytes, what: str) -> None:
    """One ``write`` of the whole line, or ``LedgerWriteError``: a short write is never retried in
    place, since another process's line could land between the two halves."""
    try:
        written = os.write(fd, data)
    except OSError as exc:
        raise LedgerWriteError(
            exc.errno,
            f"ledger {path}: event {what} not recorded ({exc.strerror});"
            " free space on that file system, then retry the task",
        ) from None
    if written == len(data):
        return
    try:
        os.write(fd, b"\n")  # close the torn line now; if this fails too, the next append does
    except OSError:
        pass
    raise LedgerWriteError(
        errno.ENOSPC,
        f"ledger {path}: the file system took only {written} of"
        f" {len(data)} bytes of event {what}, so it is not recorded (the partial line is"
        " skipped by readers); free space on that file system, then retry the task",
    )


def _after_tear(fd: int) -> bytes:
    """A newline to write first when the file does not end with one: an earlier append was torn."""
    size = os.fstat(fd).st_size
    return b"\n" if size and os.pread(fd, 1, size - 1) != b"\n" else b""


# ---------------------------------------------------------------- the writers' files, merged


_merges: OrderedDict[Path, tuple[Hashable, list[dict[str, Any]]]] = OrderedDict()
_merges_lock = threading.Lock()
MERGES_KEPT = 8  # runs whose merged events are kept (their events are the tails' own, not copies)
_refusals: set[tuple[Path, str]] = set()


def _ts(record: dict[str, Any]) -> float:
    return float(record["ts"])


def _merged(path: Path, folder: Path) -> Events:
    """The events of ``path`` and of the writers' files in ``folder``, by time stamp (stable)."""
    own = read(path)
    files = _writer_files(folder)
    if not files:
        return own[0]
    parts, left = [own], WRITERS_BYTES
    for file in files:
        try:
            parts.append(read(file, worker=True, budget=left))
        except OSError as exc:  # a link, FIFO or hard link planted there by training code
            _refuse(file, str(exc))
        left = max(0, left - max(0, min(_size_and_time(file)[0], WORKER_FILE_BYTES)))  # what it may have cost
    versions = tuple(version for _, version in parts)
    if any(version is None for version in versions):
        return heapq.merge(*(events for events, _ in parts), key=_ts)
    # Only the events counted in each version: another reader may be appending to a tail's list.
    counted = [itertools.islice(events, version[1]) for (events, version) in parts if version is not None]
    key, signature = path.absolute(), (tuple(f.name for f in files), versions)
    with _merges_lock:
        cached = _merges.pop(key, None)
        if cached is None or cached[0] != signature:
            cached = (signature, list(heapq.merge(*counted, key=_ts)))
        _merges[key] = cached  # most recently read last
        while len(_merges) > MERGES_KEPT:
            _merges.popitem(last=False)
    return cached[1]


def _writer_files(folder: Path) -> list[Path]:
    """The regular ``*.jsonl`` files in ``folder``, by name; anything else there is skipped with a warning."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    except OSError as exc:  # ELOOP: a link; ENOTDIR: a file
        _refuse(folder, f"not a folder ({exc.strerror}); no writer's events are read from it")
        return []
    try:
        with os.scandir(fd) as entries:
            found = sorted((e.name, e.is_file(follow_symlinks=False)) for e in entries
                           if e.name.endswith(".jsonl") and not e.name.startswith("."))  # fmt: skip
    finally:
        os.close(fd)
    files: list[Path] = []
    for name, regular in found:
        if not regular:
            _refuse(folder / name, "a link, FIFO or folder, not a regular file; skipped")
        elif len(files) < MAX_WRITERS:
            files.append(folder / name)
        else:
            _refuse(folder, f"holds more than {MAX_WRITERS} writers' files; the rest are left out")
            break
    return files


def _refuse(path: Path, why: str) -> None:
    """Warn once per file and reason: a reader reads the ledger again and again."""
    if (path, why) not in _refusals:
        _refusals.add((path, why))
        log.warning("ledger: %s: %s", printable(path, 4096), printable(why, 4096))  # names a pod chose


def _size_and_time(path: Path, strict: bool = False) -> tuple[int, int]:
    try:
        st = path.lstat()
    except FileNotFoundError:
        if strict:
            raise
        return -1, -1
    return st.st_size, st.st_mtime_ns
