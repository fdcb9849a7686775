"""A rank's beats reach its file at most once a second, whatever its step rate; the latest by the pulse, a status
change at once; rank 0's every step, where the orchestrator reads the step a failed attempt reached
(``runtime.progress.BEAT_EVERY_S``)."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest

from trainyard import runtime
from trainyard.protocol.heartbeat import read_heartbeats
from trainyard.runtime import progress


def counted_writes(monkeypatch: pytest.MonkeyPatch, rank: int) -> list[tuple[int, str]]:
    """The (step, status) of every beat written from now, by a process of rank ``rank``."""
    written: list[tuple[int, str]] = []
    write_beat = progress.write_beat

    def counted(folder: Path, number: int, record: dict[str, Any]) -> None:
        written.append((record["step"], record["status"]))
        write_beat(folder, number, record)

    monkeypatch.setattr(progress, "write_beat", counted)
    monkeypatch.setattr(progress, "_written_at", -math.inf)
    monkeypatch.setattr(progress, "_unwritten", None)
    monkeypatch.setattr(progress, "rank", lambda: rank)
    return written


def context(tmp_path: Path) -> runtime.RunContext:
    return runtime.RunContext(
        data_dir=tmp_path, checkpoint_dir=tmp_path, max_steps=500, heartbeat_dir=tmp_path / "hb" / "node-0"
    )


def test_fast_steps_write_a_beat_a_second_and_the_pulse_writes_the_latest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written = counted_writes(monkeypatch, rank=1)
    hb, ctx = tmp_path / "hb", context(tmp_path)
    started = time.monotonic()
    for step in range(1, 301):  # 300 steps in well under a second
        runtime.heartbeat(step, {"loss": 1.0}, ctx=ctx)
    last_step_at = time.time()
    assert time.monotonic() - started < progress.BEAT_EVERY_S and written[0] == (1, "running")
    assert len(written) <= 2  # the first beat at once, then at most the pulse's
    deadline = time.monotonic() + 3 * progress.LIVENESS_S
    while read_heartbeats(hb).get("rank-1", {}).get("step") != 300:  # the pulse writes the latest step within ~a second
        assert time.monotonic() < deadline, f"step 300 never reached the file; written: {written}"
        time.sleep(0.05)
    beat = read_heartbeats(hb)["rank-1"]
    assert beat["time"] <= last_step_at and beat["status"] == "running"  # the step's own time, not the pulse's
    runtime.heartbeat(300, {"loss": 1.0}, status="saving", ctx=ctx)  # a status change is written at once
    assert written[-1] == (300, "saving") and read_heartbeats(hb)["rank-1"]["status"] == "saving"
    assert (hb / "node-0" / "rank-1.alive").is_file()


def test_rank_0_beats_every_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step a failed attempt reached is rank 0's beat (``recovery.watch.last_step``): exact, not a second old."""
    written = counted_writes(monkeypatch, rank=0)
    ctx = context(tmp_path)
    for step in range(1, 51):
        runtime.heartbeat(step, {"loss": 1.0}, ctx=ctx)
        assert read_heartbeats(tmp_path / "hb")["rank-0"]["step"] == step
    assert [step for step, _ in written] == list(range(1, 51))
