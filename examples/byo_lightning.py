"""A Lightning script under trainyard: a tiny next-token model trained on the staged token shards, with
trainyard's callback and settings.

What trainyard adds: ``**ty.trainer_kwargs()`` (the callback, a ``ModelCheckpoint`` every
``TRAINYARD_CHECKPOINT_EVERY`` steps, steps, accumulation, the torchrun world's devices and nodes),
``ty.micro_batch()`` for the DataLoader and ``ty.resume_checkpoint()`` (the adopted ``.ckpt`` to resume from).
Point a spec at it with ``training.entrypoint: /abs/path/examples/byo_lightning.py``.
"""

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from trainyard import runtime
from trainyard.protocol.shards import list_shards, open_tokens
from trainyard.runtime import lightning as ty

WINDOW = 32
VOCAB = 256


class NextToken(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.head = torch.nn.Linear(32, VOCAB)

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        (window,) = batch
        logits = self.head(self.embed(window[:, :-1]))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), window[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def windows(ctx: runtime.RunContext) -> TensorDataset:
    """The staged shards' tokens in fixed windows, or a fixed random stream when there are none (by hand)."""
    shards = list_shards(ctx.data_dir) if ctx.data_dir.is_dir() else []
    if shards:
        tokens = torch.cat([torch.from_numpy(open_tokens(p).astype("int64")) for p in shards])
    else:
        tokens = torch.randint(0, VOCAB, (1 << 16,), generator=torch.Generator().manual_seed(0))
    usable = len(tokens) // WINDOW * WINDOW
    return TensorDataset(tokens[:usable].view(-1, WINDOW) % VOCAB)


def main() -> None:
    ctx = runtime.context()
    pl.seed_everything(ctx.seed, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", **ty.trainer_kwargs(ctx))
    data = DataLoader(windows(ctx), batch_size=ty.micro_batch(ctx), shuffle=True)
    trainer.fit(NextToken(), data, ckpt_path=ty.resume_checkpoint(ctx))


if __name__ == "__main__":
    main()
