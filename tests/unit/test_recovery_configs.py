"""The recovery bench's configurations: how a run is sized, which goal applies, and step times from gaps."""

from __future__ import annotations

from pathlib import Path

import pytest
from recovery_parts.configs import checkpoint_bytes, ettr_at, ettr_goal, goals, relaunch_goals, relaunch_pair, summary
from recovery_parts.runs import fault_plan, timed_steps


@pytest.mark.parametrize(
    ("step_ms", "train_s", "plan"),
    [
        (250.0, 60.0, {"steps": 240, "fault_at": 120, "checkpoint_every": 40}),  # 60 s at 0.25 s a step
        (250.0, 180.0, {"steps": 720, "fault_at": 360, "checkpoint_every": 120}),  # the default configuration's
        (13.0, 20.0, {"steps": 1536, "fault_at": 768, "checkpoint_every": 256}),  # byo's milliseconds
        (5000.0, 10.0, {"steps": 6, "fault_at": 3, "checkpoint_every": 1}),  # slower than a save interval: 1
    ],
)
def test_a_run_is_sized_to_its_step_with_the_fault_at_the_middle_save(step_ms, train_s, plan) -> None:
    assert fault_plan(step_ms, train_s) == plan
    assert plan["fault_at"] % plan["checkpoint_every"] == 0  # at a save's step: the worst moment for a relaunch


@pytest.mark.parametrize(("step_ms", "train_s"), [(0.0, 60.0), (250.0, 0.0), (-1.0, 60.0)])
def test_a_plan_needs_a_positive_step_and_time(step_ms, train_s) -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        fault_plan(step_ms, train_s)


@pytest.mark.parametrize(
    ("train_s_per_fault", "goal"),
    [(None, None), (20.0, None), (59.9, None), (60.0, 0.90), (179.9, 0.90), (180.0, 0.95), (900.0, 0.95)],
)
def test_the_ettr_goal_is_the_one_for_the_runs_fault_rate(train_s_per_fault, goal) -> None:
    assert ettr_goal(train_s_per_fault) == goal


def test_goals_met_and_missed_and_none_where_a_figure_or_goal_is_missing() -> None:
    met = {"resume_delay_s": 0.6, "lost_steps": 1, "ettr": 0.91, "train_s_per_fault": 70.0, "ettr_vs_best_peer": 1.0}
    assert goals(met) == {
        "resume_ok": True,
        "lost_ok": True,
        "ettr_goal": 0.90,
        "ettr_ok": True,
        "vs_best_peer_ok": True,
    }
    missed = {
        "resume_delay_s": 2.5,
        "lost_steps": 2,
        "ettr": 0.94,
        "train_s_per_fault": 200.0,
        "ettr_vs_best_peer": 0.99,
    }
    assert goals(missed) == {
        "resume_ok": False,
        "lost_ok": False,
        "ettr_goal": 0.95,
        "ettr_ok": False,
        "vs_best_peer_ok": False,
    }
    assert goals({"resume_delay_s": 4.0}, resume_goal_s=5.0)["resume_ok"] is True  # Kubernetes: <= 5 s
    assert goals({"ettr": 0.5, "train_s_per_fault": 30.0}) == dict.fromkeys(
        ("resume_ok", "lost_ok", "ettr_goal", "ettr_ok", "vs_best_peer_ok")
    )


def step(n: int, ts: float, node: str = "node-0", attempt: int = 1, **extra) -> dict:
    return {"event": "step", "step": n, "ts": ts, "node": node, "attempt": attempt, **extra}


def test_step_times_from_gaps_between_a_writers_consecutive_steps() -> None:
    events = [
        step(1, 10.0),
        step(2, 10.02),
        {"event": "drill_fired", "ts": 10.03},
        step(2, 11.0, attempt=2),  # a new attempt: the first of its stretch, no gap to measure
        step(3, 11.05, attempt=2),
        step(5, 11.2, attempt=2),  # a step skipped: no gap of one step
        step(6, 11.3, node="node-2", attempt=2),  # another writer: its own stretch
    ]
    timed = timed_steps(events)
    assert [e.get("step_ms") for e in timed if e["event"] == "step"] == [None, 20.0, None, 50.0, None, None]
    assert timed[2] == {"event": "drill_fired", "ts": 10.03}


def test_step_events_that_have_a_step_time_keep_it() -> None:
    events = [step(1, 10.0, step_ms=7.0), step(2, 10.5, step_ms=8.0)]
    assert timed_steps(events) == events


def test_a_configurations_object_names_its_one_faults_path_and_rate() -> None:
    run = {"resume_delay_s": 0.5, "lost_steps": 0, "ettr": 0.9, "detection_s": 0.1, "step_ms": 250.0,
           "step_ms_from": "events", "wall_s": 66.0, "startup_s": 6.0, "failures": [{}], "path": ["in_place"],
           "world_path": "3 -> 2 -> 3"}  # fmt: skip
    plan = {"steps": 240, "fault_at": 120, "checkpoint_every": 40}
    obj = summary(run, plan, "drill")
    assert obj["path"] == "in_place" and obj["train_s_per_fault"] == 66.0 and obj["fault_at"] == 120
    assert summary({**run, "failures": [], "path": []}, plan, "drill")["path"] is None  # no fault was seen
    two = summary({**run, "failures": [{}, {}], "path": ["in_place", "relaunch"]}, plan, "drill")
    assert two["path"] == ["in_place", "relaunch"] and two["train_s_per_fault"] == 33.0


def test_checkpoint_bytes_are_the_newest_step_folders(tmp_path: Path) -> None:
    assert checkpoint_bytes(tmp_path) is None
    for step, size in (("step_000010", 5), ("step_000020", 7)):
        folder = tmp_path / "bench" / step
        folder.mkdir(parents=True)
        (folder / "0.distcp").write_bytes(b"x" * size)
        (folder / "manifest.json").write_bytes(b"{}")
    assert checkpoint_bytes(tmp_path) == 9


def faulted(ettr: float, wall: float, *costs: tuple[float | None, float | None], startup: float = 6.0) -> dict:
    failures = [{"resume_delay_s": d, "replay_s": r} for d, r in costs]
    return {"ettr": ettr, "wall_s": wall, "startup_s": startup, "failures": failures}


def test_the_ettr_at_a_fault_rate_is_a_3_minute_run_with_one_start_up_and_faults_costing_the_run_s() -> None:
    """Issue 53: a 60 s run, 6 s of start-up, one fault costing 3 s (2 s to resume, 1 s replayed), ETTR 0.8:
    0.8 x 60 / 51 of its steady time is productive; 3 minutes hold one start-up and 1 fault (per 3 minutes) or 3
    (per minute)."""
    run = faulted(0.8, 60.0, (2.0, 1.0))
    rate = 0.8 * 60 / 51
    assert ettr_at(run, 180.0) == round(rate * (180 - 6 - 3) / 180, 4)
    assert ettr_at(run, 60.0) == round(rate * (180 - 6 - 9) / 180, 4)
    assert ettr_at(run, 60.0, span_s=60.0) == 0.8  # the run's own length and fault count: its own ETTR
    two = faulted(0.8, 120.0, (2.0, 1.0), (3.0, 0.0))  # two faults: their mean cost, 3 s each
    assert ettr_at(two, 60.0, span_s=120.0) == 0.8


@pytest.mark.parametrize(
    "run",
    [
        faulted(0.9, 60.0),  # no fault: no cost to charge
        faulted(0.9, 60.0, (None, 1.0)),  # a fault never resumed from
        faulted(0.9, 60.0, (2.0, None)),  # its replay unknown (no step time)
        {**faulted(0.9, 60.0, (2.0, 1.0)), "ettr": None},
        {**faulted(0.9, 60.0, (2.0, 1.0)), "startup_s": None},
        faulted(0.1, 10.0, (3.0, 3.0)),  # start-up and the fault fill the run: no steady time to measure
    ],
)
def test_no_ettr_at_a_rate_where_a_part_is_unknown(run: dict) -> None:
    assert ettr_at(run, 60.0) is None


def test_the_relaunch_goals_are_issue_53_s() -> None:
    met = {"resume_delay_s": 1.9, "lost_steps": 1, "ettr_fault_per_3min": 0.95, "ettr_fault_per_min": 0.90}
    assert relaunch_goals(met) == dict.fromkeys(
        ("resume_ok", "lost_ok", "ettr_fault_per_3min_ok", "ettr_fault_per_min_ok"), True
    )
    missed = {"resume_delay_s": 4.5, "lost_steps": 2, "ettr_fault_per_3min": 0.949, "ettr_fault_per_min": 0.89}
    assert set(relaunch_goals(missed).values()) == {False}
    assert relaunch_goals(missed, resume_goal_s=5.0)["resume_ok"] is True  # Kubernetes: <= 5 s
    assert set(relaunch_goals({}).values()) == {None}


def test_a_relaunch_says_what_it_resumed_from_beside_its_baseline() -> None:
    def run(folder: str, every: int) -> dict:
        source = "snapshot" if every else "checkpoint"
        failure = {"path": "relaunch", "resumed_source": source, "resumed_why": f"{folder} why",
                   "resume_delay_s": 1.0, "replay_s": 0.1 if every else 2.0}  # fmt: skip
        ettr = 0.9 if every else 0.87  # the baseline replays 2 s of steps: less productive
        return {"failures": [failure], "path": ["relaunch"], "wall_s": 60.0, "startup_s": 6.0, "ettr": ettr,
                "lost_steps": every and 1}  # fmt: skip

    obj = relaunch_pair(run, {"steps": 60, "fault_at": 30, "checkpoint_every": 10}, "drill")
    assert (obj["resumed_from"], obj["resumed_why"], obj["path"]) == ("snapshot", ["snapshots why"], "relaunch")
    base = obj["baseline"]
    assert base["resumed_from"] == "checkpoint" and base["goals"]["lost_ok"] is True
    assert obj["ettr_fault_per_3min"] > base["ettr_fault_per_3min"]  # less replayed per fault
