"""In-place recovery on 3 local nodes: the survivors regroup on the supervisor's store and run on.

Each test runs one attempt that loses a node and finishes without a relaunch: the decision says
``regroup``, the ranks' ``regrouped`` event names the new group, and the final checkpoint is whole.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from otlp_receiver import OtlpReceiver
from test_recovery import SPEC, events, run_with

from trainyard.checkpoint.format import read_manifest
from trainyard.pipeline import stages
from trainyard.protocol.live_metrics import INSTRUMENTS
from trainyard.recovery.figures import recovery_figures

pytestmark = pytest.mark.integration

# Without rejoin: these runs are over before a killed node could start again and grow the world back.
IN_PLACE = SPEC.replace("backoff_s: 0.2}}", "backoff_s: 0.2, in_place: true, rejoin: false}}")
# A model whose step takes ~0.4 s here, 30 of them: a node started again at step 5 (a fork of the zygote, in
# milliseconds) has time to rejoin; it did ~2 s after the kill, at step 8, on a quiet machine.
GROWING_STEPS = 30
GROWING = (
    SPEC.replace("backoff_s: 0.2}}", "backoff_s: 0.2, in_place: true}}")
    .replace(
        "{{seq-len: 32, d-model: 32, n-heads: 2, lr: 0.01}}", "{{seq-len: 128, d-model: 256, n-layers: 4, n-heads: 4}}"
    )
    .replace("max_steps: 20", f"max_steps: {GROWING_STEPS}")
    .replace("checkpoint_every: 5", "checkpoint_every: 10")
)


def finish_in_place(tmp_path: Path, drills: str) -> tuple[object, dict]:
    run = run_with(tmp_path, drills, spec=IN_PLACE)
    result = stages.train(run, ["node-0", "node-1", "node-2"])
    assert result.attempts == 1 and result.last_step == 20  # no relaunch
    assert stages.check_checkpoint(run, result.checkpoint, 20).step == 20
    return run, read_manifest(Path(result.checkpoint))


@pytest.mark.parametrize(
    "fault,node,kind",
    [
        ("kill", "node-0", "node_lost"),
        pytest.param("hang", "node-2", "hang", marks=pytest.mark.alone),  # judged by the clock: see pyproject
    ],
)
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
    assert decision["new_nodes"] == survivors and decision["left_out"] == [node] and decision["generation"] == 2
    [regrouped] = events(run, "regrouped")
    assert regrouped["generation"] == 2 and regrouped["world_size"] == 2 and regrouped["node"] == survivors[0]
    assert [e["attempt"] for e in events(run, "attempt_start")] == [1]
    assert manifest["world_size"] == 2 and manifest["global_batch"] == 12  # kept by accumulation
    [failure] = recovery_figures(run.ledger)["failures"]
    assert failure["path"] == "in_place" and failure["lost_steps"] <= 1


def test_a_node_started_again_grows_the_world_back_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """node-1 is killed at step 5; the survivors regroup (3 -> 2), node-1 starts again outside the group,
    waits ready, and joins at a step boundary with the state by broadcast: 3 nodes again, one attempt.
    Rank 0 pushes its live metrics each second (``progress_every_s``) all along, to an OTLP receiver."""
    spec = GROWING.replace("heartbeat_timeout_s: 6", "heartbeat_timeout_s: 6\n  progress_every_s: 1")
    run = run_with(tmp_path, "[{fault: kill, node: node-1, step: 5}]", spec=spec)
    with OtlpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url.removesuffix("/v1/metrics"))
        result = stages.train(run, ["node-0", "node-1", "node-2"])
    assert result.attempts == 1 and result.last_step == GROWING_STEPS
    [rejoining] = events(run, "rejoining")
    assert rejoining["nodes"] == ["node-1"]
    [grown] = events(run, "grown")
    assert grown["nodes"] == ["node-0", "node-2", "node-1"] and grown["joiners"] == ["node-1"]
    assert grown["generation"] == 3 and grown["micro_batch"] == 2  # the first attempt's, global batch 12
    assert [e["world_size"] for e in events(run, "regrouped")] == [2, 3]
    assert read_manifest(Path(result.checkpoint))["world_size"] == 3
    figures = recovery_figures(run.ledger)
    assert figures["world_path"] == "3 -> 2 -> 3" and figures["spares_joined"] == "node-1"
    assert figures["lost_steps"] <= 1 and figures["spares_idle"] is None
    assert not events(run, "store_refused")  # every value the honest ranks wrote opened with their keys
    # Only rank 0 (node-0 throughout) exports, at most once a second; the last export is the finished world.
    exports = receiver.exports
    assert len(exports) >= 3 and not receiver.refused
    assert {labels["node"] for e in exports for points in e.points.values() for _, labels in points} == {"node-0"}
    periodic = [b.at - a.at for a, b in itertools.pairwise(exports[:-1])]
    assert all(gap >= 0.9 for gap in periodic), periodic
    last = {key: exports[-1].value(name) for key, (name, _, _) in INSTRUMENTS.items()}
    assert last["step"] == GROWING_STEPS and last["world_size"] == 3 and last["regroups"] == 2
    assert last["attempt"] == 1 and last["checkpoint_age_seconds"] is not None
    steps = [e.value(INSTRUMENTS["step"][0]) or 0 for e in exports]
    assert steps == sorted(steps)


def test_a_warm_spare_started_with_the_attempt_replaces_the_lost_node(tmp_path: Path) -> None:
    """node-3 starts with the attempt and waits; node-1 dies: node-3 joins with the state, 3 nodes kept.
    node-1, started again, finds the world full: it waits, idle, and the figures say so."""
    spec = GROWING.replace("nodes: {{count: 3, min: 2}}", "nodes: {{count: 3, min: 2, spare: 1}}")
    run = run_with(tmp_path, "[{fault: kill, node: node-1, step: 5}]", spec=spec)
    result = stages.train(run, ["node-0", "node-1", "node-2"], spares=["node-3"])
    assert result.attempts == 1 and result.last_step == GROWING_STEPS
    [warm] = events(run, "spares_warm")
    assert warm["nodes"] == ["node-3"]
    [decision] = events(run, "decision")
    assert decision["action"] == "regroup" and decision["joiners"] == ["node-3"]
    assert decision["new_nodes"] == ["node-0", "node-2", "node-3"]
    assert [e["world_size"] for e in events(run, "regrouped")] == [3]
    assert not events(run, "grown")
    figures = recovery_figures(run.ledger)
    assert figures["spares_joined"] == "node-3" and figures["spares_idle"] == "node-1"
    assert not events(run, "store_refused")
    assert figures["lost_steps"] <= 1
