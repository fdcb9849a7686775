"""One attempt that heals two faults in place, read back as a person would: report.html, `trainyard summary`
and the notice mail each name every fault, its decision and the world path.

node-0 is killed at step 5 (the warm spare node-3 joins; node-0 starts again and waits), then node-1 hangs
at step 25 (killed, left out; node-0 rejoins): one attempt, two failures, two regroups.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest
from test_in_place import GROWING
from test_recovery import events, run_with

from trainyard import cli
from trainyard.pipeline import stages
from trainyard.report.notice import RunFacts, notice_from_ledger

pytestmark = [pytest.mark.integration, pytest.mark.alone]  # a hang is judged by the clock

SPEC = GROWING.replace("nodes: {{count: 3, min: 2}}", "nodes: {{count: 3, min: 2, spare: 1}}").replace(
    "max_steps: 80", "max_steps: 45"
)


def test_every_fault_of_an_attempt_healed_twice_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = run_with(tmp_path, "[{fault: kill, node: node-0, step: 5}, {fault: hang, node: node-1, step: 25}]", spec=SPEC)
    result = stages.train(run, ["node-0", "node-1", "node-2"], spares=["node-3"])
    assert result["attempts"] == 1
    kinds = [(e["kind"], e["culprits"]) for e in events(run, "failure_classified")]
    assert kinds == [("node_lost", ["node-0"]), ("hang", ["node-1"])]
    decisions = events(run, "decision")
    assert [(d["action"], d["joiners"], d["generation"]) for d in decisions] == [
        ("regroup", ["node-3"], 2),
        ("regroup", ["node-0"], 3),
    ]
    stages.report(run)
    page = html.unescape(re.sub(r"<[^>]+>", " ", (run.dir / "report.html").read_text()))
    assert cli.main(["summary", str(run.dir)]) == 0
    summary = capsys.readouterr().out
    notice = notice_from_ledger(run.ledger, RunFacts("recovery", run.run_id, failed=False), {"recovery"})
    assert notice is not None
    for name, text in (("report.html", page), ("trainyard summary", summary), ("notice", notice.text)):
        flat = " ".join(text.split())
        for kind, culprit, joiner, generation in (
            ("node_lost", "node-0", "node-3", 2),
            ("hang", "node-1", "node-0", 3),
        ):
            line = f"{kind} on {culprit} -> regroup in place, generation {generation}, joined by {joiner}"
            assert line in flat, f"{name} lacks {line!r}:\n{text}"
        assert "world path: 3 -> 3 -> 3" in flat, f"{name} lacks the world path:\n{text}"
