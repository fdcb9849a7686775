"""The pressure-test verdict as a table of cases."""

from __future__ import annotations

import pytest

from trainyard.burnin.verdict import decide, format_table

CASES = [
    # figures, need, floor, ratio -> healthy, evicted nodes, spare
    ({"a": 10.0, "b": 10.0}, 2, 0.0, 0.9, ["a", "b"], [], []),
    ({"a": 10.0, "b": 10.5, "c": 7.0}, 2, 0.0, 0.9, ["b", "a"], ["c"], []),
    ({"a": 10.0, "b": 9.5, "c": 9.8}, 2, 0.0, 0.9, ["a", "c"], [], ["b"]),
    ({"a": 10.0, "b": None, "c": 9.9}, 2, 0.0, 0.9, ["a", "c"], ["b"], []),
    ({"a": 10.0, "b": 10.0}, 2, 12.0, 0.9, [], ["a", "b"], []),
    ({"a": None, "b": None}, 1, 0.0, 0.9, [], ["a", "b"], []),
    ({"a": 10.0, "b": 8.9, "c": 10.0, "d": 10.0}, 3, 0.0, 0.9, ["a", "c", "d"], ["b"], []),
]


@pytest.mark.parametrize("figures,need,floor,ratio,healthy,evicted,spare", CASES)
def test_decide(figures, need, floor, ratio, healthy, evicted, spare) -> None:
    verdict = decide(figures, need, floor, ratio)
    assert verdict.healthy == healthy
    assert sorted(verdict.evicted) == evicted
    assert verdict.spare == spare


def test_reasons_and_table() -> None:
    verdict = decide({"node-0": 10.0, "node-1": 5.0, "node-2": None}, 2, 1.0, 0.9)
    assert verdict.evicted["node-1"].startswith("straggler: 5.00 GFLOP/s < 0.90 x median 7.50")
    assert verdict.evicted["node-2"] == "dead: no report within the timeout"
    table = format_table(verdict)
    assert "node-2" in table and "evicted: dead" in table and "threshold 6.75" in table
