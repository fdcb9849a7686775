"""Recovery figures of one run, computed from its ledger alone: from the fold (``trainyard.events.fold``:
attempts, failures, drills, the groups formed in place, the spares) and the run's step events.

- detection: fault to classified (the fault's time is the drill's ``drill_fired``
  when a drill caused it, else the moment the supervisor saw the attempt end);
- resume delay: fault to the first step of the next attempt, or, where the
  survivors regrouped in place (a ``regrouped`` event after the classification and
  before any next attempt), to the first step after the regroup;
- the cost split: detection, ``restart_s`` (classified to the new ranks loading their state), ``restore_s``
  (from there to the first step after the fault) and ``replay_s`` (the lost steps at the median step time),
  per failure and in all (``<part>_total_s``): detection, restart and restore add up to the resume delay;
- lost steps: the last step reached before the fault (the latest of the step
  events and the heartbeats' step in the attempt's ``attempt_end``, or in place
  in the ``failure_classified``) minus the
  step resumed from (``resumed``, or the regroup's ``from_step``);
- unknown, and why (``resume_delay_why``, ``lost_steps_why``), where the script reports no steps (it makes
  no ``trainyard.runtime.heartbeat`` calls, so the run has no step events): neither the first step after a
  fault nor the steps lost are known, and they are not shown as 0;
- what a fault's training resumed from, per failure: ``resumed_step``, and for a relaunch the ``resumed``
  event's ``resumed_source`` (``snapshot`` or ``checkpoint``), ``resumed_why`` and ``copied_to_ranks``;
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

COST_PARTS = ("detection", "restart", "restore", "replay")
"""A fault's cost, part by part (``<part>_s`` per failure, ``<part>_total_s`` over the run)."""


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
    kept = kept_stretches(steps)  # once: the median step time prices replay and productive time alike
    step_s = _step_s(kept)
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
                             "resume_delay_s": None, "restart_s": None, "restore_s": None, "replay_s": None,
                             "lost_steps": None, **_resumed_from("in_place_unformed", None, None)})  # fmt: skip
            continue
        # The heartbeats' last step: the attempt's end has it (in place, the attempt ends long after: the
        # classification has it, as seen at the fault).
        last = failure.step if in_place else attempt.last_step
        reached += [last] if last is not None else []
        if regrouped and in_place:
            path, first_step, resumed_from = "in_place", _first_step(steps, regrouped.at), regrouped.from_step
            ready: float | None = regrouped.at  # the new generation formed: its state is the survivors'
        else:
            first_step = _first_step(steps, nxt.started) if nxt else None
            path, resumed_from = "relaunch", _resumed(nxt)
            # The new ranks began loading their state: rank 0's resumed, less the load it timed (an adapter's
            # resumed is written before its framework loads: no time of its own); unknown without a resumed.
            ready = None if nxt is None or nxt.resumed_at is None else nxt.resumed_at - (nxt.restore_s or 0.0)
        lost = max(reached) - resumed_from if steps and reached and resumed_from is not None else None
        failures.append(
            {
                "attempt": attempt.number,
                "kind": failure.kind,
                "path": path,
                "fault_at": fault_at,
                "detection_s": round(failure.at - fault_at, 3),
                "resume_delay_s": round(first_step["ts"] - fault_at, 3) if first_step else None,
                **_split(failure.at, ready, first_step["ts"] if first_step else None, lost, step_s),
                "lost_steps": lost,
                **_resumed_from(path, resumed_from, nxt),
                **(
                    {"resumed_by": "orchestrator"}
                    if nxt and path == "relaunch" and nxt.resumed_step is None and nxt.resume_step is not None
                    else {}
                ),
            }
        )
    return {**_failures_figures(train, failures, steps), **_training_figures(steps, kept, step_s, wall)}


def _split(
    classified: float, ready: float | None, first: float | None, lost: int | None, step_s: float | None
) -> dict[str, float | None]:
    """Where one fault's seconds went after its detection (``detection_s`` is the fault to its classification):
    ``restart_s``, classified to the new ranks loading their state (a relaunch: the back-off, the launch, the
    processes' start-up and imports; in place: the new generation formed); ``restore_s``, from there to the
    first step trained after it (the state read, broadcast to a joiner, and that first step); ``replay_s``, the
    steps lost trained again, at the run's median step time. Detection, restart and restore add up to the resume
    delay. Unknown (None) where the ledger cannot say: no step after the fault, or a relaunch whose ranks wrote
    no ``resumed`` (a script without trainyard calls: restart then runs to its first step, restore unknown)."""
    if first is None:
        return {"restart_s": None, "restore_s": None, "replay_s": None}
    replay = None if lost is None or step_s is None else round(lost * step_s, 3)
    if ready is None or not classified <= ready <= first:
        return {"restart_s": round(max(first - classified, 0.0), 3), "restore_s": None, "replay_s": replay}
    return {"restart_s": round(ready - classified, 3), "restore_s": round(first - ready, 3), "replay_s": replay}


def _step_s(kept: Sequence[tuple[int, float | None]]) -> float | None:
    """The run's median step time in seconds, over its kept stretches (None: no step was timed)."""
    timed = [(n, ms / 1000) for n, ms in kept if ms is not None]
    return weighted_median(timed)


def _resumed(nxt: AttemptRun | None) -> int | None:
    """The step a relaunch resumed from: its rank's word (``resumed``), else the orchestrator's (the checkpoint
    it chose, ``attempt_start``'s ``resume_step``: a script that writes no ``resumed``), else a fresh start."""
    if nxt is None:
        return None
    if nxt.resumed_step is not None:
        return nxt.resumed_step
    return nxt.resume_step if nxt.resume_step is not None else 0


def _resumed_from(path: str, step: int | None, nxt: AttemptRun | None) -> dict[str, Any]:
    """What the fault's training resumed from: ``resumed_step``, and for a relaunch ``resumed_source``
    (``snapshot``/``checkpoint``, None where its ranks did not say), ``resumed_why`` and ``copied_to_ranks``
    (the ``resumed`` event's words)."""
    said = nxt if path == "relaunch" and nxt is not None and nxt.resumed_step is not None else None
    return {
        "resumed_step": step,
        "resumed_source": said.resumed_source if said else None,
        "resumed_why": said.resumed_why if said else None,
        "copied_to_ranks": list(said.copied_to_ranks) if said else [],
    }


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
        **_totals(failures),
        "resume_delay_s": max(delays, default=None),
        "resume_delay_why": delay_why,
        "lost_steps": None if blind else sum(f["lost_steps"] or 0 for f in failures),
        "lost_steps_why": NO_STEPS if blind else None,
    }


def _totals(failures: list[dict[str, Any]]) -> dict[str, float | None]:
    """Every fault's cost, part by part, in all (``<part>_total_s``): where the seconds went (None: no fault had
    that part known)."""
    totals: dict[str, float | None] = {}
    for part in COST_PARTS:
        known = [f[f"{part}_s"] for f in failures if f.get(f"{part}_s") is not None]
        totals[f"{part}_total_s"] = round(sum(known), 3) if known else None
    return totals


def _training_figures(
    steps: Sequence[Mapping[str, Any]],
    kept: Sequence[tuple[int, float | None]],
    step_s: float | None,
    wall: float | None,
) -> dict[str, Any]:
    """Productive time and ETTR from the step events (``kept``: their kept stretches, ``step_s``: the median step
    time); unknown, with why, where there are none (a script that
    reports no steps trained for an unknown time, not for 0 s)."""
    if not steps:
        return {"productive_s": None, "ettr": None, "productive_why": NO_STEPS, "ettr_why": NO_STEPS}
    # A stretch without a time (the log's first steps of an attempt, seen at once) counts at the median of the rest.
    productive = sum(n for n, _ in kept) * (step_s or 0.0)
    return {
        "productive_s": round(productive, 3),
        "ettr": round(productive / wall, 4) if wall else None,
        "productive_why": None,
        "ettr_why": None if wall else "the train stage has not ended: its wall time is not known yet",
    }
