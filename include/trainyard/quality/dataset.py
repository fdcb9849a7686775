"""The dataset gate: the staged shards exist, parse, and meet the spec's expectations."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainyard.errors import DataError
from trainyard.shards import SHARD_SUFFIX, read_header
from trainyard.spec import DataExpectations
from trainyard.storage.keys import key_path
from trainyard.storage.staging import read_staged


@dataclass(frozen=True)
class DatasetReport:
    shards: int
    non_empty: int
    tokens: int
    vocab_size: int

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def check_dataset(hot_dir: Path, expect: DataExpectations) -> DatasetReport:
    """Read every staged shard's header; ``DataError`` names each failed expectation and its shards."""
    keys = sorted(k for k in read_staged(hot_dir) if k.endswith(SHARD_SUFFIX))
    if not keys:
        raise DataError(f"{hot_dir}: no staged *{SHARD_SUFFIX} shards (is the staged manifest missing?)")
    headers = {key: read_header(key_path(hot_dir, key)) for key in keys}  # DataError names a corrupt shard
    small = [k for k, h in headers.items() if h.tokens < expect.min_tokens_per_shard]
    problems = []
    if small:
        problems.append(
            f"{len(small)} shard(s) have fewer than min_tokens_per_shard={expect.min_tokens_per_shard} tokens: "
            + ", ".join(small[:10])
        )
    non_empty = len(keys) - len(small)
    if non_empty < expect.min_shards:
        problems.append(f"only {non_empty} non-empty shard(s); expectations.min_shards is {expect.min_shards}")
    if expect.max_vocab is not None:
        wide = [f"{k} (vocab {h.vocab_size})" for k, h in headers.items() if h.vocab_size > expect.max_vocab]
        if wide:
            problems.append(f"shards declare a vocabulary above max_vocab={expect.max_vocab}: " + ", ".join(wide[:10]))
    if problems:
        raise DataError(f"{hot_dir}: " + "; ".join(problems))
    return DatasetReport(
        shards=len(keys),
        non_empty=non_empty,
        tokens=sum(h.tokens for h in headers.values()),
        vocab_size=max(h.vocab_size for h in headers.values()),
    )
