"""The report's metrics over steps (``report.metrics.series``) from step events as rank 0 writes them."""

from __future__ import annotations

import math

from trainyard.report.metrics import series


def step(at: float, n: int, first: int | None = None, **values: float) -> dict:
    e = {
        "event": "step",
        "ts": at,
        "step": n,
        "loss": 5.0 - n * 0.01,
        "lr": 0.01,
        "step_ms": 100.0,
        "tokens_per_s": 1000.0,
        **values,
    }
    if first is not None:
        e.update(first_step=first, steps=n - first + 1)
    return e


def test_every_event_gives_loss_throughput_step_time_and_lr_points_and_its_band() -> None:
    # progress_every_s folds 60 steps into 4 events: each is plotted, and what its steps saw is its band.
    events = [
        step(1.0, 1),
        step(30.0, 20, first=2, loss_min=4.5, loss_max=9.0, loss_max_step=7, step_ms_min=90.0, step_ms_max=400.0),
        step(60.0, 40, first=21, tokens_per_s=800.0, step_ms=120.0, lr=0.005),
        step(90.0, 60, first=41, lr=0.001),
    ]
    got = series(events)
    assert [p[0] for p in got["tokens_per_s"]["points"]] == [1, 20, 40, 60]
    assert got["tokens_per_s"]["points"][2] == [40, 800.0]
    assert [p[1] for p in got["lr"]["points"]] == [0.01, 0.01, 0.005, 0.001]
    assert got["step_ms"]["bands"] == [[2, 20, 90.0, 400.0]]  # a 400 ms stall inside a stretch stays visible
    assert [7, 9.0] in got["loss"]["points"]  # the loss spike at step 7, though no event ended there
    assert got["loss"]["bands"] == [[2, 20, 4.5, 9.0]]


def test_a_step_trained_again_keeps_its_latest_value_and_faults_and_world_sizes_sit_on_the_step_axis() -> None:
    events = [step(float(n), n, tokens_per_s=2000.0) for n in range(1, 11)]
    events += [step(20.0 + n, n, tokens_per_s=1000.0) for n in range(9, 16)]  # attempt 2 resumed at step 8
    attempts = [
        {
            "faults": [
                {
                    "failure": {"kind": "node_lost", "culprits": ["node-1"], "ts": 10.5, "step": None},
                    "decision": {"action": "scale_down"},
                }
            ]
        },
    ]
    got = series(events, worlds=[(0.5, 2), (20.5, 1)], attempts=attempts)
    by_step = dict((s, v) for s, v in got["tokens_per_s"]["points"])
    assert by_step[9] == 1000.0 and by_step[8] == 2000.0
    assert got["world_size"] == [[1, 2.0], [9, 1.0]]  # attempt 2's first step ran with one rank
    assert got["faults"] == [{"step": 9, "label": "node_lost on node-1 -> scale_down"}]  # the step trained next


def test_past_the_cap_a_series_is_downsampled_and_keeps_its_spike() -> None:
    events = [step(float(n), n, step_ms=500.0 if n == 777 else 100.0 + (n % 3)) for n in range(1, 5001)]
    events.append(step(6000.0, 5001, loss=math.nan))
    got = series(events, most=100)
    assert len(got["step_ms"]["points"]) <= 110
    assert [777, 500.0] in got["step_ms"]["points"]
    assert any(math.isnan(v) for _, v in got["loss"]["points"])  # a divergence is evidence: never thinned away


def test_a_script_that_reports_only_a_loss_gets_only_a_loss_series() -> None:
    got = series(
        [{"event": "step", "ts": 1.0, "step": 1, "loss": 3.0}, {"event": "step", "ts": 2.0, "step": 2, "loss": 2.9}]
    )
    assert set(got) == {"loss", "world_size", "faults"}


def test_past_the_cap_the_widest_bands_are_kept() -> None:
    events = [step(float(n), n * 10, first=n * 10 - 9, step_ms_min=90.0, step_ms_max=110.0) for n in range(1, 301)]
    events[150] = step(151.0, 1510, first=1501, step_ms_min=90.0, step_ms_max=900.0)
    bands = series(events, most=20)["step_ms"]["bands"]
    assert len(bands) == 10 and [1501, 1510, 90.0, 900.0] in bands
    assert bands == sorted(bands)
