"""A Hugging Face ``Trainer`` script under trainyard: a tiny GPT-2 from a config (random weights, nothing
downloaded) trained as causal LM on the staged token shards, with trainyard's callback and settings.

What trainyard adds is three lines: ``hf.training_args`` (batch split, steps, saves, seed, output folder from
the run), ``hf.TrainyardCallback()`` (heartbeats, progress, drills, failure records) and
``hf.resume_checkpoint()`` (the adopted ``checkpoint-N`` to resume from). Point a spec at it with
``training.entrypoint: /abs/path/examples/byo_hf.py``.
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer

from trainyard import runtime
from trainyard.protocol.shards import list_shards, open_tokens
from trainyard.runtime import hf


class Windows(torch.utils.data.Dataset):
    """Fixed windows of a token stream, as causal-LM examples (labels = inputs; the model shifts them)."""

    def __init__(self, tokens: torch.Tensor, length: int):
        self.tokens, self.length = tokens, length

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.length

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.tokens[i * self.length : (i + 1) * self.length]
        return {"input_ids": window, "labels": window}


def tokens(ctx: runtime.RunContext) -> torch.Tensor:
    """The staged shards' tokens, or a fixed random stream when there are none (a smoke run by hand)."""
    shards = list_shards(ctx.data_dir) if ctx.data_dir.is_dir() else []
    if not shards:
        return torch.randint(0, 256, (1 << 16,), generator=torch.Generator().manual_seed(0))
    return torch.cat([torch.from_numpy(open_tokens(p).astype("int64")) for p in shards])


def main() -> None:
    ctx = runtime.context()
    torch.manual_seed(ctx.seed)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=256, n_positions=64)
    trainer = Trainer(
        model=GPT2LMHeadModel(config),
        args=hf.training_args(ctx, learning_rate=3e-3, use_cpu=not torch.cuda.is_available()),
        train_dataset=Windows(tokens(ctx), 32),
        callbacks=[hf.TrainyardCallback(ctx)],
    )
    trainer.train(resume_from_checkpoint=hf.resume_checkpoint(ctx))


if __name__ == "__main__":
    main()
