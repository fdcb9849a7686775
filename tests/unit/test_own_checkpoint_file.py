"""A script's own checkpoint file, as its author wrote it (issue 51, point 7 and "what must be true" 5).

nanoGPT keeps one ``ckpt.pt`` that it overwrites at every save, its step in ``iter_num``; Lightning rewrites
``last.ckpt``. Each completed overwrite is adopted as a copy the next one cannot change, its step read from
the file by the sandboxed inspector (the common keys, or the spec's ``checkpoint.step_key``); a copy the script
wrote over meanwhile is refused; before an attempt resumes, the chosen save is put back where the script looks
for it; and a script that saves every N steps passes the gate with its last save.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from test_final_checkpoint import SPEC, make_run

from trainyard import held
from trainyard.checkpoint import foreign, putback
from trainyard.checkpoint.format import list_checkpoints, read_manifest, verify
from trainyard.checkpoint.validate import inspector
from trainyard.errors import CheckpointInvalid
from trainyard.pipeline import lineage, stages
from trainyard.pipeline.lineage import resume_point
from trainyard.pipeline.run import Run, open_run
from trainyard.pipeline.train import _resume_target
from trainyard.recovery.state import Course

SHAPE = foreign.RunShape(world_size=1, global_batch=8, micro_batch=2, run_id="test")
OLD = time.time() - 3600


def nanogpt_ckpt(path: Path, iter_num: int, seed: int = 0) -> Path:
    """What nanoGPT's train.py saves: model and AdamW state, model_args, iter_num, best_val_loss, config."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randint(0, 16, (4,))).sum().backward()
    opt.step()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "model_args": {"n_layer": 2, "n_head": 2, "n_embd": 8, "block_size": 8, "bias": False, "vocab_size": 16},
            "iter_num": iter_num,
            "best_val_loss": torch.tensor(2.5),
            "config": {"out_dir": "out", "compile": False, "learning_rate": 1e-3, "dataset": "shakespeare_char"},
        },
        path,
    )
    return path


def aged(path: Path, by: float = 0.0) -> Path:
    os.utime(path, (OLD + by, OLD + by))
    return path


def test_a_nanogpt_ckpt_gives_its_iter_num_through_the_inspector(tmp_path: Path) -> None:
    ckpt = nanogpt_ckpt(tmp_path / "out" / "ckpt.pt", 120)
    assert inspector().step_of(ckpt) == 120
    aged(ckpt)
    [found] = foreign.scan(tmp_path)
    assert found.step is None  # its name says nothing: the inspector's word is asked
    [chosen] = foreign.adoptable(tmp_path, [found], {}, time.time_ns(), step_reader=inspector().step_of)
    assert chosen.step == 120
    made = foreign.adopt(tmp_path, chosen, SHAPE)
    assert made == tmp_path / "step_000120" and verify(made) == []


def test_the_spec_step_key_reaches_the_inspector_before_the_common_keys(tmp_path: Path) -> None:
    file = tmp_path / "state.pt"
    torch.save({"w": torch.ones(2), "my_counter": 77, "epoch": 3}, file)
    assert inspector().step_of(file) == 3  # epoch: the only common key it holds
    assert inspector().step_of(file, key="my_counter") == 77
    spec = tmp_path / "pipe.yaml"
    spec.write_text(SPEC.format(root=tmp_path).replace('checkpoints"}', 'checkpoints", step_key: my_counter}'))
    run = open_run(spec, "pipe", "nightly__1", "2026-01-01")
    assert run.spec.checkpoint.step_key == "my_counter"
    assert lineage.step_reader(run)(file) == 77


def test_each_completed_overwrite_becomes_its_own_copy(tmp_path: Path) -> None:
    root = tmp_path / "pipe"
    adopter = foreign.Adopter(
        root, foreign.Adoption(shape=lambda: SHAPE, step_reader=inspector().step_of), lambda c, s: None
    )
    ckpt = root / "out" / "ckpt.pt"
    for step in (50, 100):
        aged(nanogpt_ckpt(ckpt, step, seed=step), by=step)  # completed: untouched for longer than the settle time
        assert adopter.adopt() == [root / f"step_{step:06d}"]
    first = read_manifest(root / "step_000050")
    assert (first["framework"], first["source"]) == ("torch", "out/ckpt.pt")
    assert (root / "step_000100" / "ckpt.pt").stat().st_ino != ckpt.stat().st_ino  # a copy, never a link
    aged(nanogpt_ckpt(ckpt, 150, seed=150), by=150)  # the third overwrite, over the same inode
    assert verify(root / "step_000050") == [] and verify(root / "step_000100") == []
    assert inspector().step_of(root / "step_000100" / "ckpt.pt") == 100


@pytest.mark.parametrize("how", ["in place, same size", "renamed over"])
def test_a_copy_the_script_wrote_over_meanwhile_is_not_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    root = tmp_path / "pipe"
    ckpt = root / "ckpt.pt"
    root.mkdir()
    torch.save({"w": torch.ones(4 << 20), "iter_num": 50}, ckpt)  # 16 MB: a copy that takes a while
    aged(ckpt)
    [found] = foreign.adoptable(root, foreign.scan(root), {}, time.time_ns(), step_reader=inspector().step_of)
    copy = held.sha256_copy

    def rewritten_while_copied(fd: int, size: int, out: int | None, name: str) -> tuple[str, int]:
        if how == "renamed over":
            torch.save({"w": torch.zeros(4 << 20), "iter_num": 60}, root / "next.tmp")
            os.replace(root / "next.tmp", ckpt)
        else:  # the script's next save, written through the same inode: the same size, other bytes
            with open(ckpt, "r+b") as f:
                f.seek(size // 2)
                f.write(b"\x7f" * 4096)
        return copy(fd, size, out, name)

    monkeypatch.setattr(held, "sha256_copy", rewritten_while_copied)
    with pytest.raises(CheckpointInvalid, match="written again while it was copied"):
        foreign.adopt(root, found, SHAPE)
    assert list_checkpoints(root) == [] and not (root / "step_000050.tmp").exists()


def adopted_run(tmp_path: Path, where: str = "ckpt.pt") -> tuple[Run, Path, Path]:
    run = make_run(tmp_path, "nightly__1")
    resume_point(run)
    root = run.checkpoint_root
    own = aged(nanogpt_ckpt(root / where, 120))
    [found] = foreign.adoptable(root, foreign.scan(root), {}, time.time_ns(), step_reader=inspector().step_of)
    return run, own, foreign.adopt(root, found, SHAPE)


def test_a_torn_ckpt_is_replaced_by_the_chosen_save_before_the_attempt_resumes(tmp_path: Path) -> None:
    run, own, ckpt = adopted_run(tmp_path)
    good = own.read_bytes()
    with open(own, "r+b") as f:  # the killed attempt's save, cut short
        f.truncate(len(good) // 3)
    target = _resume_target(run, Course(["node-0"], 2, str(ckpt)))
    assert target == str(own) and own.read_bytes() == good
    assert inspector().step_of(own) == 120
    assert verify(ckpt) == []  # the lineage's copy is untouched
    inode = own.stat().st_ino
    assert putback.put_back(run.checkpoint_root, ckpt) == own and own.stat().st_ino == inode  # same bytes: left


def test_a_link_on_the_way_back_is_refused_not_followed(tmp_path: Path) -> None:
    run, own, ckpt = adopted_run(tmp_path, "out/ckpt.pt")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "ckpt.pt").write_bytes(b"theirs")
    os.rename(own.parent, tmp_path / "moved")
    os.symlink(elsewhere, own.parent)  # a rank swaps the script's folder for a link to another one
    with pytest.raises(CheckpointInvalid, match="cannot put out/ckpt.pt back"):
        putback.put_back(run.checkpoint_root, ckpt)
    assert (elsewhere / "ckpt.pt").read_bytes() == b"theirs"


def train_ended(run: Run, ok: bool) -> None:
    run.ledger.append("train", "stage_start")
    if ok:
        run.ledger.append("train", "stage_end", seconds=1.0, result={})
    else:
        run.ledger.append("train", "stage_failed", error="NodeLost", message="node-1 lost", seconds=1.0)


def test_a_last_save_short_of_max_steps_passes_after_a_good_run(tmp_path: Path) -> None:
    run = make_run(tmp_path, "nightly__1")
    resume_point(run)
    nanogpt_ckpt(run.checkpoint_root / "out" / "ckpt.pt", 100)  # saves every 50 of 120
    train_ended(run, ok=True)
    result = stages.check_checkpoint(run, None, 120)
    assert (result.step, result.checkpoint) == (100, str(run.checkpoint_root / "step_000100"))
    [event] = run.ledger.events("check_checkpoint", "checkpoint_checked")
    assert (event["valid"], event["step"], event["target_step"], event["steps_short"]) == (True, 100, 120, 20)


def test_a_last_save_short_of_max_steps_fails_after_a_bad_run(tmp_path: Path) -> None:
    run = make_run(tmp_path, "nightly__1")
    resume_point(run)
    nanogpt_ckpt(run.checkpoint_root / "out" / "ckpt.pt", 100)
    train_ended(run, ok=False)
    with pytest.raises(CheckpointInvalid, match="step 100 is not the run's final step 120 \\(20 short\\)"):
        stages.check_checkpoint(run, None, 120)


def test_a_lightning_run_saving_every_n_steps_passes_with_its_last_save(tmp_path: Path) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 2)

        def training_step(self, batch, _):  # type: ignore[no-untyped-def]
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):  # type: ignore[no-untyped-def]
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4)), batch_size=2)

    run = make_run(tmp_path, "nightly__1")
    resume_point(run)
    every = ModelCheckpoint(dirpath=run.checkpoint_root / "lightning", every_n_train_steps=3, save_top_k=1)
    L.Trainer(
        max_steps=5, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[every],
    ).fit(Tiny())  # fmt: skip
    train_ended(run, ok=True)
    result = stages.check_checkpoint(run, None, 5)
    assert result.step == 3
    [event] = run.ledger.events("check_checkpoint", "checkpoint_checked")
    assert (event["valid"], event["steps_short"]) == (True, 2)
