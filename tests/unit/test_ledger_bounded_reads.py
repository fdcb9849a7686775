"""Every read of a ledger file is bounded: in chunks, a line at most ``MAX_LINE``, a writer's file at most
``WORKER_FILE_BYTES``, whatever a training process wrote there (a sparse file of gigabytes, one endless line)."""

from __future__ import annotations

import json
import logging
import os
import resource
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from trainyard.events import tail
from trainyard.events.ledger import Ledger

GiB = 2**30


def line(ts: float, event: str = "step", stage: str = "train", **fields: object) -> bytes:
    return (json.dumps({"ts": ts, "stage": stage, "event": event, **fields}) + "\n").encode()


def bytes_read() -> int:
    """Bytes this process has read through read(2) so far (the kernel's count: what a reader really read)."""
    for row in Path("/proc/self/io").read_text().splitlines():
        if row.startswith("rchar:"):
            return int(row.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@contextmanager
def address_space(extra: int) -> Iterator[None]:
    """At most ``extra`` more bytes of address space for this process while inside (a read of gigabytes
    into memory fails with ``MemoryError``, as it would on a worker with less memory than the file)."""
    size = int(
        next(r for r in Path("/proc/self/status").read_text().splitlines() if r.startswith("VmSize:")).split()[1]
    )
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (size * 1024 + extra, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def run_with_writer(tmp_path: Path, content: bytes, size: int | None = None) -> Ledger:
    """A run whose rank 0 wrote ``content`` to its events file, then (``size``) made it sparse up to ``size``."""
    ledger = Ledger.in_dir(tmp_path)
    ledger.append("train", "stage_start")
    ledger.events_dir.mkdir()
    rank0 = ledger.events_dir / "rank-0.jsonl"
    rank0.write_bytes(content)
    if size is not None:
        os.truncate(rank0, size)  # a hole: no disk used, reads as NUL bytes without a newline
    return ledger


def test_a_sparse_3_gib_writer_file_is_read_in_bounded_memory_and_bytes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = run_with_writer(tmp_path, line(1e12, step=7), size=3 * GiB)
    with caplog.at_level(logging.WARNING, logger="trainyard.events.ledger"):
        for _ in range(2):
            before = bytes_read()
            with address_space(GiB):
                got = [(e["event"], e.get("step")) for e in ledger.events()]
            assert got == [("stage_start", None), ("step", 7)]  # the event before the hole is kept
            assert bytes_read() - before <= tail.WORKER_FILE_BYTES + 2 * tail.READ_CHUNK
    budget = [r for r in caplog.records if "is read only to byte" in r.getMessage()]
    assert len(budget) == 1 and "rank-0.jsonl" in budget[0].getMessage()


def test_a_line_longer_than_the_cap_is_skipped_with_one_warning_and_the_next_is_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    long = b'{"ts": 1e12, "stage": "train", "event": "step", "pad": "' + b"x" * 4 * 2**20 + b'"}\n'  # JSON, 4 MiB
    ledger = run_with_writer(tmp_path, line(1e12, step=1) + long + line(1e12, step=3))
    with caplog.at_level(logging.WARNING, logger="trainyard.events.ledger"):
        assert [e.get("step") for e in ledger.events()] == [None, 1, 3]
        ledger.append("train", "attempt_start", attempt=1)
        assert [e.get("step") for e in ledger.events()] == [None, None, 1, 3]  # read again: warned once
    too_long = [r for r in caplog.records if "longer than" in r.getMessage()]
    assert len(too_long) == 1 and "line 2 is longer than" in too_long[0].getMessage()
    assert tail.MAX_LINE < 4 * 2**20


def test_an_endless_last_line_is_dropped_as_it_is_read_and_not_read_again(tmp_path: Path) -> None:
    first = line(1e12, step=1)
    ledger = run_with_writer(tmp_path, first, size=len(first) + 40 * 2**20)  # under the cache size: kept parsed
    tracemalloc.start()
    try:
        assert [e.get("step") for e in ledger.events()] == [None, 1]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, f"{peak} bytes held to read a 40 MiB line"
    with (ledger.events_dir / "rank-0.jsonl").open("ab") as fh:
        fh.write(b"\n" + line(1e12, step=2))  # the endless line ends at last
    before = bytes_read()
    assert [e.get("step") for e in ledger.events()] == [None, 1, 2]
    assert bytes_read() - before < 2 * tail.READ_CHUNK  # went on where it stopped, not from the line's start


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        (b"[" * 3000, "nested"),  # RecursionError once ended every read of the run's ledger
        (b'{"ts": 1e12, "stage": "train", "event": "step", "step": 2, "x": ' + b"[" * 500 + b"]" * 500 + b"}", "deep"),
        (b'{"ts": 1e12, "stage": "train", "event": "step", "step": 2, "note": "\xed\xa0\x80"}', "utf-8 surrogate"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_a_nested_or_non_unicode_line_is_skipped_and_the_other_events_still_read(
    tmp_path: Path, bad: bytes, says: str, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = run_with_writer(tmp_path, line(1e12, step=1) + bad + b"\n" + line(1e12, step=3))
    with caplog.at_level(logging.WARNING, logger="trainyard.events.ledger"):
        for _ in range(2):  # read again: warned once
            assert [e.get("step") for e in ledger.events()] == [None, 1, 3]
    skipped = [r.getMessage() for r in caplog.records if "line 2 is not a ledger event" in r.getMessage()]
    assert len(skipped) == 1, [r.getMessage() for r in caplog.records]
    # A ledger past the cache is streamed: the same parse, the same skip.
    assert [e.get("step") for e in tail._stream(ledger.events_dir / "rank-0.jsonl", worker=True)] == [1, 3]


def test_an_escaped_lone_surrogate_is_kept_as_a_replacement_character(tmp_path: Path) -> None:
    # Valid JSON, and what the ledger's own writer makes of a rank's undecodable byte: the event is kept (a failure's
    # message with it), and what is read back can be written as UTF-8 by every later writer (a report, a notice).
    ledger = run_with_writer(
        tmp_path, b'{"ts": 1e12, "stage": "train", "event": "step", "step": 2, "note": "a\\ud800"}\n'
    )
    [step] = [e for e in ledger.events() if e.get("step") == 2]
    assert step["note"] == "a\ufffd"
    step["note"].encode("utf-8")


def test_warnings_quote_what_a_pod_wrote_as_one_printable_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    forged = b"junk\x1b[2K\rprogress: attempt 1, step 999/100\x1b[0m\n"
    ledger = run_with_writer(tmp_path, forged + b'{"ts": 1, "stage": "train", "event": "x\\u001b[2K\\n"}\n')
    os.mkfifo(ledger.events_dir / "evil\nprogress: step 999\x1b[2K.jsonl")
    with caplog.at_level(logging.WARNING, logger="trainyard.events.ledger"):
        assert [e["event"] for e in ledger.events()] == ["stage_start"]
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3
    for message in messages:
        assert not any(ord(c) < 32 or 127 <= ord(c) < 160 for c in message), repr(message)
    assert "junk\\x1b[2K\\rprogress: attempt 1" in messages[1] + messages[2]
    assert "evil\\nprogress: step 999\\x1b[2K.jsonl" in messages[0]


def test_many_sparse_writer_files_cost_at_most_the_runs_budget(tmp_path: Path) -> None:
    ledger = run_with_writer(tmp_path, line(1e12, step=1))
    for n in range(12):  # files a pod made: thousands would cost no more
        planted = ledger.events_dir / f"x{n:02d}.jsonl"
        planted.write_bytes(line(1e12 + n, "drill_fired", fault="hang"))
        os.truncate(planted, 3 * GiB)
    before = bytes_read()
    with address_space(GiB):
        got = [e["event"] for e in ledger.events()]
    assert bytes_read() - before <= tail.WRITERS_BYTES + 16 * tail.READ_CHUNK
    assert got == ["stage_start", "step"] + ["drill_fired"] * 4  # rank-0, then x00..x03: what lay in the budget
