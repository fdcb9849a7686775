"""Recovery figures of one run, computed from its ledger alone: from the fold (``trainyard.events.fold``:
attempts, failures, drills, the groups formed in place, the spares) and the run's step events.

- detection: fault to classified (the fault's time is the drill's ``drill_fired``
  when a drill caused it, else the moment the supervisor saw the attempt end);
- resume delay: fault to the first step of the next attempt, or, where the
  survivors regrouped in place (a ``regrouped`` event after the classification and
  before any next attempt), to the first step after the regroup;
- lost steps: the last step reached before the fault (the latest of the step
  events and the heartbeats' step in the attempt's ``attempt_end``, or in place
  in the ``failure_classified``) minus the
  step resumed from (``resumed``, or the regroup's ``from_step``);
- unknown, and why (``resume_delay_why``, ``lost_steps_why``), where the script reports no steps (it makes
  no ``trainyard.runtime.heartbeat`` calls, so the run has no step events): neither the first step after a
  fault nor the steps lost are known, and they are not shown as 0;
- path: ``in_place`` or ``relaunch``, per failure; ``in_place_unformed`` for a regroup decided in place
  whose group never formed before the attempt failed again: that next failure carries its fault's time
  on and its resumption and lost steps count once, there;
- world sizes: the world of each attempt and each regroup or growth, in order,
  as ``(ts, world)``, and the same as a line (``world_path``: ``3 -> 2 -> 3``);
- spares: the nodes waiting outside the group (warm spares started with an
  attempt, nodes started again after a dead process) that joined, and those
  still idle at the end;
- ETTR: productive training time over the wall time of the train stage. The
  productive time is the steps that count (a step run again after a fault counts
  once) times the run's median step time: a step slowed by a background
  checkpoint save is charged to the save, not counted as training. A step event
  that sums up several steps stands for them with its mean step time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from trainyard.events.fold import RunState, TrainRun, fold
from trainyard.events.ledger import Ledger
from trainyard.events.records import AttemptRun
from trainyard.protocol.steps import NO_STEPS, kept_stretches, weighted_median


def _first_step(steps: Sequence[Mapping[str, Any]], after: float) -> Mapping[str, Any] | None:
    return next((e for e in steps if e["ts"] >= after), None)


def recovery_figures(ledger: Ledger) -> dict[str, Any]:
    return figures_from(fold(ledger.events("train")))


def figures_from(state: RunState) -> dict[str, Any]:
    """The figures of a folded run: its training, its ``step`` events (times and step numbers) and the train
    stage's wall time (its last end or failure)."""
    train, steps = state.train, state.train.steps
    wall = state.stages.get("train", {}).get("seconds")
    failures: list[dict[str, Any]] = []
    seen_before = 0.0  # the previous classification: an attempt healed in place can fail again
    unhealed: float | None = None  # the fault of a regroup that never formed: the next failure carries it on
    drills = [d for a in train.attempts for d in a.drills]
    classified = [(a, f) for a in train.attempts for f in a.failures]
    for i, (attempt, failure) in enumerate(classified):
        drill = next((d for d in drills if d.at >= max(attempt.started, seen_before)), None)
        seen_before = failure.at
        fault_at = drill.at if drill and drill.at <= failure.at else (failure.detected_at or failure.at)
        fault_at, unhealed = (fault_at if unhealed is None else unhealed), None
        reached = [e["step"] for e in steps if attempt.started <= e["ts"] <= failure.at]
        nxt = next((a for a in train.attempts if a.number == attempt.number + 1 and a.started >= failure.at), None)
        regrouped = next((g for g in train.formed if g.at >= failure.at), None)
        later = classified[i + 1] if i + 1 < len(classified) else None
        in_place = regrouped is not None and all(
            x is None or regrouped.at < x for x in (nxt.started if nxt else None, later[1].at if later else None)
        )
        if not in_place and later is not None and later[0].number == attempt.number:
            # Decided in place, but the group never formed before the attempt failed again: one fault, judged
            # (resumption, lost steps) with the failure that ended it.
            unhealed = fault_at
            failures.append({"attempt": attempt.number, "kind": failure.kind, "path": "in_place_unformed",
                             "fault_at": fault_at, "detection_s": round(failure.at - fault_at, 3),
                             "resume_delay_s": None, "lost_steps": None})  # fmt: skip
            continue
        # The heartbeats' last step: the attempt's end has it (in place, the attempt ends long after: the
        # classification has it, as seen at the fault).
        last = failure.step if in_place else attempt.last_step
        reached += [last] if last is not None else []
        if regrouped and in_place:
            path, first_step, resumed_from = "in_place", _first_step(steps, regrouped.at), regrouped.from_step
        else:
            first_step = _first_step(steps, nxt.started) if nxt else None
            path, resumed_from = "relaunch", _resumed(nxt)
        failures.append(
            {
                "attempt": attempt.number,
                "kind": failure.kind,
                "path": path,
                "fault_at": fault_at,
                "detection_s": round(failure.at - fault_at, 3),
                "resume_delay_s": round(first_step["ts"] - fault_at, 3) if first_step else None,
                "lost_steps": max(reached) - resumed_from if steps and reached and resumed_from is not None else None,
                **(
                    {"resumed_by": "orchestrator"}
                    if nxt and path == "relaunch" and nxt.resumed_step is None and nxt.resume_step is not None
                    else {}
                ),
            }
        )
    return {**_failures_figures(train, failures, steps), **_training_figures(steps, wall)}


def _resumed(nxt: AttemptRun | None) -> int | None:
    """The step a relaunch resumed from: its rank's word (``resumed``), else the orchestrator's (the checkpoint
    it chose, ``attempt_start``'s ``resume_step``: a script that writes no ``resumed``), else a fresh start."""
    if nxt is None:
        return None
    if nxt.resumed_step is not None:
        return nxt.resumed_step
    return nxt.resume_step if nxt.resume_step is not None else 0


def _failures_figures(
    train: TrainRun, failures: list[dict[str, Any]], steps: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """The figures of the faults: unknown (None, with why) rather than 0 where the script reports no steps."""
    delays = [f["resume_delay_s"] for f in failures if f["resume_delay_s"] is not None]
    blind = bool(failures) and not steps
    delay_why = None
    if failures and not delays:
        delay_why = NO_STEPS if blind else "no step was recorded after a resume"
    return {
        "failures": failures,
        "world_sizes": list(train.worlds),
        "world_path": train.world_path,
        "spares_joined": ", ".join(dict.fromkeys(train.joined)) or None,
        "spares_idle": ", ".join(train.waiting) or None,
        "detection_s": max((f["detection_s"] for f in failures), default=None),
        "resume_delay_s": max(delays, default=None),
        "resume_delay_why": delay_why,
        "lost_steps": None if blind else sum(f["lost_steps"] or 0 for f in failures),
        "lost_steps_why": NO_STEPS if blind else None,
    }


def _training_figures(steps: Sequence[Mapping[str, Any]], wall: float | None) -> dict[str, Any]:
    """Productive time and ETTR from the step events; unknown, with why, where there are none (a script that
    reports no steps trained for an unknown time, not for 0 s)."""
    if not steps:
        return {"productive_s": None, "ettr": None, "productive_why": NO_STEPS, "ettr_why": NO_STEPS}
    kept = kept_stretches(steps)
    # A stretch without a time (the log's first steps of an attempt, seen at once) counts at the median of the rest.
    timed = [(n, ms / 1000) for n, ms in kept if ms is not None]
    productive = sum(n for n, _ in kept) * (weighted_median(timed) or 0.0)
    return {
        "productive_s": round(productive, 3),
        "ettr": round(productive / wall, 4) if wall else None,
        "productive_why": None,
        "ettr_why": None if wall else "the train stage has not ended: its wall time is not known yet",
    }
