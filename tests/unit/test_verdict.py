"""The pressure-test verdict as a table of cases, and the drill switch."""

from __future__ import annotations

import pytest

from trainyard.burnin.protocol import Schedule, drills_from
from trainyard.burnin.table import format_table
from trainyard.burnin.verdict import Rule, decide
from trainyard.spec import PressureTestSpec

RULES = [Rule("compute", 0.0, 0.9), Rule("disk", 0.0, 0.5)]


def fig(compute: float, disk: float = 100.0) -> dict[str, float]:
    return {"compute": compute, "disk": disk}


CASES = [
    # figures, need, dead -> healthy, evicted nodes, spare
    ({"a": fig(10), "b": fig(10)}, 2, {}, ["a", "b"], [], []),
    ({"a": fig(10), "b": fig(10.5), "c": fig(7)}, 2, {}, ["b", "a"], ["c"], []),
    ({"a": fig(10), "b": fig(9.5), "c": fig(9.8)}, 2, {}, ["a", "c"], [], ["b"]),
    ({"a": fig(10), "b": None, "c": fig(9.9)}, 2, {}, ["a", "c"], ["b"], []),
    ({"a": fig(10), "b": fig(10), "c": fig(10)}, 2, {"c": "exited 1"}, ["a", "b"], ["c"], []),
    ({"a": None, "b": None}, 1, {}, [], ["a", "b"], []),
    ({"a": fig(10), "b": fig(8.9), "c": fig(10), "d": fig(10)}, 3, {}, ["a", "c", "d"], ["b"], []),
    # the disk probe has its own, looser ratio: 60 of a median 100 passes, 40 does not
    ({"a": fig(10, 100), "b": fig(10, 60), "c": fig(10, 100)}, 3, {}, ["a", "c", "b"], [], []),
    ({"a": fig(10, 100), "b": fig(10, 40), "c": fig(10, 100)}, 3, {}, ["a", "c"], ["b"], []),
]


@pytest.mark.parametrize("figures,need,dead,healthy,evicted,spare", CASES)
def test_decide(figures, need, dead, healthy, evicted, spare) -> None:
    verdict = decide(figures, need, RULES, dead)
    assert verdict.healthy == healthy
    assert sorted(verdict.evicted) == evicted
    assert verdict.spare == spare


def test_floors_reasons_and_table() -> None:
    rules = [Rule("compute", 1.0, 0.9)]
    verdict = decide(
        {
            "node-0": {"compute": 10.0},
            "node-1": {"compute": 8.0},
            "node-2": None,
            "node-3": {"compute": 0.5},
            "node-4": {"compute": 10.0},
        },
        2,
        rules,
        {"node-2": "no report within 3.0 s"},
    )
    assert verdict.references[""]["compute"].value == 9.0 and rules[0].threshold(9.0) == pytest.approx(8.1)
    assert verdict.evicted["node-1"] == "straggler: compute 8.00 < 0.90 x 9.00 (median of 4)"
    assert verdict.evicted["node-3"] == "compute 0.50 is below the floor of 1.00"
    assert verdict.evicted["node-2"] == "dead: no report within 3.0 s"
    table = format_table(verdict, rules)
    assert "node-2" in table and "evicted: dead" in table and "reference" in table


def test_drills_from_spec_and_environment() -> None:
    cfg = PressureTestSpec(drills=[{"node": "node-1", "fault": "throttle", "factor": 0.2}])
    assert drills_from(cfg, {}) == {"node-1": ("throttle", 0.2)}
    env = {"TRAINYARD_BURNIN_DRILLS": "node-1=crash; node-2=throttle:0.3;node-0=hang"}
    assert drills_from(cfg, env) == {"node-1": ("crash", 0.3), "node-2": ("throttle", 0.3), "node-0": ("hang", 0.3)}
    assert drills_from(cfg, {"TRAINYARD_BURNIN_DRILLS": "node-0=slow_link:0.5"})["node-0"] == ("slow_link", 0.5)
    with pytest.raises(ValueError, match="fault must be one of throttle, blip, slow_link, crash, hang"):
        drills_from(cfg, {"TRAINYARD_BURNIN_DRILLS": "node-1=explode"})


def test_schedule_fits_the_budget() -> None:
    plan = Schedule.of(PressureTestSpec(duration_s=20, timeout_s=60), candidates=4)
    assert plan.slot_s * 4 + plan.collective_s + plan.pairs_s == pytest.approx(20.0)
    assert plan.grace_s == 5.0
