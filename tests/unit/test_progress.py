"""Progress lines of the train task: what they say from the heartbeats, and when they are due."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trainyard.checkpoint.registry import promote
from trainyard.recovery.progress import Look, Progress, ProgressLog, duration, furthest, tokens_per_step


def beat(step: Any, loss: Any = 2.5, **metrics: Any) -> dict[str, Any]:
    return {"step": step, "time": 0.0, "status": "running", "metrics": {"loss": loss, **metrics}}


def progress(beats: dict[str, dict[str, Any]], before: Look | None = Look(100.0, 10), now: float = 110.0,
             tokens: int | None = 512, checkpoint: str | None = "step_000010") -> Progress:
    return Progress.from_heartbeats(beats, attempt=2, world_size=4, target=110, now=now, before=before,
                                    tokens_per_step=tokens, checkpoint=checkpoint)


@pytest.mark.parametrize(("beats", "before", "tokens", "want"), [
    # 20 steps in 10 s: 2 steps/s, 1024 tokens/s; 80 steps left at 2/s.
    ({"rank-0": beat(30, 2.25), "rank-1": beat(29, 9.0)}, Look(100.0, 10), 512,
     "progress: attempt 2, world size 4, step 30/110 (27%), loss 2.2500, 2 steps/s, 1,024 tokens/s, ETA 40s,"
     " last valid checkpoint step_000010"),
    # The first look: no rate, so no speed and no ETA yet.
    ({"rank-0": beat(30)}, None, 512,
     "progress: attempt 2, world size 4, step 30/110 (27%), loss 2.5000, - steps/s, - tokens/s, ETA -,"
     " last valid checkpoint step_000010"),
    # Tokens per step unknown to the spec and not reported by the script: "-", not a guess.
    ({"rank-0": beat(15)}, Look(100.0, 10), None,
     "progress: attempt 2, world size 4, step 15/110 (14%), loss 2.5000, 0.5 steps/s, - tokens/s, ETA 3m10s,"
     " last valid checkpoint step_000010"),
    # No progress since the last look: 0 steps/s, and no ETA rather than an infinite one.
    ({"rank-0": beat(10)}, Look(100.0, 10), 512,
     "progress: attempt 2, world size 4, step 10/110 (9%), loss 2.5000, 0 steps/s, 0 tokens/s, ETA -,"
     " last valid checkpoint step_000010"),
    # No rank has beaten yet.
    ({}, None, 512,
     "progress: attempt 2, world size 4, step -/110, loss -, - steps/s, - tokens/s, ETA -, last valid checkpoint step_000010"),
    # Done: ETA 0 whatever the rate.
    ({"rank-0": beat(110)}, None, 512,
     "progress: attempt 2, world size 4, step 110/110 (100%), loss 2.5000, - steps/s, - tokens/s, ETA 0s,"
     " last valid checkpoint step_000010"),
])
def test_the_line_from_heartbeats(beats: dict, before: Look | None, tokens: int | None, want: str) -> None:
    assert progress(beats, before, tokens=tokens).line() == want


def test_tokens_per_step_from_what_the_workload_reports_when_the_spec_does_not_know() -> None:
    # The reference loop reports tokens_per_s of its last step and that step's ms: 8192 tok/s x 62.5 ms = 512 tokens.
    got = progress({"rank-0": beat(30, tokens_per_s=8192.0, step_ms=62.5)}, tokens=None)
    assert got.tokens_per_s == pytest.approx(1024.0)
    assert progress({"rank-0": beat(30, tokens_per_s="fast", step_ms=62.5)}, tokens=None).tokens_per_s is None


def test_loss_is_rank_0s_and_never_text_from_the_heartbeat() -> None:
    assert progress({"rank-1": beat(31, 1.0), "rank-0": beat(30, 2.0)}).loss == 2.0
    assert progress({"rank-1": beat(31, 1.0), "rank-2": beat(29, 3.0)}).loss == 1.0  # no rank 0: the furthest rank
    assert progress({"rank-0": beat(30, "nan\nINJECTED")}).loss is None
    assert progress({"rank-0": beat(30, float("nan"))}).line().count("loss nan") == 1


def test_a_malformed_step_is_ignored() -> None:
    assert furthest({"rank-0": beat("12"), "rank-1": beat(True), "rank-2": beat(-3)}, 5.0) is None
    assert furthest({"rank-0": beat(12), "rank-1": {"time": 1.0}}, 5.0) == Look(5.0, 12)


def test_unknown_checkpoint_is_a_dash() -> None:
    assert progress({}, checkpoint=None).line().endswith("last valid checkpoint -")
    assert progress({}, checkpoint="none").line().endswith("last valid checkpoint none")


@pytest.mark.parametrize(("seconds", "want"), [
    (None, "-"), (float("inf"), "-"), (-1.0, "-"), (0.4, "0s"), (42.0, "42s"), (59.6, "1m00s"), (365.0, "6m05s"),
    (3600.0, "1h00m"), (11220.0, "3h07m"), (187200.0, "2d04h"),
])
def test_duration(seconds: float | None, want: str) -> None:
    assert duration(seconds) == want


@pytest.mark.parametrize(("args", "want"), [
    ({"seq-len": 64, "lr": 0.1}, 16 * 64), ({"seq_len": "32"}, 16 * 32), ({}, None), ({"seq-len": "long"}, None),
    ({"seq-len": True}, None), ({"seq-len": 0}, None),
])
def test_tokens_per_step_from_the_spec(args: dict, want: int | None) -> None:
    assert tokens_per_step(16, args) == want


def write_beat(folder: Path, rank: int, step: int, loss: float = 2.0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank-{rank}.json").write_text(json.dumps(beat(step, loss)))


def test_progress_log_paces_lines_and_rates_from_the_first_beat(tmp_path: Path) -> None:
    beats, ckpts = tmp_path / "heartbeat", tmp_path / "ckpt"
    pace = ProgressLog(10.0, 1000.0, attempt=1, world_size=2, target=100, tokens_per_step=None, heartbeat_dir=beats,
                       checkpoint_root=ckpts)
    assert pace.poll(1001.0) is None  # nothing to see yet, and not due
    write_beat(beats, 0, 5)
    assert pace.poll(1002.0) is None  # the first beat: the first line's starting point
    write_beat(beats, 0, 21)
    assert pace.poll(1009.0) is None  # not due
    first = pace.poll(1010.0)  # 16 steps in 8 s
    assert first is not None and "step 21/100 (21%)" in first and " 2 steps/s" in first
    assert first.endswith("last valid checkpoint -")  # no checkpoint folder in sight
    (ckpts / "step_000020").mkdir(parents=True)
    promote(ckpts, ckpts / "step_000020")
    write_beat(beats, 0, 41)
    assert pace.poll(1015.0) is None
    second = pace.poll(1020.5)  # 20 steps in 10.5 s since the first line's look
    assert second is not None and "step 41/100" in second and " 1.9 steps/s" in second and "ETA 31s" in second
    assert second.endswith("last valid checkpoint step_000020")
    # A poll long after (a slow save): one line, and the cadence continues from the schedule.
    assert pace.poll(1055.0) is not None and pace.poll(1059.0) is None and pace.poll(1060.0) is not None


def test_progress_log_says_none_when_no_checkpoint_is_valid_yet(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    pace = ProgressLog(1.0, 0.0, attempt=3, world_size=1, target=10, tokens_per_step=None,
                       heartbeat_dir=tmp_path / "absent", checkpoint_root=tmp_path / "ckpt")
    assert pace.poll(1.0) == ("progress: attempt 3, world size 1, step -/10, loss -, - steps/s, - tokens/s, ETA -,"
                              " last valid checkpoint none")
