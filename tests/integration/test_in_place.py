"""In-place recovery on 3 local nodes: the survivors regroup on the supervisor's store and run on.

Each test runs one attempt that loses a node and finishes without a relaunch: the decision says
``regroup``, the ranks' ``regrouped`` event names the new group, and the final checkpoint is whole.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_recovery import SPEC, events, run_with

from trainyard import stages
from trainyard.checkpoint.format import read_manifest
from trainyard.recovery.figures import recovery_figures

pytestmark = [pytest.mark.integration, pytest.mark.alone]  # a hang is judged by the clock: see pyproject

IN_PLACE = SPEC.replace("backoff_s: 0.2}}", "backoff_s: 0.2, in_place: true}}")


def finish_in_place(tmp_path: Path, drills: str) -> tuple[object, dict]:
    run = run_with(tmp_path, drills, spec=IN_PLACE)
    result = stages.train(run, ["node-0", "node-1", "node-2"])
    assert result["attempts"] == 1 and result["last_step"] == 20  # no relaunch
    assert stages.check_checkpoint(run, result["checkpoint"], 20)["step"] == 20
    return run, read_manifest(Path(result["checkpoint"]))


@pytest.mark.parametrize("fault,node,kind", [("kill", "node-0", "node_lost"), ("hang", "node-2", "hang")])
def test_a_lost_node_is_healed_in_place(tmp_path: Path, fault: str, node: str, kind: str) -> None:
    """Node 0 is no special case (the store is the supervisor's); a hung node is killed, then left out."""
    run, manifest = finish_in_place(tmp_path, f"[{{fault: {fault}, node: {node}, step: 12}}]")
    [path] = events(run, "recovery_path")
    assert path["in_place"] is True
    [classified] = events(run, "failure_classified")
    assert classified["kind"] == kind and classified["culprits"] == [node]
    [decision] = events(run, "decision")
    survivors = [n for n in ("node-0", "node-1", "node-2") if n != node]
    assert decision["action"] == "regroup" and decision["path"] == "in_place"
    assert decision["new_nodes"] == survivors and decision["generation"] == 2
    [regrouped] = events(run, "regrouped")
    assert regrouped["generation"] == 2 and regrouped["world_size"] == 2 and regrouped["node"] == survivors[0]
    assert [e["attempt"] for e in events(run, "attempt_start")] == [1]
    assert manifest["world_size"] == 2 and manifest["global_batch"] == 12  # kept by accumulation
    [failure] = recovery_figures(run.ledger)["failures"]
    assert failure["path"] == "in_place" and failure["lost_steps"] <= 1
