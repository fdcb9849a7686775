"""trainyard's recovery figures against its peers' (torchrun, torchft, NVRx) from the same bench run.

Pure arithmetic over the figures ``bench/recovery.py`` gathers, each peer's from
``recovery_figures`` over the same ledger events as trainyard's. A peer counts
for ETTR only if it finished (an unfinished run has no ETTR), and for the resume
delay only if it resumed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from trainyard.events.fold import TrainRun
from trainyard.protocol.steps import weighted_median


def versus_best_peer(ours: Mapping[str, Any], peers: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """``best_peer``: the peer with the highest ETTR (ties: the lower resume delay), and ours over its
    ETTR; ``best_resume_peer``: the peer that resumed fastest, and our resume delay over its. A ratio is
    None where either side lacks the figure (a ratio >= 1.0 beats the peer on ETTR, <= 1.0 on resume)."""
    finished = [(name, p) for name, p in peers.items() if p.get("finished") and p.get("ettr")]
    resumed = [(name, p) for name, p in peers.items() if p.get("resumed") and p.get("resume_delay_s")]
    best = max(finished, key=lambda np: (np[1]["ettr"], -(np[1].get("resume_delay_s") or 0.0)), default=None)
    fastest = min(resumed, key=lambda np: np[1]["resume_delay_s"], default=None)
    return {
        "best_peer": best[0] if best else None,
        "ettr_vs_best_peer": _ratio(ours.get("ettr"), best[1]["ettr"] if best else None),
        "best_resume_peer": fastest[0] if fastest else None,
        "resume_delay_vs_best_peer": _ratio(
            ours.get("resume_delay_s"), fastest[1]["resume_delay_s"] if fastest else None
        ),
    }


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return round(ours / theirs, 3) if ours is not None and theirs else None


def no_fault_step_ms(train: TrainRun) -> float | None:
    """The median step time (ms) of the folded run's ``step`` events before its first drill fired (all, if
    none): the cost of a step without a fault, comparable across runtimes. An event that sums up several
    steps stands for them with its mean."""
    fault = train.fired[0].at if train.fired else math.inf
    timed = [(e, e.get("step_ms_mean", e.get("step_ms"))) for e in train.steps if e["ts"] < fault]
    return weighted_median([(int(e.get("steps", 1)), float(ms)) for e, ms in timed if ms is not None])
