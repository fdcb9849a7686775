"""In-memory snapshots (``trainyard.runtime.snapshots``): only a whole one of this run is ever resumed from.

One process, no group: what the tier holds and what a resume takes from it. The peer copy between ranks is
tests/integration/test_recovery.py's (a replacement node resumes from a survivor's snapshot).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from trainyard.protocol.env import TrainEnv
from trainyard.runtime import snapshots
from trainyard.runtime.state import TrainState


def ctx(tmp_path: Path, every: int = 1, run_id: str = "run-1") -> TrainEnv:
    return TrainEnv(
        data_dir=tmp_path / "data", checkpoint_dir=tmp_path / "ckpt", max_steps=100, run_id=run_id, node="node-0",
        snapshot_dir=tmp_path / "shm", snapshot_every=every,
    )  # fmt: skip


def state(seed: int) -> dict[str, TrainState]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return {"train": TrainState(model, optimizer)}


def take(c: TrainEnv, step: int, seed: int) -> dict[str, TrainState]:
    taken = state(seed)
    shot = snapshots.Snapshotter(c)
    shot.take(step, taken)
    assert shot.failed is None
    return taken


def weights(s: dict[str, TrainState]) -> torch.Tensor:
    return s["train"].model.weight.detach().clone()


def test_a_resume_takes_the_newest_whole_snapshot_newer_than_the_checkpoint(tmp_path: Path) -> None:
    c = ctx(tmp_path)
    take(c, 7, seed=1)
    newest = take(c, 8, seed=2)
    into = state(seed=3)
    step, why = snapshots.restore(c, into, checkpoint_step=5)
    assert step == 8 and "step 8" in why and "checkpoint of step 5" in why
    assert torch.equal(weights(into), weights(newest))
    moments = into["train"].optimizer.state_dict()["state"]
    assert moments and all("exp_avg" in m for m in moments.values())  # the optimizer's moments came back too


def test_a_checkpoint_as_new_as_the_snapshot_stands(tmp_path: Path) -> None:
    c = ctx(tmp_path)
    take(c, 8, seed=2)
    into = state(seed=3)
    before = weights(into)
    assert snapshots.restore(c, into, checkpoint_step=8) == (None, "no whole in-memory snapshot is newer")
    assert torch.equal(weights(into), before)


@pytest.mark.parametrize("tear", ["missing", "truncated", "no_whole_record", "a_link"])
def test_a_torn_snapshot_is_never_resumed_from(tmp_path: Path, tear: str) -> None:
    c = ctx(tmp_path)
    older = take(c, 7, seed=1)
    take(c, 8, seed=2)
    torn = snapshots.folder(tmp_path / "shm" / "node-0", 8)
    part = torn / snapshots.TENSORS_FILE
    if tear == "missing":
        part.unlink()
    elif tear == "truncated":
        os.truncate(part, part.stat().st_size - 1)
    elif tear == "no_whole_record":
        (torn / snapshots.WHOLE).unlink()
    else:  # the part swapped for a link to a file of the same size elsewhere
        elsewhere = tmp_path / "elsewhere.pt"
        part.rename(elsewhere)
        part.symlink_to(elsewhere)
    assert snapshots.whole_steps(tmp_path / "shm" / "node-0") == [7]
    into = state(seed=3)
    step, _ = snapshots.restore(c, into, checkpoint_step=5)
    assert step == 7 and torch.equal(weights(into), weights(older))


def test_a_snapshot_of_another_run_is_never_resumed_from(tmp_path: Path) -> None:
    take(ctx(tmp_path, run_id="run-1"), 8, seed=2)
    assert snapshots.restore(ctx(tmp_path, run_id="run-2"), state(3), checkpoint_step=0)[0] is None


def test_the_tier_keeps_the_two_newest_and_skips_the_last_step(tmp_path: Path) -> None:
    c = ctx(tmp_path)
    for step in range(1, 6):
        take(c, step, seed=step)
    tier = tmp_path / "shm" / "node-0"
    assert snapshots.whole_steps(tier) == [5, 4]
    assert sorted(p.name for p in tier.iterdir()) == ["step_000004", "step_000005"]
    record = json.loads((tier / "step_000005" / snapshots.WHOLE).read_text())
    assert (
        record["step"] == 5
        and record["run_id"] == "run-1"
        and set(record["files"]) == {snapshots.TENSORS_FILE, snapshots.LAYOUT_FILE}
    )
    assert not snapshots.due(c, c.max_steps)  # the last step is the checkpoint's


def test_every_n_steps_and_off(tmp_path: Path) -> None:
    assert [s for s in range(1, 10) if snapshots.due(ctx(tmp_path, every=3), s)] == [3, 6, 9]
    off = ctx(tmp_path, every=0)
    assert snapshots.node_tier(off) is None and not snapshots.due(off, 3)
    assert snapshots.restore(off, state(1), 0) == (None, "in-memory snapshots are off")


def test_a_full_tier_turns_snapshots_off_and_training_goes_on(tmp_path: Path) -> None:
    (tmp_path / "shm").write_text("not a folder")  # the tier cannot be made: as a full /dev/shm would fail
    c = ctx(tmp_path)
    shot = snapshots.Snapshotter(c)
    shot.take(3, state(1))
    assert shot.failed is not None
    assert shot.take(4, state(1)) == 0.0  # off for the rest of the process


def test_one_writer_recycling_its_maps_keeps_each_step_whole_and_its_own(tmp_path: Path) -> None:
    """The writer keeps its tier's files mapped from one step to the next (``snapshots.Maps``): each recycled file
    holds the new step's bytes, the one before stays intact beside it, and no more than ``KEEP + 1`` maps stay open."""
    c = ctx(tmp_path)
    shot = snapshots.Snapshotter(c)
    taken = {}
    for step in range(1, 8):
        taken[step] = state(seed=step)
        shot.take(step, taken[step])
        assert shot.failed is None and len(shot.maps.open) <= snapshots.KEEP + 1
        tier = tmp_path / "shm" / "node-0"
        for held in snapshots.whole_steps(tier):
            read = snapshots.read_tree(snapshots.folder(tier, held))
            assert read["step"] == held
            assert torch.equal(read["state"]["train"]["model"]["weight"], weights(taken[held]))
    shot.maps.close()
    assert not shot.maps.open


def test_a_snapshot_of_another_kind_is_never_loaded(tmp_path: Path) -> None:
    """A run whose script changed its framework between attempts: the runtime never loads an adapter's snapshot
    (nor an adapter the runtime's), and says why."""
    c = ctx(tmp_path)
    shot = snapshots.Snapshotter(c, kind="hf")
    shot.keep(8, lambda: {"weights": torch.ones(2)})
    assert shot.failed is None
    assert snapshots.restore(c, state(1), checkpoint_step=5) == (
        None,
        "the snapshot of step 8 is 'hf''s, not 'runtime''s",
    )
