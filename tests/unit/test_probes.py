"""The pressure test's timing loop, on a clock the test drives (no real timing)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from trainyard.burnin import probes


class Clock:
    """``perf_counter`` that only moves when the measured operation runs, by the next planned duration."""

    def __init__(self, durations: list[float]):
        self.now, self.durations, self.calls = 0.0, list(durations), 0

    def perf_counter(self) -> float:
        return self.now

    def op(self) -> None:
        self.now += self.durations[self.calls]
        self.calls += 1


def test_the_median_window_wins_not_the_best_or_the_mean(monkeypatch: pytest.MonkeyPatch) -> None:
    # warm-up, then windows of 3 s: 3 ops of 1 s, 6 of 0.5 s (a burst of speed), 2 of 2 s (a stall; it runs over).
    clock = Clock([0.25] + [1.0] * 3 + [0.5] * 6 + [2.0] * 2)
    monkeypatch.setattr(probes, "time", SimpleNamespace(perf_counter=clock.perf_counter, sleep=time.sleep))
    assert probes.timed_loop(clock.op, budget_s=9.0, windows=3) == (3, 3.0)
    assert clock.calls == 12  # each window ran until its share of the budget was spent, no further


def test_equal_windows_give_the_first(monkeypatch: pytest.MonkeyPatch) -> None:
    # windows of 2 s: (5, 2.5) and (4, 2.0) run at the same rate, (1, 2.0) slower.
    clock = Clock([0.25] + [0.25] * 4 + [1.5] + [0.5] * 4 + [2.0])
    monkeypatch.setattr(probes, "time", SimpleNamespace(perf_counter=clock.perf_counter, sleep=time.sleep))
    assert probes.timed_loop(clock.op, budget_s=6.0, windows=3) == (5, 2.5)


def test_an_op_that_returns_a_value_is_timed_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock([0.5] * 5)

    def op() -> float:  # e.g. a tensor copy, which returns its destination
        clock.op()
        return clock.now

    monkeypatch.setattr(probes, "time", SimpleNamespace(perf_counter=clock.perf_counter, sleep=time.sleep))
    assert probes.timed_loop(op, budget_s=1.0, windows=2) == (1, 0.5)


def test_a_throttled_window_pays_its_own_debt_and_no_credit_carries_over(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock([0.01] * 1000)  # each op takes 10 ms

    def sleep(seconds: float) -> None:
        clock.now += seconds + 0.002  # a busy host's sleep overruns by 2 ms

    monkeypatch.setattr(probes, "time", SimpleNamespace(perf_counter=clock.perf_counter, sleep=sleep))
    throttle = probes.Throttle(0.2)
    throttle.debt = -0.2  # an overrun earlier left credit: 0.2 s of unthrottled work, a whole window's
    iters, seconds = probes._window(clock.op, 0.3, throttle)
    # 20% of the window's time lost: 0.8 of the ops an unthrottled window runs, not 1.0
    assert iters / seconds * 0.01 == pytest.approx(0.8, abs=0.03)
    assert throttle.debt == 0.0  # settled before the clock stopped: nothing owed, nothing lent, to the next probe
