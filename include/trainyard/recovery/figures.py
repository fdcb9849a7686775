"""Recovery figures of one run, computed from its ledger alone.

- detection: fault to classified (the fault's time is the drill's ``drill_fired``
  when a drill caused it, else the moment the supervisor saw the attempt end);
- resume delay: fault to the first step of the next attempt, or, where the
  survivors regrouped in place (a ``regrouped`` event after the classification and
  before any next attempt), to the first step after the regroup;
- lost steps: the last step reached before the fault (the latest of the step
  events and the heartbeats' step in the attempt's ``attempt_end``, or in place
  in the ``failure_classified``) minus the
  step resumed from (``resumed``, or the regroup's ``from_step``);
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

from typing import Any

from trainyard.events.ledger import Ledger
from trainyard.protocol.steps import kept_stretches, weighted_median


def _first(events: list[dict[str, Any]], after: float, event: str, **match: Any) -> dict[str, Any] | None:
    return next(
        (
            e
            for e in events
            if e["ts"] >= after and e["event"] == event and all(e.get(k) == v for k, v in match.items())
        ),
        None,
    )


def recovery_figures(ledger: Ledger) -> dict[str, Any]:
    events = list(ledger.events("train"))
    failures = []
    seen_before = 0.0  # the previous classification: an attempt healed in place can fail again
    unhealed: float | None = None  # the fault of a regroup that never formed: the next failure carries it on
    for classified in (e for e in events if e["event"] == "failure_classified"):
        attempt = classified["attempt"]
        start = _first(events, 0, "attempt_start", attempt=attempt) or {"ts": 0}
        drill = _first(events, max(start["ts"], seen_before), "drill_fired")
        seen_before = classified["ts"]
        fault_at = drill["ts"] if drill and drill["ts"] <= classified["ts"] else classified["detected_at"]
        fault_at, unhealed = (fault_at if unhealed is None else unhealed), None
        steps = [e["step"] for e in events if e["event"] == "step" and start["ts"] <= e["ts"] <= classified["ts"]]
        nxt = _first(events, classified["ts"], "attempt_start", attempt=attempt + 1)
        regrouped = _first(events, classified["ts"], "regrouped")
        later = next((e for e in events if e["event"] == "failure_classified" and e["ts"] > classified["ts"]), None)
        in_place = regrouped is not None and all(x is None or regrouped["ts"] < x["ts"] for x in (nxt, later))
        if not in_place and later is not None and later["attempt"] == attempt:
            # Decided in place, but the group never formed before the attempt failed again: one fault, judged
            # (resumption, lost steps) with the failure that ended it.
            unhealed = fault_at
            failures.append({"attempt": attempt, "kind": classified["kind"], "path": "in_place_unformed",
                             "fault_at": fault_at, "detection_s": round(classified["ts"] - fault_at, 3),
                             "resume_delay_s": None, "lost_steps": None})  # fmt: skip
            continue
        ended = _first(events, start["ts"], "attempt_end", attempt=attempt) or {}
        # The heartbeats' last step: the attempt's end has it (in place, the attempt ends long after: the
        # classification has it, as seen at the fault).
        last = classified.get("step") if in_place else ended.get("last_step")
        steps += [last] if last is not None else []
        if regrouped and in_place:
            path, first_step, resumed_from = "in_place", _first(events, regrouped["ts"], "step"), regrouped["from_step"]
        else:
            resumed = _first(events, nxt["ts"], "resumed") if nxt else None
            first_step = _first(events, nxt["ts"], "step") if nxt else None
            path, resumed_from = "relaunch", (resumed["step"] if resumed else 0) if nxt else None
        failures.append(
            {
                "attempt": attempt,
                "kind": classified["kind"],
                "path": path,
                "fault_at": fault_at,
                "detection_s": round(classified["ts"] - fault_at, 3),
                "resume_delay_s": round(first_step["ts"] - fault_at, 3) if first_step else None,
                "lost_steps": max(steps) - resumed_from if steps and resumed_from is not None else None,
            }
        )
    kept = [(n, (ms or 0.0) / 1000) for n, ms in kept_stretches([e for e in events if e["event"] == "step"])]
    productive = sum(n for n, _ in kept) * (weighted_median(kept) or 0.0)
    end = next((e for e in reversed(events) if e["event"] in ("stage_end", "stage_failed")), None)
    wall = end["seconds"] if end else None
    worlds = [
        (e["ts"], e["world_size"]) for e in events if e["event"] in ("attempt_start", "regrouped") and "world_size" in e
    ]
    waiting: dict[str, None] = {}  # in order: a node can wait, join, die and wait again
    joined: list[str] = []
    for e in events:
        if e["event"] in ("spares_warm", "rejoining"):
            waiting.update(dict.fromkeys(e["nodes"]))
        for node in e.get("joiners") or [] if e["event"] in ("decision", "grown") else []:
            waiting.pop(node, None)
            joined.append(node)
    idle = list(waiting)
    return {
        "failures": failures,
        "world_sizes": worlds,
        "world_path": " -> ".join(str(w) for _, w in worlds) or None,
        "spares_joined": ", ".join(dict.fromkeys(joined)) or None,
        "spares_idle": ", ".join(idle) or None,
        "detection_s": max((f["detection_s"] for f in failures), default=None),
        "resume_delay_s": max((f["resume_delay_s"] for f in failures if f["resume_delay_s"] is not None), default=None),
        "lost_steps": sum(f["lost_steps"] or 0 for f in failures),
        "productive_s": round(productive, 3),
        "ettr": round(productive / wall, 4) if wall else None,
    }
