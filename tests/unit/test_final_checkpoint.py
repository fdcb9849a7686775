"""The checkpoint a run ends with is the orchestrator's, and a restarted lineage is the one that resumes.

Issue 29, hole 4: a pod wrote ``LATEST`` naming another pipeline's checkpoint (an absolute path, or
``../``), the train stage took its final checkpoint from that pointer, the gate passed it and publish
copied the other team's checkpoint into this pipeline's cold tier. The final checkpoint now comes from
the run's own ledger (the watcher's promotions, through the fold), inside the pipeline's own root.

Issue 29, hole 7: after a run with ``resume_from: none``, the next ``latest`` run resumed from an older,
higher step of the lineage that had ended, not from the new one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_checkpoint_validation import save

from trainyard.checkpoint import lease, registry
from trainyard.checkpoint.format import latest_valid, read_manifest, verify
from trainyard.checkpoint.validate import validate
from trainyard.errors import CheckpointInvalid
from trainyard.pipeline import stages
from trainyard.pipeline.lineage import resume_point
from trainyard.pipeline.run import Run, open_run
from trainyard.pipeline.train import _trained
from trainyard.recovery.commands import AttemptResult
from trainyard.storage import local_path

SPEC = """\
dataset: {{source: "file://{root}/cold/tokens", name: tokens}}
nodes: {{count: 1}}
training: {{max_steps: 20, global_batch: 8, micro_batch: 2, checkpoint_every: 10}}
checkpoint: {{hot: "file://{root}/hot", cold: "file://{root}/cold/checkpoints"}}
runs_root: "file://{root}/runs"
params: [resume_from]
"""
OWN_LOSS, THEIR_LOSS = 2.0, 1.5


def make_run(tmp_path: Path, run_id: str, resume_from: str | None = None) -> Run:
    spec = tmp_path / "pipe.yaml"
    spec.write_text(SPEC.format(root=tmp_path))
    return open_run(spec, "pipe", run_id, "2026-01-01", {"resume_from": resume_from} if resume_from else None)


def judge(path: Path, after: int | None):
    return validate(path, after_step=after)


def train_to(run: Run, steps: list[int], loss: float = OWN_LOSS) -> None:
    """What the train stage does around the ranks: the resume point, then the watcher judging and
    promoting each checkpoint the ranks save (into the run's ledger), and the ranks' step events."""
    resume_point(run)
    root = run.checkpoint_root
    with registry.Watcher(root, judge, run.ledger, keep=5, poll_s=3600) as watcher:
        for step in steps:
            save(root, step, loss=loss)
            watcher.sweep()
    for step in range(1, steps[-1] + 1):
        run.ledger.append("train", "step", step=step, loss=loss)


@pytest.fixture
def theirs(tmp_path: Path) -> Path:
    """Another pipeline's checkpoint beside this one's, at this run's final step, with a better loss."""
    return save(tmp_path / "hot" / "other", 20, loss=THEIR_LOSS)


@pytest.mark.parametrize("how", ["absolute", "dot-dot"])
def test_a_pointer_a_pod_wrote_never_chooses_what_the_gate_checks_and_publishes(
    tmp_path: Path, theirs: Path, how: str
) -> None:
    run = make_run(tmp_path, "nightly__1")
    train_to(run, [10, 20])
    root = run.checkpoint_root
    planted = str(theirs) if how == "absolute" else f"../{theirs.parent.name}/{theirs.name}"
    assert (root / planted).resolve() == theirs.resolve()
    (root / registry.LATEST).write_text(json.dumps({"path": planted, "step": 20}))  # a pod's write

    trained = _trained(run, ["node-0"], 0, 20, AttemptResult(attempt=1, seconds=1.0, last_step=20))
    assert trained.checkpoint == str(root / "step_000020")
    checked = stages.check_checkpoint(run, trained.checkpoint, 20)
    assert checked.checkpoint == str(root / "step_000020") and checked.metrics["loss"] == OWN_LOSS
    published = stages.publish(run, checked.checkpoint)
    copy = Path(local_path(published.uri))
    assert verify(copy) == [] and read_manifest(copy)["metrics"]["loss"] == OWN_LOSS, "published their checkpoint"
    # The pointer is evidence, not a choice: a warning and a ledger event name it.
    [refused] = run.ledger.events("train", "pointer_refused")
    assert refused["used"] == str(root / "step_000020") and planted[:40] in refused["problem"]


def test_a_checkpoint_folder_swapped_for_a_link_is_not_the_pipelines_own(tmp_path: Path, theirs: Path) -> None:
    run = make_run(tmp_path, "nightly__1")
    train_to(run, [10, 20])
    final = run.checkpoint_root / "step_000020"
    os.replace(final, tmp_path / "moved-away")
    final.symlink_to(theirs, target_is_directory=True)  # LATEST still names step_000020, now a link to theirs
    assert _trained(run, ["node-0"], 0, 20, AttemptResult(attempt=1, seconds=1.0, last_step=20)).checkpoint is None
    with pytest.raises(CheckpointInvalid, match="not a checkpoint folder of this pipeline"):
        stages.check_checkpoint(run, str(final), 20)
    [refused] = run.ledger.events("train", "pointer_refused")
    assert "a link" in refused["problem"] and refused["used"] is None


def test_the_gate_refuses_a_checkpoint_outside_the_pipelines_root(tmp_path: Path, theirs: Path) -> None:
    run = make_run(tmp_path, "nightly__1")
    train_to(run, [10, 20])
    for outside in (str(theirs), str(run.checkpoint_root / ".." / "other" / "step_000020")):
        with pytest.raises(CheckpointInvalid, match="not a checkpoint folder of this pipeline"):
            stages.check_checkpoint(run, outside, 20)
    assert list(run.ledger.events("check_checkpoint", "checkpoint_checked")) == []  # nothing of theirs checked


def test_after_a_fresh_start_the_next_latest_run_resumes_the_new_lineage(tmp_path: Path) -> None:
    first = make_run(tmp_path, "nightly__1")
    root = first.checkpoint_root
    train_to(first, [10, 20, 30, 40])
    lease.release(root, first.run_id)  # its report gives the lineage back

    fresh = make_run(tmp_path, "manual__2", resume_from="none")
    train_to(fresh, [10, 20], loss=3.0)
    # A failed attempt of this run resumes "latest" in the ranks (the runtime's latest_valid): this lineage.
    assert latest_valid(root) == root / "step_000020"
    assert registry.latest(root) == root / "step_000020"  # judged and promoted: new, not seen before
    lease.release(root, fresh.run_id)

    after = make_run(tmp_path, "nightly__3")
    assert resume_point(after) == (str(root / "step_000020"), 20)
    assert read_manifest(root / "step_000020")["metrics"]["loss"] == 3.0
    # Nothing was deleted: the lineage that ended waits in superseded/, whole, and the ledger says so.
    moved = sorted((root / "superseded").iterdir())
    assert [p.name.split("-")[0] for p in moved] == ["step_000010", "step_000020", "step_000030", "step_000040"]
    assert all(verify(p) == [] for p in moved)
    [reset] = fresh.ledger.events("train", "lineage_reset")
    assert reset["path"] is None and sorted(reset["set_aside"]) == [str(p) for p in moved]


def test_resuming_an_earlier_checkpoint_sets_the_later_ones_aside(tmp_path: Path) -> None:
    first = make_run(tmp_path, "nightly__1")
    root = first.checkpoint_root
    train_to(first, [10, 20, 30])
    lease.release(root, first.run_id)
    back = make_run(tmp_path, "manual__2", resume_from=str(root / "step_000010"))
    assert resume_point(back) == (str(root / "step_000010"), 10)
    assert [p.name for p in sorted(root.glob("step_*"))] == ["step_000010"]
    assert sorted(p.name.split("-")[0] for p in (root / "superseded").iterdir()) == ["step_000020", "step_000030"]
