"""The token shard format: roundtrip, atomic writes, and a DataError for every bad header."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from trainyard.errors import DataError
from trainyard.protocol import shards


def test_roundtrip_uint16(tmp_path: Path) -> None:
    tokens = np.arange(1000, dtype=np.int64) % 256
    path = tmp_path / "a.tok"
    shards.write_shard(path, tokens, vocab_size=256)

    header = shards.read_header(path)
    assert header == shards.ShardHeader(dtype_bytes=2, vocab_size=256, tokens=1000)
    assert path.stat().st_size == shards.HEADER.size + 2 * 1000
    mapped = shards.open_tokens(path)
    assert isinstance(mapped, np.memmap)
    assert mapped.dtype == np.uint16
    np.testing.assert_array_equal(mapped, tokens)
    with pytest.raises(ValueError):
        mapped[0] = 1  # read-only: a bug in the trainer must not be able to corrupt the dataset


def test_roundtrip_uint32_for_large_vocab(tmp_path: Path) -> None:
    tokens = np.array([0, 65_535, 65_536, 99_999])
    path = tmp_path / "big.tok"
    shards.write_shard(path, tokens, vocab_size=100_000)

    assert shards.read_header(path).dtype_bytes == 4
    np.testing.assert_array_equal(shards.open_tokens(path), tokens)


def test_empty_shard_reads_as_empty_array(tmp_path: Path) -> None:
    path = tmp_path / "empty.tok"
    shards.write_shard(path, np.array([], dtype=np.int64), vocab_size=256)
    assert shards.read_header(path).tokens == 0
    assert len(shards.open_tokens(path)) == 0


def test_write_rejects_tokens_outside_vocab(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        shards.write_shard(tmp_path / "x.tok", np.array([1, 256]), vocab_size=256)
    assert not (tmp_path / "x.tok").exists()


def test_failed_write_leaves_no_file_under_final_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "a.tok"
    shards.write_shard(path, np.arange(10), vocab_size=256)
    before = path.read_bytes()

    def crash(*_args: object) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(shards.os, "replace", crash)
    with pytest.raises(OSError):
        shards.write_shard(path, np.arange(20), vocab_size=256)
    # The old shard is untouched and the temporary file was cleaned up.
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["a.tok"]


def _valid_bytes(count: int = 8, code: int = 2) -> bytes:
    header = shards.HEADER.pack(shards.MAGIC, code, 256, count)
    return header + bytes(count * code)


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (_valid_bytes()[:10], "truncated header"),
        (b"NOTTOK" + _valid_bytes()[6:], "bad magic"),
        (shards.HEADER.pack(shards.MAGIC, 3, 256, 8) + bytes(24), "unknown dtype code 3"),
        (_valid_bytes()[:-1], "size mismatch (truncated)"),
        (_valid_bytes() + b"\0", "size mismatch (trailing bytes)"),
        (shards.HEADER.pack(shards.MAGIC, 2, 0, 0), "vocab_size is 0"),
    ],
    ids=["short-header", "magic", "dtype", "truncated", "trailing", "zero-vocab"],
)
def test_bad_header_raises_data_error_naming_file(tmp_path: Path, content: bytes, reason: str) -> None:
    path = tmp_path / "broken_shard.tok"
    path.write_bytes(content)
    with pytest.raises(DataError) as err:
        shards.read_header(path)
    assert str(path) in str(err.value)
    assert reason in str(err.value)
    with pytest.raises(DataError):
        shards.open_tokens(path)


def test_missing_shard_raises_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="missing.tok"):
        shards.read_header(tmp_path / "missing.tok")


def test_synthetic_corpus_is_deterministic_per_seed(tmp_path: Path) -> None:
    kwargs = {"shards": 3, "tokens_per_shard": 5_000, "vocab_size": 128}
    first = shards.write_synthetic_corpus(tmp_path / "a", seed=7, **kwargs)
    again = shards.write_synthetic_corpus(tmp_path / "b", seed=7, **kwargs)
    other = shards.write_synthetic_corpus(tmp_path / "c", seed=8, **kwargs)

    assert [p.name for p in first] == ["shard_00000.tok", "shard_00001.tok", "shard_00002.tok"]
    assert first == shards.list_shards(tmp_path / "a")
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in again]
    assert [p.read_bytes() for p in first] != [p.read_bytes() for p in other]
    assert all(shards.read_header(p) == shards.ShardHeader(2, 128, 5_000) for p in first)


def test_synthetic_corpus_is_learnable(tmp_path: Path) -> None:
    """Each token has at most 4 successors, across shard boundaries too: a bigram model can learn it."""
    paths = shards.write_synthetic_corpus(tmp_path, shards=4, tokens_per_shard=20_000, vocab_size=256)
    stream = np.concatenate([shards.open_tokens(p) for p in paths]).astype(np.int64)
    pairs = np.unique(stream[:-1] * 256 + stream[1:])
    successors = np.bincount(pairs // 256, minlength=256)
    assert successors.max() <= 4
    assert len(np.unique(stream)) > 128  # the walk visits most of the vocabulary, not a tiny loop
