"""Numpy token arrays: the ``.bin`` and ``.npy`` files nanoGPT- and Megatron-style pipelines write.

This module owns reading such a file as untrusted input, and nothing else: checking its layout
against its size (``read_array``), scanning its token ids in bounded chunks (``scan_tokens``) and
mapping it into memory without a copy (``open_array``).

- ``.bin``: the raw tokens, no header (nanoGPT's ``np.memmap(..., dtype=np.uint16, mode="w+")``),
  so the dtype comes from the spec (``dataset.dtype``); the size must be a multiple of it.
- ``.npy``: numpy's format, a header then the tokens. Only the header is parsed (bounded, never
  unpickled: an object array is refused before any data is read); it must declare a 1-D
  little-endian uint16 or uint32 array that the file holds exactly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from trainyard.errors import DataError
from trainyard.protocol.shards import map_tokens

ARRAY_SUFFIXES = (".bin", ".npy")
DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
# A token array's header is a few dozen bytes; numpy's own default bound is 10000.
MAX_NPY_HEADER = 10_000
# Tokens read per chunk when scanning: 16 MiB of uint32, whatever the file's size.
SCAN_TOKENS = 1 << 22


class ArrayError(DataError):
    """A token array that cannot be read as one; the message says what is wrong, the caller names the file."""


@dataclass(frozen=True)
class TokenArray:
    """Where a file's tokens are: their dtype, how many, and the bytes before the first one."""

    dtype: np.dtype
    tokens: int
    offset: int

    @property
    def dtype_name(self) -> str:
        return next(name for name, dt in DTYPES.items() if dt == self.dtype)


def read_array(path: str | Path, dtype: str) -> TokenArray:
    """Check ``path``'s layout against its size; ``ArrayError`` says what is wrong.

    ``dtype`` (``uint16``/``uint32``) is what a ``.bin`` holds; a ``.npy`` header must say the same.
    """
    path, declared = Path(path), DTYPES[dtype]
    with path.open("rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if path.suffix != ".npy":
            if size % declared.itemsize:
                raise ArrayError(
                    f"size {size} bytes is not a multiple of {declared.itemsize} ({dtype}, dataset.dtype):"
                    " truncated, or written with another dtype"
                )
            return TokenArray(declared, size // declared.itemsize, 0)
        found, count = _npy_header(fh)
        offset = fh.tell()
    if found != declared:
        raise ArrayError(f"the .npy header says {found.str} but dataset.dtype is {dtype} ({declared.str})")
    expected = offset + count * found.itemsize
    if size != expected:
        what = "truncated" if size < expected else "trailing bytes"
        raise ArrayError(f"size mismatch ({what}): the header says {count} tokens = {expected} bytes, file has {size}")
    return TokenArray(found, count, offset)


def _npy_header(fh: BinaryIO) -> tuple[np.dtype, int]:
    """The dtype and length a ``.npy`` header declares, refusing anything that is not a 1-D token array."""
    fmt = np.lib.format
    try:
        version = fmt.read_magic(fh)
        if version == (1, 0):
            shape, fortran, dtype = fmt.read_array_header_1_0(fh, max_header_size=MAX_NPY_HEADER)
        elif version == (2, 0):
            shape, fortran, dtype = fmt.read_array_header_2_0(fh, max_header_size=MAX_NPY_HEADER)
        else:
            raise ArrayError(f"unsupported .npy version {version[0]}.{version[1]} (1.0 and 2.0 hold token arrays)")
    except ArrayError:
        raise
    except (ValueError, EOFError, OSError) as exc:  # numpy says what it found wrong in the header
        raise ArrayError(f"not a readable .npy file ({exc})") from None
    if dtype.hasobject:
        raise ArrayError("an object array (it would need unpickling); token arrays are uint16 or uint32")
    if dtype not in DTYPES.values():
        raise ArrayError(f"dtype {dtype.str}; token arrays are little-endian uint16 or uint32 (<u2, <u4)")
    if len(shape) != 1:
        raise ArrayError(f"shape {tuple(shape)}; a token array is 1-D (flatten it when writing)")
    del fortran  # one dimension: both orders are the same bytes
    return dtype, int(shape[0])


def scan_tokens(path: str | Path, array: TokenArray, chunk: int = SCAN_TOKENS) -> int:
    """The largest token id in the file (-1 if it has none), read in chunks into one reused buffer.

    Plain reads rather than a memory map: the gate may scan gigabytes, and its memory stays one chunk.
    """
    buffer = np.empty(min(chunk, max(array.tokens, 1)), dtype=array.dtype)
    view = memoryview(buffer.data).cast("B")
    largest, left = -1, array.tokens
    with Path(path).open("rb") as fh:
        fh.seek(array.offset)
        while left:
            want = min(left, len(buffer))
            got = fh.readinto(view[: want * array.dtype.itemsize]) or 0
            if got < want * array.dtype.itemsize:  # shrank since read_array looked
                raise ArrayError(f"shorter than its size said: {array.tokens - left} of {array.tokens} tokens read")
            largest = max(largest, int(buffer[:want].max()))
            left -= want
    return largest


def open_array(path: str | Path, dtype: str) -> np.ndarray:
    """The file's tokens as a read-only memory map (no copy; pages load on demand)."""
    array = read_array(path, dtype)
    return map_tokens(path, array.dtype, array.offset, array.tokens)


def list_arrays(directory: str | Path) -> list[Path]:
    """The token arrays of a dataset directory in their canonical (sorted by name) order."""
    return sorted(p for p in Path(directory).iterdir() if p.suffix in ARRAY_SUFFIXES and p.is_file())
