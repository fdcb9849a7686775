"""The run ledger: an append-only JSON-lines event log per pipeline run.

Every stage, the supervisor and rank 0 of the training workload append events
here; reports, SLO figures and resumption read it back. Nothing is inferred
from log text. One event is one ``write`` on an ``O_APPEND`` descriptor, so
lines from several processes never interleave on a local file system.

Readers keep what they parsed: a ledger is read once, then only the bytes
appended since (the view and the checkpoint validator read the same ledger
again and again while a run grows). A malformed line is skipped with one
warning naming the file and the line. A line without its newline at the end
of the file is not read (its writer may be mid-write) and is warned about once.

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
import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

from trainyard.atomic import append_fd, open_regular

LEDGER_FILE = "events.jsonl"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
CACHE_BYTES = 64 * 2**20
"""Ledger text kept parsed in one process (the least recently read ledgers go first); a bigger
ledger is read through each time, as before."""
_HEAD = 64  # bytes that identify a file: its first event's time stamp is in them
log = logging.getLogger("trainyard.ledger")


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
    """Append and read events of one run (``<run_dir>/events.jsonl``)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    @classmethod
    def in_dir(cls, directory: str | Path) -> Ledger:
        return cls(Path(directory) / LEDGER_FILE)

    def append(self, stage: str, event: str, **fields: Any) -> dict[str, Any]:
        record = {"ts": time.time(), "stage": stage, "event": event, **fields}
        line = (json.dumps(record, sort_keys=True, default=str) + "\n").encode()
        fd = append_fd(self.path)
        try:
            self._write(fd, _after_tear(fd) + line, f"{stage}/{event}")
        finally:
            os.close(fd)
        return record

    def _write(self, fd: int, data: bytes, what: str) -> None:
        """One ``write`` of the whole line, or ``LedgerWriteError``: a short write is never retried in
        place, since another process's line could land between the two halves."""
        try:
            written = os.write(fd, data)
        except OSError as exc:
            raise LedgerWriteError(
                exc.errno,
                f"ledger {self.path}: event {what} not recorded ({exc.strerror});"
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
            f"ledger {self.path}: the file system took only {written} of"
            f" {len(data)} bytes of event {what}, so it is not recorded (the partial line is"
            " skipped by readers); free space on that file system, then retry the task",
        )

    def events(self, stage: str | None = None, event: str | None = None) -> Iterator[dict[str, Any]]:
        """Events in write order, optionally filtered (copies: the parsed events are shared)."""
        for record in _read(self.path):
            if stage is not None and record.get("stage") != stage:
                continue
            if event is not None and record.get("event") != event:
                continue
            yield dict(record)

    def events_since(self, position: int) -> tuple[list[dict[str, Any]], int]:
        """This file's events after the first ``position`` of them, and the position after those (copies).

        A reader that keeps the position parses and copies only what was appended since its last look.
        """
        records = _read(self.path)
        new = records[position:] if isinstance(records, list) else list(islice(records, position, None))
        return [dict(r) for r in new], position + len(new)


def _after_tear(fd: int) -> bytes:
    """A newline to write first when the file does not end with one: an earlier append was torn."""
    size = os.fstat(fd).st_size
    return b"\n" if size and os.pread(fd, 1, size - 1) != b"\n" else b""


def _torn(path: Path, offset: int, tail: bytes, warned: set[int]) -> None:
    """Warn once about an unterminated last line (keyed by where it starts, unlike line numbers)."""
    if tail and -offset - 1 not in warned:
        warned.add(-offset - 1)
        log.warning(
            "%s ends in a line without a newline at byte %d (a torn append, or one still being"
            " written); skipped until it ends (%s)",
            path,
            offset,
            tail[:80].decode(errors="replace"),
        )


def _parse(raw: bytes, path: Path, number: int, warned: set[int]) -> dict[str, Any] | None:
    """One complete line as an event, or None (warned once per line) when it is not one."""
    if not raw.strip():
        return None
    try:
        record = json.loads(raw)
    except ValueError:  # not JSON, or not UTF-8
        record = None
    if isinstance(record, dict) and isinstance(record.get("event"), str) and "ts" in record:
        return record
    if number not in warned:
        warned.add(number)
        log.warning("%s line %d is not a ledger event; skipped (%s)", path, number, raw[:80].decode(errors="replace"))
    return None


class _Tail:
    """The parsed events of one ledger file, extended by parsing only the complete lines appended since.

    The file is the same one while its device, inode and first bytes are; a
    file replaced or truncated is read again from the start.
    """

    def __init__(self, path: Path):
        self.path = path
        self.lock = threading.Lock()
        self.warned: set[int] = set()
        self._reset(None)

    def _reset(self, identity: tuple[int, int] | None) -> None:
        self.identity, self.head, self.offset, self.lines = identity, b"", 0, 0
        self.stamp: tuple[int, int] | None = None
        self.events: list[dict[str, Any]] = []

    def refresh(self) -> list[dict[str, Any]]:
        with self.lock:
            try:
                fh = open_regular(self.path)
            except FileNotFoundError:
                self._reset(None)
                return self.events
            with fh:
                st = os.fstat(fh.fileno())
                stamp, identity = (st.st_size, st.st_mtime_ns), (st.st_dev, st.st_ino)
                if stamp == self.stamp and identity == self.identity:
                    return self.events
                if identity != self.identity or st.st_size < self.offset or fh.read(len(self.head)) != self.head:
                    self._reset(identity)
                    self.warned = set()
                fh.seek(self.offset)
                data = fh.read()
            end = data.rfind(b"\n") + 1  # a torn last line: its writer may be mid-write
            _torn(self.path, self.offset + end, data[end:], self.warned)
            if not self.head:
                self.head = data[: min(_HEAD, end)]
            for raw in data[:end].split(b"\n")[:-1]:
                self.lines += 1
                if (record := _parse(raw, self.path, self.lines, self.warned)) is not None:
                    self.events.append(record)
            self.offset += end
            self.stamp = stamp if self.offset >= st.st_size else None
            return self.events


_tails: OrderedDict[Path, _Tail] = OrderedDict()
_tails_lock = threading.Lock()
_streamed_warnings: dict[Path, set[int]] = {}


def _read(path: Path) -> list[dict[str, Any]] | Iterator[dict[str, Any]]:
    """The ledger's events, from the parsed cache (or streamed, for a ledger above ``CACHE_BYTES``)."""
    try:
        size = path.lstat().st_size  # a link is refused when opened, whatever its target's size
    except FileNotFoundError:
        return []
    key = path.absolute()
    if size > CACHE_BYTES:
        with _tails_lock:
            _tails.pop(key, None)
        return _stream(path)
    with _tails_lock:
        tail = _tails.pop(key, None) or _Tail(key)
        _tails[key] = tail  # most recently read last
    events = tail.refresh()
    with _tails_lock:
        while len(_tails) > 1 and sum(t.offset for t in _tails.values()) > CACHE_BYTES:
            _tails.popitem(last=False)
    return events


def _stream(path: Path) -> Iterator[dict[str, Any]]:
    warned = _streamed_warnings.setdefault(path.absolute(), set())
    with open_regular(path) as fh:
        offset = 0
        for number, raw in enumerate(fh, 1):
            if not raw.endswith(b"\n"):
                _torn(path, offset, raw, warned)
            elif (record := _parse(raw, path, number, warned)) is not None:
                yield record
            offset += len(raw)
