"""The run ledger: an append-only JSON-lines event log per pipeline run.

Every stage, the supervisor and rank 0 of the training workload append events
here; reports, SLO figures and resumption read it back. Nothing is inferred
from log text. One event is one ``write`` on an ``O_APPEND`` descriptor, so
lines from several processes never interleave on a local file system.

Readers keep what they parsed: a ledger is read once, then only the bytes
appended since (the view and the checkpoint validator read the same ledger
again and again while a run grows). A malformed line is skipped with one
warning naming the file and the line; a torn last line is left for its writer
to finish.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

LEDGER_FILE = "events.jsonl"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
CACHE_BYTES = 64 * 2**20
"""Ledger text kept parsed in one process (the least recently read ledgers go first); a bigger
ledger is read through each time, as before."""
_HEAD = 64  # bytes that identify a file: its first event's time stamp is in them
log = logging.getLogger("trainyard.ledger")


def safe_name(text: str) -> str:
    """A file-system-safe form of a DAG or run id (``manual__2026-11-29T02:00:00+00:00``)."""
    cleaned = _UNSAFE.sub("_", text).strip("._")
    return cleaned or "_"


def run_dir(runs_root: str | Path, dag_id: str, run_id: str) -> Path:
    """Where one run keeps its files: keyed by DAG and run, so runs never share files."""
    return Path(runs_root) / safe_name(dag_id) / safe_name(run_id)


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
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        return record

    def events(self, stage: str | None = None, event: str | None = None) -> Iterator[dict[str, Any]]:
        """Events in write order, optionally filtered (copies: the parsed events are shared)."""
        for record in _read(self.path):
            if stage is not None and record.get("stage") != stage:
                continue
            if event is not None and record.get("event") != event:
                continue
            yield dict(record)


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
                st = os.stat(self.path)
            except FileNotFoundError:
                self._reset(None)
                return self.events
            stamp, identity = (st.st_size, st.st_mtime_ns), (st.st_dev, st.st_ino)
            if stamp == self.stamp and identity == self.identity:
                return self.events
            with self.path.open("rb") as fh:
                if identity != self.identity or st.st_size < self.offset or fh.read(len(self.head)) != self.head:
                    self._reset(identity)
                    self.warned = set()
                fh.seek(self.offset)
                data = fh.read()
            end = data.rfind(b"\n") + 1  # a torn last line: its writer may be mid-write
            if not self.head:
                self.head = data[:min(_HEAD, end)]
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
        size = path.stat().st_size
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
    with path.open("rb") as fh:
        for number, raw in enumerate(fh, 1):
            if raw.endswith(b"\n") and (record := _parse(raw, path, number, warned)) is not None:
                yield record
