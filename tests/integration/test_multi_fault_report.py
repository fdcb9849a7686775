"""One attempt that heals two faults in place, read back as a person would: report.html, `trainyard summary`
and the notice mail each name every fault, its decision and the world path.

node-0 is killed at step 5 (the warm spare node-3 joins; node-0 starts again and waits outside the group),
then node-1 hangs at step 25 (killed, left out; node-0 joins, in that regroup or in a growth after it): one
attempt, two failures healed in place. On the code before the one fold, the report kept only the last
decision of an attempt (the hang), without its path, joiners or generation, and the summary and the notice
said nothing of the first fault's regroup.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest
from test_in_place import GROWING, GROWING_STEPS
from test_recovery import events, run_with

from trainyard import cli
from trainyard.pipeline import stages
from trainyard.report.notice import RunFacts, notice_from_ledger

pytestmark = [pytest.mark.integration, pytest.mark.alone]  # a hang is judged by the clock

SPEC = GROWING.replace("nodes: {{count: 3, min: 2}}", "nodes: {{count: 3, min: 2, spare: 1}}").replace(
    f"max_steps: {GROWING_STEPS}", "max_steps: 45"
)


def expected_lines(run) -> list[str]:
    """What each reader must say, from the ledger's own events: every fault, its decision, every growth."""
    said = []
    for failure, decision in zip(events(run, "failure_classified"), events(run, "decision"), strict=True):
        joined = f", joined by {', '.join(decision['joiners'])}" if decision["joiners"] else ""
        said.append(f"{failure['kind']} on {failure['culprits'][0]} -> regroup in place,"
                    f" generation {decision['generation']}{joined}")  # fmt: skip
    for grown in events(run, "grown"):
        said.append(f"grown in place, generation {grown['generation']}, joined by {', '.join(grown['joiners'])}")
    return said


def test_every_fault_of_an_attempt_healed_twice_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = run_with(tmp_path, "[{fault: kill, node: node-0, step: 5}, {fault: hang, node: node-1, step: 25}]", spec=SPEC)
    result = stages.train(run, ["node-0", "node-1", "node-2"], spares=["node-3"])
    assert result.attempts == 1
    assert [(e["kind"], e["culprits"]) for e in events(run, "failure_classified")] == [
        ("node_lost", ["node-0"]),
        ("hang", ["node-1"]),
    ]
    decisions = events(run, "decision")
    assert [(d["action"], d["path"], d["generation"]) for d in decisions] == [
        ("regroup", "in_place", 2),
        ("regroup", "in_place", 3),
    ]
    assert decisions[0]["joiners"] == ["node-3"]  # the warm spare
    joined_later = decisions[1]["joiners"] + [n for g in events(run, "grown") for n in g["joiners"]]
    assert joined_later == ["node-0"]  # started again after its kill, it joins at the hang's regroup or after
    worlds = [e["world_size"] for e in events(run, "attempt_start") + events(run, "regrouped")]
    world_path = " -> ".join(map(str, worlds))
    assert len(worlds) >= 3

    stages.report(run)
    page = html.unescape(re.sub(r"<[^>]+>", " ", (run.dir / "report.html").read_text()))
    assert cli.main(["summary", str(run.dir)]) == 0
    summary = capsys.readouterr().out
    notice = notice_from_ledger(run.ledger, RunFacts("recovery", run.run_id, failed=False), {"recovery"})
    assert notice is not None and notice.kind == "recovery"
    lines = expected_lines(run)
    for name, text in (("report.html", page), ("trainyard summary", summary), ("the notice", notice.text)):
        flat = " ".join(text.split())
        for line in lines:
            assert line in flat, f"{name} lacks {line!r}:\n{text}"
        assert f"world path: {world_path}" in flat.lower(), f"{name} lacks the world path {world_path}:\n{text}"
