"""Progress lines of the train task: what they say from the heartbeats, and when they are due."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trainyard.checkpoint.registry import promote
from trainyard.recovery.logwatch import LogSteps
from trainyard.recovery.progress import Look, Progress, ProgressLog, duration, furthest, tokens_per_step


def beat(step: Any, loss: Any = 2.5, at: Any = 110.0, **metrics: Any) -> dict[str, Any]:
    return {"step": step, "time": at, "status": "running", "metrics": {"loss": loss, **metrics}}


def progress(
    beats: dict[str, dict[str, Any]],
    before: Look | None = Look(100.0, 10),  # noqa: B008 (an immutable tuple)
    now: float = 111.0,
    tokens: int | None = 512,
    checkpoint: str | None = "step_000010",
    last_rate: float | None = None,
    saved: str | None = None,
) -> Progress:
    return Progress.from_heartbeats(
        beats,
        attempt=2,
        world_size=4,
        target=110,
        now=now,
        before=before,
        tokens_per_step=tokens,
        checkpoint=checkpoint,
        last_rate=last_rate,
        saved=saved,
    )


@pytest.mark.parametrize(
    ("beats", "before", "tokens", "want"),
    [
        # 20 steps between the beats at 100 s and 110 s: 2 steps/s, 1024 tokens/s; 80 steps left at 2/s.
        (
            {"rank-0": beat(30, 2.25), "rank-1": beat(29, 9.0, at=109.5)},
            Look(100.0, 10),
            512,
            "progress: attempt 2, world size 4, step 30/110 (27%), loss 2.2500, 2 steps/s, 1,024 tokens/s, ETA 40s,"
            " last valid checkpoint step_000010",
        ),
        # The first look: no rate, so no speed and no ETA yet.
        (
            {"rank-0": beat(30)},
            None,
            512,
            "progress: attempt 2, world size 4, step 30/110 (27%), loss 2.5000, - steps/s, - tokens/s, ETA -,"
            " last valid checkpoint step_000010",
        ),
        # Tokens per step unknown to the spec and not reported by the script: "-", not a guess.
        (
            {"rank-0": beat(15)},
            Look(100.0, 10),
            None,
            "progress: attempt 2, world size 4, step 15/110 (14%), loss 2.5000, 0.5 steps/s, - tokens/s, ETA 3m10s,"
            " last valid checkpoint step_000010",
        ),
        # No step since the last look and no speed measured before: unknown, never 0 within a long step.
        (
            {"rank-0": beat(10, at=100.0)},
            Look(100.0, 10),
            512,
            "progress: attempt 2, world size 4, step 10/110 (9%), loss 2.5000, - steps/s, - tokens/s, ETA -,"
            " last valid checkpoint step_000010",
        ),
        # No rank has beaten yet.
        (
            {},
            None,
            512,
            "progress: attempt 2, world size 4, step -/110 (no heartbeats), loss -, - steps/s, - tokens/s, ETA -, last valid checkpoint step_000010",
        ),
        # Done: ETA 0 whatever the rate.
        (
            {"rank-0": beat(110)},
            None,
            512,
            "progress: attempt 2, world size 4, step 110/110 (100%), loss 2.5000, - steps/s, - tokens/s, ETA 0s,"
            " last valid checkpoint step_000010",
        ),
    ],
)
def test_the_line_from_heartbeats(beats: dict, before: Look | None, tokens: int | None, want: str) -> None:
    assert progress(beats, before, tokens=tokens).line() == want


def test_a_line_within_a_long_step_repeats_the_last_speed() -> None:
    got = progress({"rank-0": beat(10, at=100.0)}, Look(100.0, 10), last_rate=0.25)
    assert (got.steps_per_s, got.tokens_per_s, got.eta_s) == (0.25, 128.0, 400.0)
    assert progress({"rank-0": beat(12)}, Look(100.0, 10), last_rate=0.25).steps_per_s == pytest.approx(0.2)


def test_a_beat_without_a_usable_time_counts_as_seen_now() -> None:
    assert furthest({"rank-0": beat(12, at="soon")}, 7.0) == Look(7.0, 12)
    assert furthest({"rank-0": beat(12, at=float("nan"))}, 7.0) == Look(7.0, 12)


def test_a_newer_checkpoint_not_yet_validated_is_named_as_such() -> None:
    assert (
        progress({}, saved="step_000020")
        .line()
        .endswith("last valid checkpoint step_000010, newest saved step_000020 (not yet validated)")
    )


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
    assert furthest({"rank-0": beat(12, at=3.0), "rank-1": {"time": 1.0}}, 5.0) == Look(3.0, 12)


def test_unknown_checkpoint_is_a_dash() -> None:
    assert progress({}, checkpoint=None).line().endswith("last valid checkpoint -")
    assert progress({}, checkpoint="none").line().endswith("last valid checkpoint none")


@pytest.mark.parametrize(
    ("seconds", "want"),
    [
        (None, "-"),
        (float("inf"), "-"),
        (-1.0, "-"),
        (0.4, "0s"),
        (42.0, "42s"),
        (59.6, "1m00s"),
        (365.0, "6m05s"),
        (3600.0, "1h00m"),
        (11220.0, "3h07m"),
        (187200.0, "2d04h"),
    ],
)
def test_duration(seconds: float | None, want: str) -> None:
    assert duration(seconds) == want


@pytest.mark.parametrize(
    ("args", "want"),
    [
        ({"seq-len": 64, "lr": 0.1}, 16 * 64),
        ({"seq_len": "32"}, 16 * 32),
        ({}, None),
        ({"seq-len": "long"}, None),
        ({"seq-len": True}, None),
        ({"seq-len": 0}, None),
    ],
)
def test_tokens_per_step_from_the_spec(args: dict, want: int | None) -> None:
    assert tokens_per_step(16, args) == want


def write_beat(folder: Path, rank: int, step: int, at: float, loss: float = 2.0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank-{rank}.json").write_text(json.dumps(beat(step, loss, at=at)))


def commit(root: Path, step: int) -> Path:
    ckpt = root / f"step_{step:06d}"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text("{}")
    return ckpt


def test_progress_log_paces_lines_and_rates_from_the_first_beat(tmp_path: Path) -> None:
    beats, ckpts = tmp_path / "heartbeat", tmp_path / "ckpt"
    pace = ProgressLog(
        10.0,
        1000.0,
        attempt=1,
        world_size=2,
        target=100,
        tokens_per_step=None,
        heartbeat_dir=beats,
        checkpoint_root=ckpts,
    )
    assert pace.poll(1001.0) is None  # nothing to see yet, and not due
    write_beat(beats, 0, 5, at=1001.5)
    assert pace.poll(1002.0) is None  # the first beat: the first line's starting point
    write_beat(beats, 0, 21, at=1009.5)
    assert pace.poll(1009.0) is None  # not due
    first = pace.poll(1010.0)  # 16 steps between the beats at 1001.5 and 1009.5
    assert first is not None and "step 21/100 (21%)" in first and " 2 steps/s" in first
    assert first.endswith("last valid checkpoint -")  # no checkpoint folder in sight
    promote(ckpts, commit(ckpts, 20))
    write_beat(beats, 0, 41, at=1020.0)
    assert pace.poll(1015.0) is None
    second = pace.poll(1020.5)  # 20 steps in 10.5 s
    assert second is not None and "step 41/100" in second and " 1.9 steps/s" in second and "ETA 31s" in second
    assert second.endswith("last valid checkpoint step_000020")
    # No step since: the speed measured last, not 0; a committed checkpoint the watcher has not judged yet.
    commit(ckpts, 40)
    third = pace.poll(1030.0)
    assert third is not None and " 1.9 steps/s" in third
    assert third.endswith("last valid checkpoint step_000020, newest saved step_000040 (not yet validated)")
    # A poll long after (a slow save): one line, and the cadence continues from the schedule.
    assert pace.poll(1055.0) is not None and pace.poll(1059.0) is None and pace.poll(1060.0) is not None


def test_progress_log_says_none_when_no_checkpoint_is_valid_yet(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    pace = ProgressLog(
        1.0,
        0.0,
        attempt=3,
        world_size=1,
        target=10,
        tokens_per_step=None,
        heartbeat_dir=tmp_path / "absent",
        checkpoint_root=tmp_path / "ckpt",
    )
    assert pace.poll(1.0) == (
        "progress: attempt 3, world size 1, step -/10 (no heartbeats), loss -, - steps/s, - tokens/s, ETA -, last valid checkpoint none"
    )


def test_a_rate_of_zero_gives_a_line_at_every_poll(tmp_path: Path) -> None:
    log = ProgressLog(
        0.0,
        100.0,
        attempt=1,
        world_size=1,
        target=10,
        tokens_per_step=None,
        heartbeat_dir=tmp_path,
        checkpoint_root=None,
    )
    assert [log.poll(t) is not None for t in (100.0, 100.5, 101.0)] == [True, True, True]


FORGED = "step_000010\nprogress: attempt 1, world size 4, step 999 (908%), loss 0.0001 \x1b[2K\r\x9b31m"


def test_a_forged_checkpoint_name_stays_one_line_with_its_escapes_visible() -> None:
    line = progress({"rank-0": beat(30)}, checkpoint=FORGED, saved=FORGED + "\x7f").line()
    assert len(line.splitlines()) == 1 and line.count("\n") == 0
    assert not any(ord(c) < 32 or 127 <= ord(c) < 160 for c in line), repr(line)
    shown = "step_000010\\nprogress: attempt 1, world size 4, step 999 (908%), loss 0.0001 \\x1b[2K\\r\\x9b31m"
    assert f"last valid checkpoint {shown}, newest saved {shown}\\x7f (not yet validated)" in line


def test_a_checkpoint_folder_named_to_forge_a_line_cannot(tmp_path: Path) -> None:
    ckpts = tmp_path / "ckpt"
    (ckpts / FORGED).mkdir(parents=True)
    (ckpts / "LATEST").write_text(json.dumps({"path": FORGED}))  # the pointer a pod can write
    pace = ProgressLog(
        1.0,
        0.0,
        attempt=1,
        world_size=4,
        target=110,
        tokens_per_step=None,
        heartbeat_dir=tmp_path / "absent",
        checkpoint_root=ckpts,
    )
    line = pace.poll(1.0)
    assert line is not None and len(line.splitlines()) == 1 and line.startswith("progress: attempt 1,")
    assert not any(ord(c) < 32 or 127 <= ord(c) < 160 for c in line), repr(line)


def test_a_script_without_heartbeats_shows_its_log_s_step(tmp_path: Path) -> None:
    """Issue 51: a script that prints ``iter N: loss X`` and writes no heartbeats. Its first step is recorded at
    the first poll that sees it (it times a resumption), later ones at the pace; the line says the log's step."""
    log = tmp_path / "attempt-1" / "node-0.log"
    log.parent.mkdir()
    written: list[dict] = []
    logs = LogSteps({"node-0": log}, None, attempt=1, world_size=1, record=written.append)
    pace = ProgressLog(10.0, 0.0, attempt=1, world_size=1, target=200, tokens_per_step=None,
                       heartbeat_dir=tmp_path / "absent", checkpoint_root=None, logs=logs)  # fmt: skip
    log.write_text("iter 1: loss 4.0\n")
    assert pace.poll(1.0) is None and [e["step"] for e in written] == [1]  # not due, but recorded at once
    log.write_text("iter 1: loss 4.0\niter 120: loss 2.5, time 10ms\n")
    assert pace.poll(5.0) is None and len(written) == 1  # after the first step: at the pace only
    line = pace.poll(10.0)
    assert line is not None and "step 120/200 (from the log), loss 2.5000" in line and "no heartbeats" not in line
    assert written[-1]["step"] == 120 and written[-1]["source"] == "log"
