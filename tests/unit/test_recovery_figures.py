"""Recovery figures from a hand-written ledger: one fault, its detection, the resume, ETTR."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest

from trainyard.events.ledger import Ledger
from trainyard.recovery.figures import recovery_figures
from trainyard.report.notice import RunFacts, notice_from_ledger
from trainyard.report.pages import report_html
from trainyard.report.summary import format_summary, summarize


def at(ledger: Ledger, ts: float, event: str, **fields) -> None:
    with mock.patch("trainyard.events.ledger.time.time", return_value=ts):
        ledger.append("train", event, **fields)


@pytest.fixture
def ledger(tmp_path: Path) -> Ledger:
    """Attempt 1 runs steps 1-6 (step 4 slowed by a background save), node-1 dies at 106.0,
    attempt 2 resumes from step 4 and runs 5-8; the stage took 20 s."""
    ledger = Ledger(tmp_path / "events.jsonl")
    at(ledger, 100.0, "attempt_start", attempt=1)
    for step, ms in zip(range(1, 7), [1000, 1000, 1000, 3000, 1000, 1000]):
        at(ledger, 100.0 + step, "step", step=step, step_ms=ms)
    at(ledger, 106.0, "drill_fired", fault="kill", node="node-1", step=7)
    at(ledger, 106.5, "failure_classified", attempt=1, kind="node_lost", detected_at=106.4)
    at(ledger, 108.0, "attempt_start", attempt=2)
    at(ledger, 110.0, "resumed", step=4)
    for step in range(5, 9):
        at(ledger, 110.0 + step, "step", step=step, step_ms=1000)
    at(ledger, 119.0, "stage_end", seconds=20.0)
    return ledger


def test_one_fault(ledger: Ledger) -> None:
    figures = recovery_figures(ledger)
    assert figures["detection_s"] == 0.5  # from the drill's fault time, not the detection time
    assert figures["resume_delay_s"] == 9.0  # fault at 106 to the first step of attempt 2 at 115
    assert figures["lost_steps"] == 2  # steps 5 and 6 ran twice
    # 8 steps count once each, at the median step time of 1 s: the save's extra 2 s is not training.
    assert figures["productive_s"] == 8.0 and figures["ettr"] == 0.4


def test_no_fault_no_failures(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "events.jsonl")
    at(ledger, 1.0, "attempt_start", attempt=1)
    at(ledger, 2.0, "step", step=1, step_ms=500)
    at(ledger, 3.0, "stage_end", seconds=2.0)
    figures = recovery_figures(ledger)
    assert figures["failures"] == [] and figures["detection_s"] is None and figures["ettr"] == 0.25


def test_an_in_place_regroup_is_a_resumption_of_the_same_attempt(tmp_path: Path) -> None:
    """node-1 dies at 104.0 during step 5; the survivors regroup (world 3 -> 2) and redo step 5: no new attempt."""
    ledger = Ledger(tmp_path / "events.jsonl")
    at(ledger, 100.0, "attempt_start", attempt=1, world_size=3)
    for step in range(1, 5):
        at(ledger, 100.0 + step, "step", step=step, step_ms=1000)
    at(ledger, 104.0, "drill_fired", fault="kill", node="node-1", step=5)
    at(ledger, 104.6, "failure_classified", attempt=1, kind="node_lost", detected_at=104.5)
    at(ledger, 105.0, "regrouped", generation=2, world_size=2, micro_batch=2, from_step=4)
    for step in range(5, 9):
        at(ledger, 105.5 + step - 5, "step", step=step, step_ms=1000)
    at(ledger, 109.0, "stage_end", seconds=9.0)
    figures = recovery_figures(ledger)
    (failure,) = figures["failures"]
    assert failure["path"] == "in_place"
    assert figures["resume_delay_s"] == 1.5  # fault at 104.0 to step 5 after the regroup at 105.5
    # Where it went: classified at 104.6, the new generation formed at 105.0 (the restart), its first step at 105.5.
    assert (failure["detection_s"], failure["restart_s"], failure["restore_s"], failure["replay_s"]) == (
        0.6,
        0.4,
        0.5,
        0,
    )
    assert figures["lost_steps"] == 0  # step 4 was the last committed; nothing completed was lost
    assert figures["world_sizes"] == [(100.0, 3), (105.0, 2)]
    assert figures["world_path"] == "3 -> 2" and figures["spares_idle"] is None


def test_the_world_path_and_the_spares_that_joined_or_wait(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "events.jsonl")
    """A warm spare s0 joins at the fault; node-1, started again, waits, grows the world back, then dies
    and waits again: idle at the end, as is the warm spare s1 nobody needed."""
    at(ledger, 100.0, "attempt_start", attempt=1, nodes=["node-0", "node-1", "node-2"], world_size=3)
    at(ledger, 100.1, "spares_warm", attempt=1, nodes=["s0", "s1"])
    at(ledger, 104.0, "decision", attempt=1, action="regroup", kind="node_lost", joiners=["s0"])
    at(ledger, 104.1, "rejoining", attempt=1, nodes=["node-1"])
    at(ledger, 104.5, "regrouped", world_size=3, from_step=4)
    at(ledger, 110.0, "grown", attempt=1, nodes=["node-0", "node-2", "s0", "node-1"], joiners=["node-1"])
    at(ledger, 110.5, "regrouped", world_size=4, from_step=9)
    at(ledger, 120.0, "rejoining", attempt=1, nodes=["node-1"])
    at(ledger, 121.0, "stage_end", seconds=21.0)
    figures = recovery_figures(ledger)
    assert figures["world_path"] == "3 -> 3 -> 4"
    assert figures["spares_joined"] == "s0, node-1" and figures["spares_idle"] == "s1, node-1"


def test_a_relaunch_after_an_in_place_regroup_is_judged_on_its_own(ledger: Ledger) -> None:
    figures = recovery_figures(ledger)
    assert [f["path"] for f in figures["failures"]] == ["relaunch"]


def test_each_fault_of_an_attempt_healed_in_place_is_timed_from_its_own_drill(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "events.jsonl")
    at(ledger, 100.0, "attempt_start", attempt=1, nodes=["node-0", "node-1", "node-2"], world_size=3)
    for k, fired in enumerate((110.0, 130.0)):
        at(ledger, fired, "drill_fired", fault="kill", node=f"node-{k + 1}", step=10 * (k + 1))
        at(ledger, fired + 0.5, "failure_classified", attempt=1, kind="node_lost", step=10 * (k + 1) - 1,
           detected_at=fired + 0.4)  # fmt: skip
        at(ledger, fired + 1.0, "regrouped", world_size=2, from_step=10 * (k + 1) - 1)
        at(ledger, fired + 1.5, "step", step=10 * (k + 1), step_ms=500)
    at(ledger, 140.0, "stage_end", seconds=40.0)
    figures = recovery_figures(ledger)
    assert [f["detection_s"] for f in figures["failures"]] == [0.5, 0.5]
    assert [f["resume_delay_s"] for f in figures["failures"]] == [1.5, 1.5]


def test_a_regroup_that_never_formed_is_one_fault_judged_with_the_relaunch_that_followed(tmp_path: Path) -> None:
    """node-1 is killed at 110 (regroup decided in place); the group never forms, a hang is seen at 121 and
    attempt 2 resumes from step 5 at 130: one fault of 110, resumed 21 s later, steps 6-9 lost once."""
    ledger = Ledger(tmp_path / "events.jsonl")
    at(ledger, 100.0, "attempt_start", attempt=1, nodes=["node-0", "node-1", "node-2"], world_size=3)
    for step in range(1, 10):
        at(ledger, 100.0 + step, "step", step=step, step_ms=1000)
    at(ledger, 110.0, "drill_fired", fault="kill", node="node-1", step=10)
    at(ledger, 110.5, "failure_classified", attempt=1, kind="node_lost", step=9, detected_at=110.4)
    at(ledger, 121.0, "failure_classified", attempt=1, kind="hang", step=9, detected_at=120.9)
    at(ledger, 121.5, "attempt_end", attempt=1, state="failed", last_step=9)
    at(ledger, 125.0, "attempt_start", attempt=2, nodes=["node-0", "node-2"], world_size=2)
    at(ledger, 129.0, "resumed", step=5)
    at(ledger, 131.0, "step", step=6, step_ms=1000)
    at(ledger, 140.0, "stage_end", seconds=40.0)
    first, second = recovery_figures(ledger)["failures"]
    assert first["path"] == "in_place_unformed" and first["lost_steps"] is None and first["detection_s"] == 0.5
    assert second["path"] == "relaunch" and second["fault_at"] == 110.0 and second["resume_delay_s"] == 21.0
    assert recovery_figures(ledger)["lost_steps"] == 4


def test_a_script_that_reports_no_steps_has_unknown_lost_steps_and_resume_delay(tmp_path: Path) -> None:
    """No step events at all (a script without trainyard calls): unknown, with why, never 0."""
    ledger = Ledger(tmp_path / "events.jsonl")
    at(ledger, 100.0, "attempt_start", attempt=1, nodes=["node-0", "node-1"], world_size=2)
    at(ledger, 106.0, "attempt_end", attempt=1, state="failed", trigger="crash")
    at(ledger, 106.5, "failure_classified", attempt=1, kind="node_lost", detected_at=106.4)
    at(ledger, 106.6, "decision", attempt=1, kind="node_lost", action="scale_down", new_nodes=["node-0"])
    at(ledger, 108.0, "attempt_start", attempt=2, nodes=["node-0"], world_size=1)
    at(ledger, 119.0, "stage_end", seconds=20.0)
    figures = recovery_figures(ledger)
    assert figures["lost_steps"] is None and "reports no steps" in figures["lost_steps_why"]
    assert figures["resume_delay_s"] is None and "reports no steps" in figures["resume_delay_why"]
    [failure] = figures["failures"]
    assert failure["lost_steps"] is None and failure["resume_delay_s"] is None


def test_figures_that_are_known_carry_no_why(ledger: Ledger) -> None:
    figures = recovery_figures(ledger)
    assert figures["lost_steps_why"] is None and figures["resume_delay_why"] is None


@pytest.fixture
def blind(tmp_path: Path) -> Ledger:
    """A script that reports no steps at all (no heartbeats, no log line that says one): node-1 dies, attempt 2
    relaunches from the orchestrator's checkpoint of step 30 and succeeds."""
    ledger = Ledger(tmp_path / "events.jsonl")
    at(ledger, 99.0, "stage_start")
    at(ledger, 99.0, "recovery_path", in_place=False, why_not="recovery.in_place is false")
    at(ledger, 100.0, "attempt_start", attempt=1, nodes=["node-0", "node-1"], world_size=2, resume_step=0)
    at(ledger, 106.0, "attempt_end", attempt=1, state="failed", trigger="crash", reason="node-1 exited -9")
    at(ledger, 106.5, "failure_classified", attempt=1, kind="node_lost", detected_at=106.4)
    at(ledger, 106.6, "decision", attempt=1, kind="node_lost", action="scale_down", reason="scale down")
    at(ledger, 108.0, "attempt_start", attempt=2, nodes=["node-0"], world_size=1, resume_step=30)
    at(ledger, 119.0, "attempt_end", attempt=2, state="succeeded")
    at(ledger, 119.0, "stage_end", seconds=20.0)
    return ledger


def test_a_run_with_no_steps_says_unknown_and_why_never_0(blind: Ledger) -> None:
    figures = recovery_figures(blind)
    assert figures["productive_s"] is None and figures["ettr"] is None and figures["lost_steps"] is None
    assert "reports no steps" in figures["productive_why"] and "training.log_pattern" in figures["productive_why"]
    at(blind, 119.5, "recovery_figures", **{k: v for k, v in figures.items() if k != "failures"})
    summary = summarize(blind)
    assert summary["steps_trained"] is None and "reports no steps" in summary["steps_trained_why"]
    text = format_summary(summary)
    assert "steps trained:    unknown (the script reports no steps" in text
    assert "ETTR unknown (the script reports no steps" in text
    html = report_html(summary)
    assert "productive training time (s)</td><td>unknown (the script reports no steps" in html
    assert "Steps trained: unknown (the script reports no steps" in html
    lines = notice_from_ledger(blind, RunFacts("byo", "r1", failed=False), ("recovery",)).lines  # type: ignore[union-attr]
    assert any(ln.startswith("Productive training time: unknown (the script reports no steps") for ln in lines)


def test_a_relaunch_without_a_resumed_event_resumes_at_the_orchestrator_s_checkpoint(tmp_path: Path) -> None:
    """Steps read from the script's log (``source: log``), no ``resumed`` from any rank: the step the
    orchestrator chose for attempt 2 (``attempt_start``'s ``resume_step``) is the resumed step, said as such."""
    ledger = Ledger(tmp_path / "events.jsonl")
    at(ledger, 100.0, "attempt_start", attempt=1, resume_step=0)
    for step in (1, 20, 40, 46):
        at(ledger, 100.0 + step / 10, "step", step=step, source="log", step_ms=100.0)
    at(ledger, 106.5, "failure_classified", attempt=1, kind="node_lost", detected_at=106.4)
    at(ledger, 108.0, "attempt_start", attempt=2, resume_step=40)
    at(ledger, 110.0, "step", step=41, source="log")
    at(ledger, 115.0, "step", step=60, source="log", first_step=42, steps=19, step_ms=100.0)
    at(ledger, 116.0, "stage_end", seconds=20.0)
    figures = recovery_figures(ledger)
    [failure] = figures["failures"]
    assert failure["lost_steps"] == 6 and failure["resumed_by"] == "orchestrator"  # 41..46 ran twice
    assert figures["resume_delay_s"] == pytest.approx(110.0 - 106.4)
    assert figures["productive_s"] is not None and figures["productive_s"] > 0


def test_a_relaunch_s_cost_is_split_into_detection_restart_restore_and_replay(ledger: Ledger) -> None:
    """Issue 53, item 4: where a fault's seconds went. The resumed event (no load time of its own, as an
    adapter's) at 110 ends the restart; the first step at 115 ends the restore; 2 lost steps at the 1 s median."""
    [failure] = recovery_figures(ledger)["failures"]
    assert (failure["detection_s"], failure["restart_s"], failure["restore_s"]) == (0.5, 3.5, 5.0)
    assert failure["detection_s"] + failure["restart_s"] + failure["restore_s"] == failure["resume_delay_s"]
    assert failure["replay_s"] == 2.0


def test_a_timed_state_load_is_restore_not_restart(tmp_path: Path) -> None:
    """The runtime's resumed says how long the load took: the ranks were up that much earlier."""
    ledger = Ledger(tmp_path / "events.jsonl")
    at(ledger, 100.0, "attempt_start", attempt=1)
    at(ledger, 101.0, "step", step=1, step_ms=1000)
    at(ledger, 102.0, "failure_classified", attempt=1, kind="node_lost", detected_at=101.5)
    at(ledger, 103.0, "attempt_start", attempt=2)
    at(ledger, 105.0, "resumed", step=1, seconds=1.5)
    at(ledger, 106.0, "step", step=2, step_ms=1000)
    at(ledger, 107.0, "stage_end", seconds=7.0)
    figures = recovery_figures(ledger)
    [failure] = figures["failures"]
    assert (failure["restart_s"], failure["restore_s"], failure["replay_s"]) == (1.5, 2.5, 0.0)
    assert figures["restart_total_s"] == 1.5 and figures["restore_total_s"] == 2.5 and figures["replay_total_s"] == 0.0


def test_a_script_without_a_resumed_event_has_its_restore_unknown_not_0(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "events.jsonl")
    at(ledger, 100.0, "attempt_start", attempt=1)
    at(ledger, 101.0, "step", step=1, step_ms=1000)
    at(ledger, 102.0, "failure_classified", attempt=1, kind="node_lost", detected_at=101.5)
    at(ledger, 103.0, "attempt_start", attempt=2, resume_step=1)
    at(ledger, 106.0, "step", step=2, step_ms=1000)
    at(ledger, 107.0, "stage_end", seconds=7.0)
    figures = recovery_figures(ledger)
    [failure] = figures["failures"]
    assert failure["restart_s"] == 4.0 and failure["restore_s"] is None  # start-up, load and first step, together
    assert figures["restore_total_s"] is None


def test_the_summary_the_notice_and_the_report_say_where_the_seconds_went(ledger: Ledger) -> None:
    figures = recovery_figures(ledger)  # as the train stage records them when it ends
    at(ledger, 119.5, "recovery_figures", **{k: v for k, v in figures.items() if k != "failures"})
    text = format_summary(summarize(ledger))
    assert "fault cost:       detection 0.5 s + restart 3.5 s + restore 5.0 s; replay 2.0 s" in text, text
    html = report_html(summarize(ledger))
    assert "cost, restart: classified to the new ranks loading state (s)</td><td>3.5" in html
    lines = notice_from_ledger(ledger, RunFacts("d", "r1", failed=False), ("recovery",)).lines  # type: ignore[union-attr]
    assert "Fault cost in all: detection 0.5 s + restart 3.5 s + restore 5.0 s; replay 2.0 s" in lines, lines


def test_steps_without_a_loss_are_still_a_summary(tmp_path: Path) -> None:
    """A log that says "Step 5/200" and no loss: the summary printed "step None to None" and then raised a
    TypeError formatting the missing loss (trainyard summary and the report stage alike)."""
    ledger = Ledger(tmp_path / "events.jsonl")
    at(ledger, 100.0, "attempt_start", attempt=1)
    at(ledger, 101.0, "step", step=5, first_step=1, steps=5, source="log")
    at(ledger, 102.0, "step", step=9, first_step=6, steps=4, step_ms=250.0, source="log")
    at(ledger, 103.0, "stage_end", seconds=3.0)
    text = format_summary(summarize(ledger))
    assert "steps trained:    9 (step 1 to 9)" in text and "loss:" not in text, text
    assert "9 steps trained (step 1 to 9)" in report_html(summarize(ledger))


def relaunched(tmp_path: Path, **resumed) -> Ledger:
    """Attempt 1 trains steps 1-12, node-1 is lost; attempt 2 says where it resumed (``resumed``'s fields)."""
    ledger = Ledger(tmp_path / "events.jsonl")
    at(ledger, 100.0, "attempt_start", attempt=1, resume_step=0)
    for step in range(1, 13):
        at(ledger, 100.0 + step / 10, "step", step=step, step_ms=100)
    at(ledger, 101.3, "drill_fired", fault="kill", node="node-1", step=12)
    at(ledger, 101.5, "failure_classified", attempt=1, kind="node_lost", detected_at=101.4)
    at(ledger, 102.0, "attempt_start", attempt=2, resume_step=10)
    at(ledger, 103.0, "resumed", **resumed)
    for step in range(resumed["step"] + 1, 21):
        at(ledger, 103.0 + step / 10, "step", step=step, step_ms=100)
    at(ledger, 106.0, "stage_end", seconds=6.0)
    figures = recovery_figures(ledger)
    at(ledger, 106.5, "recovery_figures", **{k: v for k, v in figures.items() if k != "failures"})
    return ledger


SNAPSHOT_WHY = "the snapshot of step 11 is newer than the checkpoint of step 10"


def test_each_fault_says_what_its_relaunch_resumed_from_and_why(tmp_path: Path) -> None:
    """Issue 53, item 2: the resumed event's source and why, per fault, in the figures, the summary, the report's
    recovery table and the notice (the same words)."""
    ledger = relaunched(tmp_path, step=11, source="snapshot", why=SNAPSHOT_WHY, copied_to_ranks=[2])
    [failure] = recovery_figures(ledger)["failures"]
    assert (failure["resumed_step"], failure["resumed_source"]) == (11, "snapshot")
    assert failure["resumed_why"] == SNAPSHOT_WHY and failure["copied_to_ranks"] == [2] and failure["lost_steps"] == 1
    said = f"resumed from the in-memory snapshot of step 11 ({SNAPSHOT_WHY}); rank 2 received it from a peer"
    assert f"  fault 1 (node_lost, attempt 1): {said}" in format_summary(summarize(ledger)).splitlines()
    assert f"<td>fault 1 (node_lost, attempt 1)</td><td>{said}</td>" in report_html(summarize(ledger))
    lines = notice_from_ledger(ledger, RunFacts("d", "r1", failed=False), ("recovery",)).lines  # type: ignore[union-attr]
    assert f"Fault 1 (node_lost, attempt 1): {said}" in lines, lines


@pytest.mark.parametrize(
    ("resumed", "said"),
    [
        (
            {"step": 10, "source": "checkpoint", "why": "no whole in-memory snapshot is newer"},
            "resumed from the checkpoint of step 10 (no whole in-memory snapshot is newer)",
        ),
        (
            {"step": 10, "source": "checkpoint", "why": "in-memory snapshots are off"},
            "resumed from the checkpoint of step 10 (in-memory snapshots are off)",
        ),
        ({"step": 10}, "resumed from step 10"),  # a runtime from before snapshots, or an adapter: no source said
        # Worker text: a source outside the vocabulary is not said; a why is one printable line.
        ({"step": 10, "source": "disk\n", "why": "a\nforged: line"}, "resumed from step 10 (a\\nforged: line)"),
    ],
)
def test_a_checkpoint_resume_says_so_and_why_and_an_unsaid_source_is_not_guessed(
    tmp_path: Path, resumed: dict, said: str
) -> None:
    ledger = relaunched(tmp_path, **resumed)
    assert f"  fault 1 (node_lost, attempt 1): {said}" in format_summary(summarize(ledger)).splitlines()


def test_a_fault_healed_in_place_says_the_step_its_group_went_on_from(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "events.jsonl")
    at(ledger, 100.0, "attempt_start", attempt=1)
    for step in range(1, 5):
        at(ledger, 100.0 + step, "step", step=step, step_ms=1000)
    at(ledger, 104.5, "failure_classified", attempt=1, kind="node_lost", detected_at=104.4)
    at(ledger, 105.0, "regrouped", generation=2, world_size=2, from_step=4)
    at(ledger, 106.0, "step", step=5, step_ms=1000)
    at(ledger, 107.0, "stage_end", seconds=7.0)
    at(ledger, 107.5, "recovery_figures", resume_delay_s=1.6)
    assert "  fault 1 (node_lost, attempt 1): regrouped in place from step 4" in format_summary(summarize(ledger))


def test_a_run_without_faults_has_no_resume_lines(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "events.jsonl")
    at(ledger, 100.0, "attempt_start", attempt=1)
    at(ledger, 101.0, "step", step=1, step_ms=1000)
    at(ledger, 102.0, "stage_end", seconds=2.0)
    at(ledger, 102.5, "recovery_figures", resume_delay_s=None)
    assert "fault 1" not in format_summary(summarize(ledger))
