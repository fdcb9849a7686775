"""Every fault of an attempt, and each growth of its world, as one line of text: the same words in the HTML
report, ``trainyard summary`` and the notice mail (read from the fold's rows, ``summary.attempt_table``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainyard.recovery.figures import COST_PARTS


def fault_line(fault: Mapping[str, Any]) -> str:
    """``node_lost on node-0 -> regroup in place, generation 2, joined by node-3``; a relaunch's decision
    reads ``hang on node-1 -> scale_down``."""
    failure, decision = fault.get("failure") or {}, fault.get("decision") or {}
    culprits = failure.get("culprits") or []
    what = f"{failure.get('kind') or decision.get('kind') or 'failure'}" + (
        f" on {', '.join(culprits)}" if culprits else ""
    )
    if not decision.get("action"):
        return f"{what} (no decision recorded)"
    done = decision["action"]
    if decision.get("path") == "in_place":
        done += " in place"
        if decision.get("generation") is not None:
            done += f", generation {decision['generation']}"
        joiners = decision.get("joiners") or []
        if joiners:
            done += f", joined by {', '.join(joiners)}"
    return f"{what} -> {done}"


def growth_line(growth: Mapping[str, Any]) -> str:
    """``grown in place, generation 4, joined by node-0 (3 nodes)``."""
    joiners = ", ".join(growth.get("joiners") or []) or "-"
    return (
        f"grown in place, generation {growth.get('generation')}, joined by {joiners}"
        f" ({len(growth.get('nodes') or [])} nodes)"
    )


def attempt_lines(row: Mapping[str, Any]) -> list[str]:
    """The attempt's faults and growths in the order they happened, each as one line."""
    dated = [((f.get("failure") or f.get("decision") or {}).get("ts") or 0.0, fault_line(f)) for f in row["faults"]]
    dated += [(g.get("ts") or 0.0, growth_line(g)) for g in row.get("growths") or []]
    return [line for _, line in sorted(dated, key=lambda d: d[0])]


def cost_line(figures: Mapping[str, Any]) -> str | None:
    """Where the faults' seconds went, in all: ``detection 0.5 s + restart 3.5 s + restore 5.0 s; replay 2.0 s``
    (``-`` for a part no fault had known); None for a run without a fault timed."""
    totals = {part: figures.get(f"{part}_total_s") for part in COST_PARTS}
    if all(value is None for value in totals.values()):
        return None
    said = {part: f"{part} {'-' if value is None else f'{value} s'}" for part, value in totals.items()}
    return f"{said['detection']} + {said['restart']} + {said['restore']}; {said['replay']}"


SOURCE_WORDS = {"snapshot": "the in-memory snapshot", "checkpoint": "the checkpoint"}
"""How a relaunch's ``resumed_source`` reads in a line."""


def resume_line(failure: Mapping[str, Any]) -> str | None:
    """What one fault's training went on from (a failure of the recovery figures): ``resumed from the in-memory
    snapshot of step 11 (the snapshot of step 11 is newer than the checkpoint of step 10)``, ``regrouped in
    place from step 12``; None where the ledger does not say (no step after the fault)."""
    step = failure.get("resumed_step")
    if step is None:
        return None
    if failure.get("path") == "in_place":
        return f"regrouped in place from step {step}"
    source = SOURCE_WORDS.get(failure.get("resumed_source") or "")
    said = f"resumed from {source} of step {step}" if source else f"resumed from step {step}"
    if not source and failure.get("resumed_by") == "orchestrator":
        said += " (the checkpoint the orchestrator chose: the script wrote no resumed event)"
    if failure.get("resumed_why"):
        said += f" ({failure['resumed_why']})"
    copied = failure.get("copied_to_ranks") or []
    if copied:
        said += f"; rank{'s' if len(copied) > 1 else ''} {', '.join(map(str, copied))} received it from a peer"
    return said


def resumed_by_fault(figures: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``("fault 1 (node_lost, attempt 1)", "resumed from ...")`` for every fault of the run's recovery figures
    whose resumption the ledger tells: the summary's lines and the report's recovery table's rows."""
    rows = []
    for i, failure in enumerate(figures.get("failures") or [], start=1):
        if said := resume_line(failure):
            rows.append((f"fault {i} ({failure.get('kind')}, attempt {failure.get('attempt')})", said))
    return rows
