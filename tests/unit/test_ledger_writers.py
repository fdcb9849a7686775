"""Per-writer event files: each process appends to its own file in events.d; readers merge by time stamp."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from trainyard.events import ledger as ledger_module
from trainyard.events.ledger import EventWriter, Ledger


def line(ts: float, event: str = "step", stage: str = "train", **fields: object) -> bytes:
    return (json.dumps({"ts": ts, "stage": stage, "event": event, **fields}) + "\n").encode()


def test_two_writers_interleave_by_time_and_ties_keep_file_order(tmp_path: Path) -> None:
    ledger = Ledger.in_dir(tmp_path)
    ledger.path.write_bytes(line(1.0, "attempt_start", a=1) + line(4.0, "attempt_end", a=1))
    ledger.events_dir.mkdir()
    (ledger.events_dir / "attempt-1.node-1.rank-0.jsonl").write_bytes(line(2.0, step=1) + line(4.0, step=3))
    (ledger.events_dir / "attempt-1.node-0.rank-0.jsonl").write_bytes(line(2.0, step=0) + line(3.0, step=2))
    got = [(e["ts"], e["event"], e.get("step")) for e in ledger.events()]
    assert got == [
        (1.0, "attempt_start", None),
        (2.0, "step", 0),  # a tie: the writers' files by name, events.jsonl before them
        (2.0, "step", 1),
        (3.0, "step", 2),
        (4.0, "attempt_end", None),
        (4.0, "step", 3),
    ]
    assert [e["step"] for e in ledger.events("train", "step")] == [0, 1, 2, 3]


def test_a_writer_appends_to_its_own_file_and_the_reader_sees_new_events(tmp_path: Path) -> None:
    ledger = Ledger.in_dir(tmp_path)
    ledger.append("train", "attempt_start", attempt=1)
    rank0 = EventWriter.in_dir(ledger.events_dir, "attempt-1.node/0.rank-0")  # a name is made safe
    rank0.append("train", "step", step=1)
    assert rank0.path.parent == ledger.events_dir and "/" not in rank0.path.name
    before = ledger.stamp()
    assert [e["event"] for e in ledger.events()] == ["attempt_start", "step"]
    rank0.append("train", "finished", step=1)
    ledger.append("train", "attempt_end", attempt=1)
    assert ledger.stamp() != before  # the view's cache key sees a writer's append
    assert [e["event"] for e in ledger.events()] == ["attempt_start", "step", "finished", "attempt_end"]
    assert ledger.writer("x").path == ledger.events_dir / "x.jsonl"


def test_a_torn_line_in_one_writers_file_waits_and_the_others_are_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = Ledger.in_dir(tmp_path)
    ledger.append("train", "stage_start")
    ledger.events_dir.mkdir()
    torn = ledger.events_dir / "a.jsonl"
    torn.write_bytes(line(1e12, step=1) + b'{"ts": 1e12, "stage": "train", "ev')
    (ledger.events_dir / "b.jsonl").write_bytes(line(2e12, step=2))
    with caplog.at_level(logging.WARNING, logger="trainyard.events.ledger"):
        assert [e.get("step") for e in ledger.events()] == [None, 1, 2]
    assert "a.jsonl ends in a line without a newline" in caplog.text
    with torn.open("ab") as fh:
        fh.write(b'ent": "step", "step": 9}\n')
    assert [e.get("step") for e in ledger.events()] == [None, 1, 9, 2]


@pytest.mark.parametrize("plant", ["symlink", "fifo", "hardlink", "folder"])
def test_a_link_or_fifo_dropped_in_events_d_is_skipped_not_followed(
    tmp_path: Path, plant: str, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = Ledger.in_dir(tmp_path / "run")
    ledger.append("train", "stage_start")
    ledger.events_dir.mkdir()
    EventWriter.in_dir(ledger.events_dir, "rank-0").append("train", "step", step=1)
    secret = tmp_path / "other-run-events.jsonl"
    secret.write_bytes(line(1.0, "decision", action="fail"))
    planted = ledger.events_dir / "planted.jsonl"
    if plant == "symlink":
        planted.symlink_to(secret)
    elif plant == "fifo":
        os.mkfifo(planted)  # a reader that opened it blocking would hang here
    elif plant == "hardlink":
        os.link(secret, planted)
    else:
        planted.mkdir()
    with caplog.at_level(logging.WARNING, logger="trainyard.events.ledger"):
        got = [e["event"] for e in ledger.events()]
        assert [e["event"] for e in ledger.events()] == got  # read again: warned once
    assert got == ["stage_start", "step"]
    assert len([r for r in caplog.records if "planted.jsonl" in r.getMessage()]) == 1
    assert ledger.stamp()  # the view's cache key does not open it either


def test_an_events_folder_swapped_for_a_link_is_not_read(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "x.jsonl").write_bytes(line(1.0, step=5))
    ledger = Ledger.in_dir(tmp_path / "run")
    ledger.append("train", "stage_start")
    ledger.events_dir.symlink_to(elsewhere)
    with caplog.at_level(logging.WARNING, logger="trainyard.events.ledger"):
        assert [e["event"] for e in ledger.events()] == ["stage_start"]
    assert "not a folder" in caplog.text


def test_a_writer_cannot_forge_the_orchestrators_events(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ledger = Ledger.in_dir(tmp_path)
    ledger.append("train", "attempt_start", attempt=1)
    ledger.events_dir.mkdir()
    (ledger.events_dir / "rank-0.jsonl").write_bytes(
        line(1e12, "decision", action="fail")
        + line(1e12, "stage_end", stage="publish")
        + line(1e12, "step", stage="publish")
        + b'{"ts": "tomorrow", "stage": "train", "event": "step"}\n'
        + line(1e12, "checkpoint_saved", step=4)
    )
    with caplog.at_level(logging.WARNING, logger="trainyard.events.ledger"):
        assert [e["event"] for e in ledger.events()] == ["attempt_start", "checkpoint_saved"]
    assert "train/decision is not an event a training process writes" in caplog.text
    assert "line 4 is not a ledger event" in caplog.text


def test_merged_events_are_cached_until_a_file_grows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = Ledger.in_dir(tmp_path)
    ledger.append("train", "stage_start")
    writer = ledger.writer("rank-0")
    for step in range(1, 51):
        writer.append("train", "step", step=step)
    assert len(list(ledger.events())) == 51
    merges: list[int] = []
    real = ledger_module.heapq.merge
    monkeypatch.setattr(ledger_module.heapq, "merge", lambda *a, **k: merges.append(1) or real(*a, **k))
    assert len(list(ledger.events())) == 51 and merges == []  # nothing new: neither parsed nor merged again
    writer.append("train", "finished", step=50)
    assert [e["event"] for e in ledger.events()][-1] == "finished" and merges == [1]
