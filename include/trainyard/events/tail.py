"""The parsed events of one ledger file, kept per process and extended by the lines appended since.

A ledger is read once, then only the bytes appended since (the view and the
checkpoint validator read the same ledger again and again while a run grows).
A malformed line is skipped with one warning naming the file and the line; a
line without its newline at the end of the file is not read (its writer may be
mid-write) and is warned about once. A writer's file (training code, untrusted)
keeps only the events ``schema.admit`` takes.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from trainyard.atomic import open_regular
from trainyard.events import schema

CACHE_BYTES = 64 * 2**20
"""Ledger text kept parsed in one process (the least recently read ledgers go first); a bigger
ledger is read through each time, as before."""
_HEAD = 64  # bytes that identify a file: its first event's time stamp is in them
log = logging.getLogger("trainyard.events.ledger")  # the ledger's own warnings, wherever they are found


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
    if isinstance(record, dict) and isinstance(record.get("event"), str) and _is_time(record.get("ts")):
        return record
    if number not in warned:
        warned.add(number)
        log.warning("%s line %d is not a ledger event; skipped (%s)", path, number, raw[:80].decode(errors="replace"))
    return None


def _is_time(value: Any) -> bool:
    """A time stamp the merge can order by (a writer's file is untrusted: not a string, not NaN)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _admitted(record: dict[str, Any], worker: bool, path: Path, number: int, warned: set[int]) -> bool:
    """Whether an event of a writer's file is a conforming one a training process writes (warned once per line if not)."""
    if not worker or not (why := schema.admit(record)):
        return True
    if number not in warned:
        warned.add(number)
        log.warning("%s line %d: %s; skipped", path, number, "; ".join(why)[:200])
    return False


_generations = itertools.count(1)  # 0: no file


class _Tail:
    """The parsed events of one ledger file, extended by parsing only the complete lines appended since.

    The file is the same one while its device, inode and first bytes are; a
    file replaced or truncated is read again from the start (under a new
    ``generation``). A writer's file (``worker``) is read only if it has one
    name, and keeps only ``schema.WORKER_EVENTS``.
    """

    def __init__(self, path: Path, worker: bool = False):
        self.path, self.worker = path, worker
        self.lock = threading.Lock()
        self.warned: set[int] = set()
        self._reset(None)

    def _reset(self, identity: tuple[int, int] | None) -> None:
        self.identity, self.head, self.offset, self.lines = identity, b"", 0, 0
        self.stamp: tuple[int, int] | None = None
        self.events: list[dict[str, Any]] = []
        self.generation = next(_generations)

    def refresh(self) -> list[dict[str, Any]]:
        with self.lock:
            try:
                fh = open_regular(self.path, single_link=self.worker)
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
                record = _parse(raw, self.path, self.lines, self.warned)
                if record is not None and _admitted(record, self.worker, self.path, self.lines, self.warned):
                    self.events.append(record)
            self.offset += end
            self.stamp = stamp if self.offset >= st.st_size else None
            return self.events


_tails: OrderedDict[Path, _Tail] = OrderedDict()
_tails_lock = threading.Lock()
_streamed_warnings: dict[Path, set[int]] = {}
Events = Sequence[dict[str, Any]] | Iterator[dict[str, Any]]
Version = tuple[int, int] | None
"""A cached file's (generation, events parsed); None for a file streamed each time."""


def read(path: Path, worker: bool = False) -> tuple[Events, Version]:
    """A file's events, from the parsed cache (or streamed, for a file above ``CACHE_BYTES``), and their version."""
    try:
        size = path.lstat().st_size  # a link is refused when opened, whatever its target's size
    except FileNotFoundError:
        return [], (0, 0)
    key = path.absolute()
    if size > CACHE_BYTES:
        with _tails_lock:
            _tails.pop(key, None)
        return _stream(path, worker), None
    with _tails_lock:
        tail = _tails.pop(key, None) or _Tail(key, worker)
        _tails[key] = tail  # most recently read last
    events = tail.refresh()
    version = (tail.generation, len(events))
    with _tails_lock:
        while len(_tails) > 1 and sum(t.offset for t in _tails.values()) > CACHE_BYTES:
            _tails.popitem(last=False)
    return events, version


def _stream(path: Path, worker: bool = False) -> Iterator[dict[str, Any]]:
    warned = _streamed_warnings.setdefault(path.absolute(), set())
    with open_regular(path, single_link=worker) as fh:
        offset = 0
        for number, raw in enumerate(fh, 1):
            if not raw.endswith(b"\n"):
                _torn(path, offset, raw, warned)
            elif (record := _parse(raw, path, number, warned)) is not None and _admitted(
                record, worker, path, number, warned
            ):
                yield record
            offset += len(raw)
