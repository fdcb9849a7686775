"""The framework adapters' in-memory snapshots (``runtime.hf``, ``runtime.lightning``): a Hugging Face and a
Lightning ``Trainer`` in this process (one rank, no group) keep each due step in the framework's own checkpoint
layout, and the framework resumes from one as from its own save: the run it resumes ends where the uninterrupted
run ended, weight for weight. The relaunch under ``airflow dags test`` is tests/integration/test_byo_frameworks.py's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from trainyard.protocol.env import TrainEnv
from trainyard.runtime import snapshots

STEPS = 4


def ctx(tmp_path: Path, resume_from: str = "none", checkpoint_every: int = 100) -> TrainEnv:
    return TrainEnv(
        data_dir=tmp_path / "data", checkpoint_dir=tmp_path / "ckpt", max_steps=STEPS, run_id="run-1",
        node="node-0", snapshot_dir=tmp_path / "shm", snapshot_every=1, resume_from=resume_from, global_batch=4,
        micro_batch=2, checkpoint_every=checkpoint_every,
    )  # fmt: skip


def tier(c: TrainEnv) -> Path:
    found = snapshots.node_tier(c)
    assert found is not None
    return found


# --- Hugging Face ----------------------------------------------------------------------------------------


def hf_train(c: TrainEnv, resume: str | None) -> tuple[dict[str, torch.Tensor], Any]:
    transformers = pytest.importorskip("transformers")
    from trainyard.runtime import hf

    class Windows(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __init__(self) -> None:
            self.tokens = torch.randint(0, 64, (64 * 16,), generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            window = self.tokens[i * 16 : (i + 1) * 16]
            return {"input_ids": window, "labels": window}

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16)
    callback = hf.TrainyardCallback(c)
    trainer = transformers.Trainer(
        model=transformers.GPT2LMHeadModel(config),
        args=hf.training_args(c, learning_rate=1e-2, use_cpu=True, save_strategy="no", dataloader_num_workers=0),
        train_dataset=Windows(),
        callbacks=[callback],
    )
    trainer.train(resume_from_checkpoint=resume)
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, callback


def test_a_hugging_face_trainer_resumes_from_its_snapshot_as_from_its_own_save(tmp_path: Path) -> None:
    from trainyard.runtime import hf

    c = ctx(tmp_path)
    straight, callback = hf_train(c, None)
    assert callback.snapshots.failed is None
    # The step before the last (a snapshot is never due at the last step: the checkpoint of it is the run's end).
    assert snapshots.whole_steps(tier(c), "run-1") == [STEPS - 1, STEPS - 2]
    folder = snapshots.folder(tier(c), STEPS - 1)
    assert {p.name for p in folder.iterdir()} == {snapshots.TENSORS_FILE, snapshots.LAYOUT_FILE, snapshots.WHOLE}
    assert json.loads((folder / snapshots.WHOLE).read_text())["kind"] == "hf"

    # A relaunch: the snapshot is newer than any checkpoint, so it is what the Trainer resumes from, written out
    # once as the checkpoint-N folder the Trainer reads.
    again = ctx(tmp_path, resume_from="latest")
    chosen = hf.resume_checkpoint(again)
    assert chosen is not None and Path(chosen).parent == folder
    names = {p.name for p in Path(chosen).iterdir()}
    assert names == {"pytorch_model.bin", "optimizer.pt", "scheduler.pt", "trainer_state.json", "rng_state.pth"}
    assert json.loads((Path(chosen) / "trainer_state.json").read_text())["global_step"] == STEPS - 1
    resumed, _ = hf_train(again, str(chosen))
    for name, value in straight.items():  # the RNG (dropout), the data position, the optimizer: all as they were
        torch.testing.assert_close(resumed[name], value, msg=name)


# --- Lightning -------------------------------------------------------------------------------------------


def lightning_train(c: TrainEnv, resume: str | None) -> tuple[dict[str, torch.Tensor], Any]:
    pl = pytest.importorskip("lightning.pytorch")
    from trainyard.runtime import lightning as ty

    class Tiny(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]

    pl.seed_everything(0, verbose=False)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    trainer = pl.Trainer(accelerator="cpu", enable_checkpointing=True, **ty.trainer_kwargs(c))
    module = Tiny()
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=ty.micro_batch(c)), ckpt_path=resume)
    [callback] = [cb for cb in trainer.callbacks if isinstance(cb, ty.TrainyardCallback)]
    return {k: v.detach().clone() for k, v in module.state_dict().items()}, callback


def test_a_lightning_trainer_resumes_from_its_snapshot_as_from_its_own_checkpoint(tmp_path: Path) -> None:
    """Lightning's own checkpoint of the same step is the reference: mid-epoch, a DataLoader without state starts
    its epoch again (Lightning warns so), from either."""
    ty = pytest.importorskip("trainyard.runtime.lightning")
    c = ctx(tmp_path, checkpoint_every=STEPS - 1)
    _, callback = lightning_train(c, None)
    assert callback.snapshots.failed is None
    assert snapshots.whole_steps(tier(c), "run-1") == [STEPS - 1, STEPS - 2]
    folder = snapshots.folder(tier(c), STEPS - 1)
    assert {p.name for p in folder.iterdir()} == {snapshots.TENSORS_FILE, snapshots.LAYOUT_FILE, snapshots.WHOLE}

    again = ctx(tmp_path, resume_from="latest", checkpoint_every=STEPS - 1)
    chosen = ty.resume_checkpoint(again)
    assert chosen is not None and Path(chosen).parent.parent == folder and Path(chosen).name == "snapshot.ckpt"
    saved = torch.load(chosen, weights_only=False)
    [own_file] = c.checkpoint_dir.rglob(f"step={STEPS - 1}.ckpt")
    own = torch.load(own_file, weights_only=False)
    assert saved["global_step"] == own["global_step"] == STEPS - 1
    assert saved["loops"] == own["loops"] and saved["lr_schedulers"] == own["lr_schedulers"]
    for name, value in own["state_dict"].items():
        torch.testing.assert_close(saved["state_dict"][name], value, msg=name)

    from_snapshot, _ = lightning_train(again, str(chosen))
    from_own, _ = lightning_train(again, str(own_file))
    for name, value in from_own.items():
        torch.testing.assert_close(from_snapshot[name], value, msg=name)


def test_without_a_newer_snapshot_the_relaunch_resumes_as_before(tmp_path: Path) -> None:
    """No snapshot (a fresh tier): nothing to resume; snapshots off: no fetch, no group."""
    from trainyard.runtime import hf
    from trainyard.runtime import lightning as ty

    c = ctx(tmp_path, resume_from="latest")
    assert hf.resume_checkpoint(c) is None
    off = TrainEnv(**{**c.__dict__, "snapshot_dir": None})
    assert ty.resume_checkpoint(off) is None
