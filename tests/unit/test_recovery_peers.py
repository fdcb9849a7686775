"""trainyard against its bench peers: which peer is best, and the ratios to it."""

from __future__ import annotations

from peers.versus import no_fault_step_ms, versus_best_peer

from trainyard.events.fold import TrainRun


def test_best_peer_is_the_highest_ettr_that_finished_and_the_fastest_resume_is_its_own() -> None:
    peers = {
        "torchrun": {"finished": True, "resumed": True, "ettr": 0.56, "resume_delay_s": 48.0},
        "torchft": {"finished": True, "resumed": True, "ettr": 0.80, "resume_delay_s": 2.0},
        "nvrx": {"finished": False, "resumed": True, "ettr": None, "resume_delay_s": 1.6},  # no ETTR: unfinished
    }
    out = versus_best_peer({"ettr": 0.96, "resume_delay_s": 1.2}, peers)
    assert out == {
        "best_peer": "torchft",
        "ettr_vs_best_peer": 1.2,
        "best_resume_peer": "nvrx",
        "resume_delay_vs_best_peer": 0.75,
    }


def test_equal_ettr_goes_to_the_faster_resume_and_missing_figures_give_none() -> None:
    peers = {
        "a": {"finished": True, "resumed": True, "ettr": 0.8, "resume_delay_s": 3.0},
        "b": {"finished": True, "resumed": True, "ettr": 0.8, "resume_delay_s": 2.0},
    }
    assert versus_best_peer({"ettr": 0.4, "resume_delay_s": None}, peers)["best_peer"] == "b"
    none_ran = {"nvrx": {"ran": False, "why": "nvidia_resiliency_ext is not installed"}}
    assert versus_best_peer({"ettr": 0.9, "resume_delay_s": 1.0}, none_ran) == {
        "best_peer": None,
        "ettr_vs_best_peer": None,
        "best_resume_peer": None,
        "resume_delay_vs_best_peer": None,
    }


def test_no_fault_step_time_is_the_median_before_the_drill() -> None:
    events = [
        {"event": "attempt_start", "attempt": 1},
        {"event": "step", "step": 1, "step_ms": 900.0},  # the first step pays for warm-up
        {"event": "step", "step": 2, "step_ms": 100.0},
        {"event": "step", "step": 12, "first_step": 3, "steps": 10, "step_ms": 130.0, "step_ms_mean": 110.0},
        {"event": "drill_fired", "fault": "kill"},
        {"event": "step", "step": 13, "step_ms": 5000.0},  # after the fault: not a no-fault step
    ]
    ledger = [{"ts": 100.0 + i, "stage": "train", **e} for i, e in enumerate(events)]
    assert no_fault_step_ms(TrainRun.of(ledger)) == 110.0
    assert no_fault_step_ms(TrainRun.of(ledger[:1] + ledger[4:5])) is None
