"""The parsed events of one ledger file, kept per process and extended by the lines appended since.

A ledger is read once, then only the bytes appended since (the view and the
checkpoint validator read the same ledger again and again while a run grows).
A malformed line is skipped with one warning naming the file and the line; a
line without its newline at the end of the file is not read (its writer may be
mid-write) and is warned about once. A writer's file (training code, untrusted)
keeps only the events ``schema.admit`` takes.

Every read is bounded (docs/architecture.md, rule 14): a file is read
``READ_CHUNK`` bytes at a time, a line longer than ``MAX_LINE`` is skipped with
a warning (its bytes dropped as they come, never held), and a writer's file is
read no further than ``WORKER_FILE_BYTES`` (the rest is left out with a warning):
a sparse file of gigabytes without a newline costs one chunk of memory and one
bounded scan (``ledger`` also reads no more than ``WRITERS_BYTES`` of a run's writers' files). Warnings quote what a writer wrote only through ``text.printable``.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from trainyard.atomic import loads_untrusted, open_regular
from trainyard.events import schema
from trainyard.text import printable

CACHE_BYTES = 64 * 2**20
"""Ledger text kept parsed in one process (the least recently read ledgers go first); a bigger
ledger is read through each time, as before."""
READ_CHUNK = 2**20
"""Bytes read from a ledger file at a time."""
MAX_LINE = 2**20
"""The longest line read as an event; an event the orchestrator or the runtime writes is a few hundred bytes."""
WORKER_FILE_BYTES = CACHE_BYTES
"""How far a writer's file in ``events.d`` is read (so it is always kept parsed, never read through again):
about 400,000 steps of one event per step; the runtime's rate-bounded writer makes about 2 MB for a million
steps (``training.progress_every_s``)."""
WRITERS_BYTES = 4 * WORKER_FILE_BYTES
"""How much of all the writers' files of one run is read (by name order): thousands of sparse files cost no
more than this."""
_HEAD = 64  # bytes that identify a file: its first event's time stamp is in them
_QUOTED = 80  # characters of a skipped line quoted in its warning
log = logging.getLogger("trainyard.events.ledger")  # the ledger's own warnings, wherever they are found


def _quote(raw: bytes) -> str:
    return printable(raw[:_QUOTED].decode(errors="replace"), _QUOTED)


def _torn(path: Path, offset: int, tail: bytes, warned: set[int]) -> None:
    """Warn once about an unterminated last line (keyed by where it starts, unlike line numbers)."""
    if tail and -offset - 1 not in warned:
        warned.add(-offset - 1)
        log.warning(
            "%s ends in a line without a newline at byte %d (a torn append, or one still being"
            " written); skipped until it ends (%s)",
            printable(path, 4096),
            offset,
            _quote(tail),
        )


def _parse(raw: bytes | None, path: Path, number: int, warned: set[int]) -> dict[str, Any] | None:
    """One complete line as an event, or None (warned once per line) when it is not one (None: too long)."""
    if raw is None:
        if number not in warned:
            warned.add(number)
            log.warning("%s line %d is longer than %d bytes; skipped", printable(path, 4096), number, MAX_LINE)
        return None
    if not raw.strip():
        return None
    try:
        record = loads_untrusted(raw, "ledger line")
    except ValueError:  # not JSON, not UTF-8, nested past the parser's depth: one line, never the whole ledger
        record = None
    if isinstance(record, dict) and isinstance(record.get("event"), str) and _is_time(record.get("ts")):
        return record
    if number not in warned:
        warned.add(number)
        log.warning("%s line %d is not a ledger event; skipped (%s)", printable(path, 4096), number, _quote(raw))
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
        log.warning("%s line %d: %s; skipped", printable(path, 4096), number, printable("; ".join(why)))
    return False


class _Lines:
    """The complete lines of ``fh`` after offset ``end``, up to ``stop``, read ``READ_CHUNK`` bytes at a time.

    Yields each line without its newline, or None for one longer than ``MAX_LINE`` (dropped as it is read,
    never held). ``resume``: where an earlier read stopped inside such a line (it goes on dropping from
    there). After the lines: ``end`` is the offset after the last complete one, ``rest`` the first bytes of
    the unterminated line after it, ``dropping`` whether that line is too long already, ``pos`` where
    reading stopped.
    """

    def __init__(self, fh: IO[bytes], end: int, stop: int, resume: int | None = None):
        self.fh, self.end, self.stop = fh, end, stop
        self.pos, self.dropping = (end, False) if resume is None else (resume, True)
        self.rest = b""

    def __iter__(self) -> Iterator[bytes | None]:
        self.fh.seek(self.pos)
        carry = b""  # the current line's bytes so far, never more than MAX_LINE
        while self.pos < self.stop and (chunk := self.fh.read(min(READ_CHUNK, self.stop - self.pos))):
            base, self.pos = self.pos, self.pos + len(chunk)
            *complete, last = chunk.split(b"\n")
            for raw in complete:
                base += len(raw) + 1
                self.end, line, carry = base, carry + raw, b""
                too_long, self.dropping, self.rest = self.dropping or len(line) > MAX_LINE, False, b""
                yield None if too_long else line
            if self.dropping:
                continue  # still inside an overlong line
            if len(carry) + len(last) > MAX_LINE:
                self.rest, self.dropping, carry = (carry[:_QUOTED] + last[:_QUOTED])[:_QUOTED], True, b""
            else:
                carry += last
                self.rest = carry[:_QUOTED]


_generations = itertools.count(1)  # 0: no file


class _Tail:
    """The parsed events of one ledger file, extended by parsing only the complete lines appended since.

    The file is the same one while its device, inode and first bytes are; a
    file replaced or truncated is read again from the start (under a new
    ``generation``). A writer's file (``worker``) is read only if it has one
    name, no further than ``WORKER_FILE_BYTES``, and keeps only ``schema.WORKER_EVENTS``.
    """

    def __init__(self, path: Path, worker: bool = False):
        self.path, self.worker = path, worker
        self.lock = threading.Lock()
        self.warned: set[int] = set()
        self._reset(None)

    def _reset(self, identity: tuple[int, int] | None) -> None:
        self.identity, self.head, self.offset, self.lines = identity, b"", 0, 0
        self.skipping: int | None = None  # where reading goes on inside an overlong unterminated line
        self.stamp: tuple[int, int] | None = None
        self.events: list[dict[str, Any]] = []
        self.generation = next(_generations)

    def refresh(self, budget: int = WORKER_FILE_BYTES) -> list[dict[str, Any]]:
        """The file's events, after parsing what was appended since (a writer's file: to ``budget`` bytes)."""
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
                shrunk = st.st_size < (self.offset if self.skipping is None else self.skipping)
                if identity != self.identity or shrunk or fh.read(len(self.head)) != self.head:
                    self._reset(identity)
                    self.warned = set()
                stop = _stop(self.path, st.st_size, budget if self.worker else None, self.warned)
                self._read(fh, stop)
                if not self.head and self.offset:
                    fh.seek(0)
                    self.head = fh.read(min(_HEAD, self.offset))
            # Read to the end (or the budget): nothing new until the file changes. A short line still
            # being written is read again from its start next time.
            self.stamp = stamp if self.offset >= stop or self.skipping is not None else None
            return self.events

    def _read(self, fh: IO[bytes], stop: int) -> None:
        lines = _Lines(fh, self.offset, stop, self.skipping)
        for raw in lines:
            self.lines += 1
            record = _parse(raw, self.path, self.lines, self.warned)
            if record is not None and _admitted(record, self.worker, self.path, self.lines, self.warned):
                self.events.append(record)
        _torn(self.path, lines.end, lines.rest, self.warned)
        self.offset, self.skipping = lines.end, lines.pos if lines.dropping else None


def _stop(path: Path, size: int, budget: int | None, warned: set[int]) -> int:
    """Where reading a file of ``size`` bytes stops: its end, or a writer's file's ``budget`` (warned once)."""
    if budget is None or size <= budget:
        return size
    if -1 not in warned:  # line numbers are positive and torn offsets below -1: -1 is free
        warned.add(-1)
        log.warning(
            "%s holds %d bytes; a training process's events file is read only to byte %d (%d per file, %d for"
            " all of a run's), the events after it are left out (write fewer step events: training.progress_every_s)",
            printable(path, 4096),
            size,
            budget,
            WORKER_FILE_BYTES,
            WRITERS_BYTES,
        )
    return budget


_tails: OrderedDict[Path, _Tail] = OrderedDict()
_tails_lock = threading.Lock()
_streamed_warnings: dict[Path, set[int]] = {}
Events = Sequence[dict[str, Any]] | Iterator[dict[str, Any]]
Version = tuple[int, int] | None
"""A cached file's (generation, events parsed); None for a file streamed each time."""


def read(path: Path, worker: bool = False, budget: int = WORKER_FILE_BYTES) -> tuple[Events, Version]:
    """A file's events, from the parsed cache (or streamed, for a file above ``CACHE_BYTES``), and their version.

    A writer's file (``worker``) is read to ``budget`` bytes at most (``WORKER_FILE_BYTES`` or less)."""
    try:
        size = path.lstat().st_size  # a link is refused when opened, whatever its target's size
    except FileNotFoundError:
        return [], (0, 0)
    key = path.absolute()
    budget = min(budget, WORKER_FILE_BYTES)
    if (min(size, budget) if worker else size) > CACHE_BYTES:  # a writer is read only to its budget
        with _tails_lock:
            _tails.pop(key, None)
        return _stream(path, worker, budget), None
    with _tails_lock:
        tail = _tails.pop(key, None) or _Tail(key, worker)
        _tails[key] = tail  # most recently read last
    events = tail.refresh(budget)
    version = (tail.generation, len(events))
    with _tails_lock:
        while len(_tails) > 1 and sum(t.offset for t in _tails.values()) > CACHE_BYTES:
            _tails.popitem(last=False)
    return events, version


def _stream(path: Path, worker: bool = False, budget: int = WORKER_FILE_BYTES) -> Iterator[dict[str, Any]]:
    warned = _streamed_warnings.setdefault(path.absolute(), set())
    with open_regular(path, single_link=worker) as fh:
        lines = _Lines(fh, 0, _stop(path, os.fstat(fh.fileno()).st_size, budget if worker else None, warned))
        for number, raw in enumerate(lines, 1):
            if (record := _parse(raw, path, number, warned)) is not None and _admitted(
                record, worker, path, number, warned
            ):
                yield record
        _torn(path, lines.end, lines.rest, warned)
