"""Long runs stay cheap to look at: step figures at a bounded rate, ledgers read incrementally."""

from __future__ import annotations

import itertools
import logging
import math
import random
from pathlib import Path

import pytest
from long_run import CHECKPOINT_EVERY, STEPS, fake_clock, loss_at, write_long_run

from trainyard import runtime
from trainyard.events import tail as ledger_module
from trainyard.events.ledger import Ledger
from trainyard.protocol import steps as progress
from trainyard.quality.metrics import metric_problems
from trainyard.recovery.figures import recovery_figures
from trainyard.report.pages import run_page
from trainyard.report.runs import overview, run_folders
from trainyard.report.summary import run_identity, summarize
from trainyard.spec import MetricExpectations


@pytest.fixture(scope="module")
def long_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_long_run(tmp_path_factory.mktemp("runs"))


def test_a_million_step_run_keeps_its_ledger_small(long_run: Path) -> None:
    ledger = Ledger.in_dir(long_run)
    files = [ledger.path, *ledger.events_dir.iterdir()]  # the orchestrator's events and rank 0's
    assert len(files) == 3 and sum(f.stat().st_size for f in files) < 20 * 2**20
    steps = list(ledger.events("train", "step"))
    # One event per 30 s of training (0.1 s steps), one per checkpoint, the first step of each attempt.
    bound = STEPS * 0.1 / 30 + STEPS / CHECKPOINT_EVERY + 10
    assert len(steps) <= bound, f"{len(steps)} step events for {STEPS} steps"
    assert all(e["steps"] == e["step"] - e["first_step"] + 1 for e in steps if "first_step" in e)


def test_the_loss_at_every_checkpoint_is_exact_and_the_summary_counts_every_step(long_run: Path) -> None:
    ledger = Ledger.in_dir(long_run)
    history = dict(progress.loss_points(ledger.events("train", "step")))
    saved = [e["step"] for e in ledger.events("train", "checkpoint_saved")]
    assert len(saved) == STEPS // CHECKPOINT_EVERY
    assert all(history[step] == loss_at(step) for step in saved)
    summary = summarize(ledger)
    assert summary["steps_trained"] == STEPS and summary["last_step"] == STEPS
    assert summary["first_loss"] == loss_at(1) and summary["last_loss"] == loss_at(STEPS)
    assert len(summary["loss_curve"]) <= progress.CURVE_POINTS + 2
    html = run_page(summary, run_identity(long_run))
    assert "node_lost" in html and len(html) < 2 * 2**20


def test_recovery_figures_from_summarised_steps(long_run: Path) -> None:
    figures = recovery_figures(Ledger.in_dir(long_run))
    # Attempt 1 reached step 400,500 (its attempt_end, from the heartbeats); attempt 2 resumed from 400,000.
    assert figures["lost_steps"] == 500
    assert figures["productive_s"] == pytest.approx(STEPS * 0.1)


def test_steps_are_written_at_the_configured_rate_with_their_figures(tmp_path: Path) -> None:
    ctx = runtime.RunContext(
        data_dir=tmp_path,
        checkpoint_dir=tmp_path,
        max_steps=100,
        events_dir=tmp_path / "events.d",
        checkpoint_every=50,
        progress_every_s=10.0,
    )
    with fake_clock() as now:
        for step in range(1, 101):
            now[0] += 1.0
            loss = 9.0 if step == 37 else float("nan") if step == 63 else 3.0 - step / 100
            runtime.heartbeat(step, {"loss": loss, "step_ms": 1000.0 + step}, ctx=ctx)
        runtime.finish(100, {"loss": 2.0}, ctx=ctx)
    events = list(Ledger.in_dir(tmp_path).events("train", "step"))
    # First step; every 10 s; checkpoint 50 at once; the steps before the NaN, then the NaN alone; the last step.
    assert [(e.get("first_step", e["step"]), e["step"]) for e in events] == [
        (1, 1),
        (2, 11),
        (12, 21),
        (22, 31),
        (32, 41),
        (42, 50),
        (51, 60),
        (61, 62),
        (63, 63),
        (64, 73),
        (74, 83),
        (84, 93),
        (94, 100),
    ]
    spike = events[4]
    assert (spike["loss_max"], spike["loss_max_step"], spike["loss_min"]) == (9.0, 37, 3.0 - 41 / 100)
    assert spike["step_ms_mean"] == pytest.approx(1000 + 36.5) and spike["steps"] == 10
    assert math.isnan(events[8]["loss"]) and events[8]["step"] == 63
    # The gate still sees the spike inside a summarised stretch and the divergence at its step.
    history = progress.loss_points(events)
    problems = metric_problems(history, 100, 2.0, MetricExpectations(max_spike_ratio=2.0, spike_window=5))
    assert "loss was not finite at step(s) 63" in problems
    assert any("step 37" in p for p in problems if "spiked" in p)


def test_a_step_trained_again_replaces_the_earlier_figures() -> None:
    digest = progress.ProgressDigest(5.0, clock=iter(range(1000)).__next__)
    events = [e for step in range(1, 21) for e in digest.add(step, {"loss": float("nan") if step == 18 else 1.0})]
    events += [e for step in range(11, 25) for e in digest.add(step, {"loss": 0.5})]
    events += [e for e in [digest.flush()] if e is not None]
    points = dict(progress.loss_points(events))
    assert all(math.isfinite(v) for v in points.values())  # the rolled-back NaN at step 18 is gone
    assert progress.steps_trained(events) == 24 and max(points) == 24


def test_a_bad_line_is_skipped_with_one_warning_and_the_index_still_lists_the_run(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    folder = write_long_run(tmp_path / "runs", steps=3000)
    ledger = Ledger.in_dir(folder)
    lines = ledger.path.read_bytes().split(b"\n")
    lines.insert(5, b'{"stage": "train", "event": "st\xff')  # a broken line in the middle
    ledger.path.write_bytes(b"\n".join(lines))
    with caplog.at_level(logging.WARNING, logger="trainyard.events.ledger"):
        [row] = [overview(f) for f in run_folders(tmp_path / "runs")]
        assert summarize(ledger)["steps_trained"] == 3000  # read again: no second warning
    assert row["steps_trained"] == 3000 and row["state"] == "running"
    [warning] = [r for r in caplog.records if r.name == "trainyard.events.ledger"]
    assert str(ledger.path) in warning.getMessage() and "line 6" in warning.getMessage()


def test_ledgers_are_read_incrementally(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = Ledger(tmp_path / "events.jsonl")
    for step in range(1, 101):
        ledger.append("train", "step", step=step, loss=1.0)
    assert len(list(ledger.events())) == 100
    parsed: list[int] = []
    real = ledger_module._parse
    monkeypatch.setattr(ledger_module, "_parse", lambda raw, *a: parsed.append(1) or real(raw, *a))
    ledger.append("train", "finished", step=100)
    with ledger.path.open("ab") as fh:
        fh.write(b'{"stage": "train", "ev')  # a writer mid-line: not parsed yet, not warned about
    assert [e["event"] for e in ledger.events()][-2:] == ["step", "finished"] and len(parsed) == 1
    assert len(list(Ledger(ledger.path).events())) == 101 and len(parsed) == 1  # another reader shares the cache
    ledger.path.unlink()  # a new file at the same path is read from its start
    Ledger(ledger.path).append("report", "stage_start")
    assert [e["event"] for e in ledger.events()] == ["stage_start"]


def test_the_rate_comes_from_the_spec_through_the_environment(tmp_path: Path) -> None:
    env = {"TRAINYARD_DATA_DIR": str(tmp_path), "TRAINYARD_CHECKPOINT_DIR": str(tmp_path), "TRAINYARD_MAX_STEPS": "5"}
    assert runtime.context(env).progress_every_s == 30.0
    assert runtime.context({**env, "TRAINYARD_PROGRESS_EVERY_S": "0"}).progress_every_s == 0.0
    for bad in ("-1", "nan", "soon"):
        with pytest.raises(ValueError, match="TRAINYARD_PROGRESS_EVERY_S"):
            runtime.context({**env, "TRAINYARD_PROGRESS_EVERY_S": bad})


def _reference(events: list[dict]) -> tuple[list[tuple[int, float]], list[int]]:
    """loss_points and kept_stretches' counts the slow way: step by step, newest event first."""
    owner: dict[int, int] = {}  # step -> the newest event covering it
    for i, e in enumerate(events):
        for s in range(min(e.get("first_step", e["step"]), e["step"]), e["step"] + 1):
            owner[s] = i
    points: dict[int, float] = {}
    for i in reversed(range(len(events))):  # a point hidden by no newer event's range is kept
        e = events[i]
        seen = [(e["step"], e["loss"])]
        if e.get("loss_max_step") not in (None, e["step"]):
            seen.append((e["loss_max_step"], e["loss_max"]))
        points.update((s, v) for s, v in seen if owner.get(s, -1) <= i)
    counts = [sum(1 for j in owner.values() if j == i) for i in range(len(events))]
    return sorted(points.items()), [c for c in counts if c > 0]


@pytest.mark.parametrize("seed", range(40))
def test_step_ranges_in_any_order_match_the_step_by_step_reading(seed: int) -> None:
    """Retrained, overlapping, out-of-order and hostile ranges (a peak outside its range) read as the
    step-by-step reference does: the reading marks each stretch of steps once, whatever the order."""
    rng = random.Random(seed)
    events = []
    for _ in range(rng.randint(1, 30)):
        last = rng.randint(1, 60)
        e: dict = {"step": last, "loss": rng.random()}
        if rng.random() < 0.6:
            e.update(first_step=rng.randint(max(1, last - 15), last), loss_max=9.0 + rng.random())
            e["loss_max_step"] = rng.randint(e["first_step"] - 3, last)
        events.append(e)
    want_points, want_counts = _reference(events)
    assert progress.loss_points(events) == want_points
    assert [count for count, _ in progress.kept_stretches(events)] == want_counts
    assert progress.steps_trained(events) == len(
        {s for e in events for s in range(progress.first_step(e), e["step"] + 1)}
    )


def test_a_summed_up_stretch_samples_its_steps_evenly_for_the_charts() -> None:
    """A 60-step demo writes 4 step events (``progress_every_s: 30``): its charts drew 4 points. Each event now
    carries its stretch's values at evenly spaced steps, at most ``2 x SAMPLES`` of them however long it is."""
    digest = progress.ProgressDigest(30.0, clock=lambda: 0.0)  # the clock never moves: one stretch
    digest.add(0, {"loss": 5.0})  # the first step is written at once
    for step in range(1, 60):
        assert digest.add(step, {"loss": 5.0 - step / 100, "step_ms": 100.0 + step}) == []
    [short] = [e for e in [digest.flush()] if e]
    assert short["samples"]["step"] == list(range(1, 60)) and short["samples"]["loss"][0] == 4.99
    assert [p for p, _ in progress.loss_points([short])] == list(range(1, 60))  # every step of the stretch

    for step in range(60, 100_060):
        digest.add(step, {"loss": 3.0, "step_ms": 99.0, "tokens_per_s": 1e5})
    [long] = [e for e in [digest.flush()] if e]
    sampled = long["samples"]["step"]
    assert progress.SAMPLES <= len(sampled) < 2 * progress.SAMPLES, len(sampled)
    gaps = {b - a for a, b in itertools.pairwise(sampled)}
    assert len(gaps) == 1 and sampled[0] == 60, gaps  # evenly spaced from the stretch's first step
    assert set(long["samples"]) == {"step", "loss", "step_ms", "tokens_per_s"}  # lr was never given


@pytest.mark.parametrize(
    "samples",
    [[1, 2], {"step": [1, 2], "loss": [1.0]}, {"step": "1", "loss": [1.0]}, {"step": [True], "loss": [1.0]}],
)
def test_malformed_samples_a_rank_wrote_are_ignored(samples: object) -> None:
    event = {"event": "step", "step": 10, "first_step": 1, "steps": 10, "loss": 2.0, "samples": samples}
    assert progress.loss_points([event]) == [(10, 2.0)]
