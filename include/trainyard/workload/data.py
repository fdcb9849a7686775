"""Deterministic, world-size-independent batches over a directory of token shards or token arrays.

This module owns *which tokens a step trains on*. Step ``s`` draws
``global_batch`` random windows of ``seq_len + 1`` tokens from
``np.random.default_rng([seed, s])`` over the concatenation of all shards; rank
``r`` of ``W`` takes its contiguous slice of that global batch and splits it
into micro-batches (gradient accumulation = global / (micro * W)).

Because the global batch of a step depends only on (seed, step, data), a run
saved on 3 ranks resumes on 2 with exactly the same samples per step, and a
resumed run sees the same data as one that was never interrupted: no sampler
state needs to be checkpointed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from trainyard.errors import DataError
from trainyard.protocol import arrays, shards
from trainyard.runtime.batch import BatchPlan

__all__ = ["BatchPlan", "TokenStream", "global_starts", "micro_batches"]


class TokenStream:
    """All shards (or token arrays) of a dataset directory, read as one long token array (memory-mapped)."""

    def __init__(self, parts: list[np.ndarray], vocab_size: int | None):
        self.parts = parts
        self.vocab_size = vocab_size
        """What the shards' headers declare; None for token arrays, which declare none."""
        self.id_limit: int | None = None
        """Where no header declares a vocabulary: the model's, which every batch's ids must stay below."""
        # starts[i] is the global index of parts[i][0]; the last entry is the total length.
        self.starts = np.cumsum([0] + [len(p) for p in parts])

    @classmethod
    def open(cls, directory: str | Path, dtype: str = "uint16") -> TokenStream:
        """Map every ``*.tok`` in ``directory`` (sorted), else every ``.bin``/``.npy`` token array.

        ``dtype`` is a raw ``.bin``'s (it has no header). ``DataError`` if there are none or they disagree.
        """
        paths = shards.list_shards(directory)
        if not paths:
            return cls._arrays(directory, dtype)
        headers = [shards.read_header(p) for p in paths]
        vocabs = {h.vocab_size for h in headers}
        if len(vocabs) > 1:
            detail = ", ".join(f"{p.name}={h.vocab_size}" for p, h in zip(paths, headers))
            raise DataError(f"shards in {directory} disagree on vocab_size ({detail})")
        return cls([shards.open_tokens(p) for p in paths], vocabs.pop())

    @classmethod
    def _arrays(cls, directory: str | Path, dtype: str) -> TokenStream:
        paths = arrays.list_arrays(directory)
        if not paths:
            raise DataError(f"no {shards.SHARD_SUFFIX} shards or .bin/.npy token arrays in {directory}")
        parts = []
        for path in paths:
            try:
                parts.append(arrays.open_array(path, dtype))
            except arrays.ArrayError as exc:
                raise DataError(f"token array {path}: {exc}") from None
        return cls(parts, None)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def window(self, start: int, length: int) -> np.ndarray:
        """``length`` tokens from global index ``start``, stitched across shard boundaries."""
        out = np.empty(length, dtype=np.int64)
        filled = 0
        part = int(np.searchsorted(self.starts, start, side="right")) - 1
        offset = start - int(self.starts[part])
        while filled < length:
            chunk = self.parts[part][offset : offset + length - filled]
            out[filled : filled + len(chunk)] = chunk
            filled += len(chunk)
            part, offset = part + 1, 0
        return out


def global_starts(step: int, seed: int, total_tokens: int, window: int, global_batch: int) -> np.ndarray:
    """Start offsets of the step's ``global_batch`` windows: a pure function of (seed, step)."""
    if total_tokens < window:
        raise DataError(f"dataset has {total_tokens} tokens, fewer than one window of {window}")
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, total_tokens - window + 1, size=global_batch)


def micro_batches(
    stream: TokenStream, plan: BatchPlan, step: int, seed: int, seq_len: int, device: str | torch.device = "cpu"
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's (inputs, targets) micro-batches for ``step``, each (micro_batch, seq_len) int64 on ``device``."""
    starts = global_starts(step, seed, len(stream), seq_len + 1, plan.global_batch)
    mine = starts[plan.rank * plan.per_rank : (plan.rank + 1) * plan.per_rank]
    stacked = np.stack([stream.window(int(s), seq_len + 1) for s in mine])
    if stream.id_limit is not None and stacked.size and int(stacked.max()) >= stream.id_limit:
        raise DataError(
            f"step {step}: token id {int(stacked.max())} is not below the model's --vocab-size {stream.id_limit};"
            " raise it, or set dataset.expectations.max_vocab so that check_dataset finds such ids first"
        )
    windows = torch.from_numpy(stacked)
    if torch.device(device).type == "cuda":
        # One copy per step from pinned memory; the micro-batches are views of it on the device.
        windows = windows.pin_memory().to(device, non_blocking=True)
    return [(chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()) for chunk in windows.split(plan.micro_batch)]
