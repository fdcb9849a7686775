"""Publish takes only what this run's gate passed, as the run's own ledger records it (issue 49, hole 10).

``Publish`` checked only the type of the gate's result (an XCom, anyone's to write): a result naming
another pipeline's checkpoint, or one of this pipeline's the gate never saw (NaN weights), was
published and ``PUBLISHED`` moved. Now the gate records the manifest's digest beside its verdict, and
publish takes the checkpoint and digest from that event, inside the pipeline's own root.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_checkpoint_validation import save
from test_final_checkpoint import OWN_LOSS, make_run, train_to

from trainyard.checkpoint import cold
from trainyard.errors import CheckpointInvalid
from trainyard.pipeline import stages
from trainyard.pipeline.run import Run
from trainyard.storage import LocalTier, local_path


def nothing_published(run: Run) -> bool:
    tier = Path(local_path(run.cold_checkpoint_uri))
    return not tier.exists() or cold.published(LocalTier(tier)) is None


def test_a_checkpoint_the_gate_never_checked_is_not_published(tmp_path: Path) -> None:
    run = make_run(tmp_path, "nightly__1")
    train_to(run, [10, 20])
    never_gated = str(run.checkpoint_root / "step_000020")
    with pytest.raises(CheckpointInvalid, match="this run's gate \\(check_checkpoint\\) passed no checkpoint"):
        stages.publish(run, never_gated)
    assert nothing_published(run)


def test_another_pipelines_checkpoint_in_the_gates_result_is_not_published(tmp_path: Path) -> None:
    run = make_run(tmp_path, "nightly__1")
    train_to(run, [10, 20])
    theirs = save(tmp_path / "hot" / "other", 20, loss=1.5)
    checked = stages.check_checkpoint(run, str(run.checkpoint_root / "step_000020"), 20)
    with pytest.raises(CheckpointInvalid, match="is not the checkpoint this run's gate passed"):
        stages.publish(run, str(theirs))  # a forged GateResult XCom
    assert nothing_published(run)
    published = stages.publish(run, checked.checkpoint)  # the gate's own result still goes
    assert json.loads((Path(local_path(published.uri)) / "manifest.json").read_text())["metrics"]["loss"] == OWN_LOSS


def test_a_checkpoint_the_gate_failed_is_not_published(tmp_path: Path) -> None:
    run = make_run(tmp_path, "nightly__1")
    train_to(run, [10, 20])
    final = str(run.checkpoint_root / "step_000020")
    with pytest.raises(CheckpointInvalid):
        stages.check_checkpoint(run, final, 30)  # not the run's final step: the gate fails it
    with pytest.raises(CheckpointInvalid, match="passed no checkpoint"):
        stages.publish(run, final)
    assert nothing_published(run)


def test_a_manifest_changed_after_the_gate_is_not_published(tmp_path: Path) -> None:
    run = make_run(tmp_path, "nightly__1")
    train_to(run, [10, 20])
    checked = stages.check_checkpoint(run, str(run.checkpoint_root / "step_000020"), 20)
    [event] = run.ledger.events("check_checkpoint", "checkpoint_checked")
    assert event["valid"] is True and len(event["manifest_sha256"]) == 64
    manifest = Path(checked.checkpoint) / "manifest.json"
    data = json.loads(manifest.read_text())
    data["metrics"]["loss"] = 0.001  # a lingering rank rewrites what the copy will claim
    manifest.write_text(json.dumps(data))
    with pytest.raises(CheckpointInvalid, match="manifest.json changed since the gate passed it"):
        stages.publish(run, checked.checkpoint)
    assert nothing_published(run)
