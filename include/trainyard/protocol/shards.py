"""The token shard format: one flat array of token ids per ``*.tok`` file.

This module owns the on-disk layout of a shard and nothing else: writing one
atomically, reading and checking its header, and mapping its tokens into memory
without copying them. The layout is a fixed 20-byte little-endian header
followed by the tokens::

    offset  size  field
    0       6     magic b"TYTOK1"
    6       1     dtype code: bytes per token (2 = uint16, 4 = uint32)
    7       1     padding (zero)
    8       4     vocab_size (uint32)
    12      8     token_count (uint64)
    20      ...   token_count tokens of the dtype

A fixed header (rather than ``.npy``) lets ``read_header`` validate a shard
from 20 bytes and the file size alone, which is what the data-quality gate and
the trainer do before touching the tokens. ``write_synthetic_corpus`` makes a
small seeded corpus that a tiny model can visibly learn, for tests, drills and
the embedded demo pipeline.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainyard.atomic import temp_name
from trainyard.errors import DataError

SHARD_SUFFIX = ".tok"
MAGIC = b"TYTOK1"
HEADER = struct.Struct("<6sBxIQ")
assert HEADER.size == 20  # the layout above is a file format; catch an accidental edit

# dtype code -> numpy dtype. The code is the item size, so it doubles as a sanity check.
_DTYPES: dict[int, np.dtype] = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


@dataclass(frozen=True)
class ShardHeader:
    """What a shard's header says: bytes per token, vocabulary size and token count."""

    dtype_bytes: int
    vocab_size: int
    tokens: int

    @property
    def dtype(self) -> np.dtype:
        return _DTYPES[self.dtype_bytes]


def dtype_bytes_for(vocab_size: int) -> int:
    """The narrowest supported token width for a vocabulary (halves I/O for vocab <= 65536)."""
    if vocab_size < 1 or vocab_size > 2**32:
        raise ValueError(f"vocab_size must be in 1..2**32, got {vocab_size}")
    return 2 if vocab_size <= 2**16 else 4


def write_shard(path: str | Path, tokens: np.ndarray, vocab_size: int) -> ShardHeader:
    """Write ``tokens`` as a shard at ``path``, atomically.

    The bytes go to a temporary file in the same directory, are fsynced, then
    renamed over ``path``: a reader (or a crash) never sees a half-written
    shard under the final name.
    """
    path = Path(path)
    array = np.asarray(tokens)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise ValueError(f"tokens must be a 1-D integer array, got {array.dtype} with shape {array.shape}")
    if array.size and (int(array.min()) < 0 or int(array.max()) >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size}); got [{array.min()}, {array.max()}]")
    header = ShardHeader(dtype_bytes_for(vocab_size), vocab_size, int(array.size))
    payload = array.astype(header.dtype, copy=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    try:
        with tmp.open("wb") as fh:
            fh.write(HEADER.pack(MAGIC, header.dtype_bytes, vocab_size, header.tokens))
            fh.write(payload.tobytes())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return header


def read_header(path: str | Path) -> ShardHeader:
    """Read and check a shard's header against the file; raise ``DataError`` naming the file."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            raw = fh.read(HEADER.size)
            size = os.fstat(fh.fileno()).st_size
    except OSError as exc:
        raise DataError(f"shard {path}: cannot read ({exc.strerror or exc})") from exc
    if len(raw) < HEADER.size:
        raise DataError(f"shard {path}: truncated header ({len(raw)} of {HEADER.size} bytes)")
    magic, code, vocab_size, count = HEADER.unpack(raw)
    if magic != MAGIC:
        raise DataError(f"shard {path}: bad magic {magic!r} (expected {MAGIC!r}); not a trainyard token shard")
    if code not in _DTYPES:
        raise DataError(f"shard {path}: unknown dtype code {code} (expected one of {sorted(_DTYPES)})")
    if vocab_size == 0:
        raise DataError(f"shard {path}: vocab_size is 0")
    expected = HEADER.size + count * code
    if size != expected:
        what = "truncated" if size < expected else "trailing bytes"
        raise DataError(
            f"shard {path}: size mismatch ({what}): header says {count} tokens x {code} bytes "
            f"= {expected} bytes with header, file has {size}"
        )
    return ShardHeader(code, vocab_size, count)


def open_tokens(path: str | Path) -> np.ndarray:
    """The shard's tokens as a read-only memory map (no copy; pages load on demand)."""
    header = read_header(path)
    return map_tokens(path, header.dtype, HEADER.size, header.tokens)


def map_tokens(path: str | Path, dtype: np.dtype | type, offset: int, tokens: int) -> np.ndarray:
    """``tokens`` tokens of ``dtype`` at ``offset`` in the file, as a read-only memory map (every token format's
    reader: shards here, numpy arrays in ``arrays``)."""
    if tokens == 0:
        # mmap cannot map zero bytes; an empty read-only array behaves the same for callers.
        empty = np.empty(0, dtype=dtype)
        empty.flags.writeable = False
        return empty
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(tokens,))


def list_shards(directory: str | Path) -> list[Path]:
    """The shards of a dataset directory in their canonical (sorted) order."""
    return sorted(Path(directory).glob(f"*{SHARD_SUFFIX}"))


def markov_tokens(count: int, vocab_size: int, seed: int, successors: int = 4) -> np.ndarray:
    """A seeded token stream from a sparse random Markov chain.

    Each token has ``successors`` likely next tokens, drawn with one shared
    skewed distribution. A model that learns the bigram table cuts its loss
    from ln(vocab) to about the chain's entropy (~1.2 nats for 4 successors),
    which a tiny model does within tens of steps: a clear "it trains" signal.
    """
    rng = np.random.default_rng(seed)
    table = rng.integers(0, vocab_size, size=(vocab_size, successors))
    weights = 0.5 ** np.arange(successors)  # 4 successors: 0.53, 0.27, 0.13, 0.07
    choice = rng.choice(successors, size=count, p=weights / weights.sum())
    # The walk itself is sequential; plain Python ints over lists is the fastest
    # way to run it without a compiled helper (about 0.1 s per million tokens).
    rows, picks = table.tolist(), choice.tolist()
    out = [0] * count
    current = int(rng.integers(vocab_size))
    for i in range(count):
        out[i] = current
        current = rows[current][picks[i]]
    return np.asarray(out, dtype=np.int64)


def write_synthetic_corpus(
    directory: str | Path,
    shards: int = 8,
    tokens_per_shard: int = 65_536,
    vocab_size: int = 256,
    seed: int = 0,
) -> list[Path]:
    """Write a seeded, learnable corpus as ``shard_00000.tok`` ... and return the paths.

    One Markov chain runs across all shards, so windows that straddle a shard
    boundary are as learnable as any other. Defaults total 1 MiB on disk.
    """
    if shards < 1 or tokens_per_shard < 1:
        raise ValueError(f"need at least one shard and one token per shard, got {shards} x {tokens_per_shard}")
    stream = markov_tokens(shards * tokens_per_shard, vocab_size, seed)
    directory = Path(directory)
    paths = []
    for i in range(shards):
        path = directory / f"shard_{i:05d}{SHARD_SUFFIX}"
        write_shard(path, stream[i * tokens_per_shard : (i + 1) * tokens_per_shard], vocab_size)
        paths.append(path)
    return paths
