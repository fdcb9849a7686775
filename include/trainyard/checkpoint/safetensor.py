"""Validate a ``.safetensors`` file without torch and without unpickling: header, layout, finite values.

The format is plain: 8 bytes (little-endian header length), a JSON header naming each tensor's dtype, shape
and byte range in the data that follows, then the data. So the orchestrator checks it itself (nothing here
runs code a training process wrote; docs/architecture.md, rule 11): the header is read bounded and
schema-checked, the tensors' ranges must tile the data exactly (no gap, no overlap, nothing past the end),
and every floating-point value is finite -- judged on the raw bits with numpy (an all-ones exponent is a
NaN or an Inf), chunk by chunk, so memory stays bounded whatever the file's size.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import numpy as np

from trainyard.atomic import loads_untrusted

HEADER_BYTES = 100 << 20
"""The cap on the JSON header (safetensors' own reader refuses more)."""
CHUNK = 64 << 20
# dtype -> (bytes per element, the unsigned view, exponent mask, mantissa mask) for floats; ints have no mask.
_FLOATS: dict[str, tuple[int, Any, int, int]] = {
    "F16": (2, np.uint16, 0x7C00, 0x03FF),
    "BF16": (2, np.uint16, 0x7F80, 0x007F),
    "F32": (4, np.uint32, 0x7F800000, 0x007FFFFF),
    "F64": (8, np.uint64, 0x7FF0000000000000, 0x000FFFFFFFFFFFFF),
    "F8_E5M2": (1, np.uint8, 0x7C, 0x03),
}
_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E4M3FN": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "I32": 4, "U32": 4, "I64": 8, "U64": 8,
    **{name: spec[0] for name, spec in _FLOATS.items()},
}  # fmt: skip


def problems(path: Path) -> list[str]:
    """Why ``path`` is not a whole safetensors file of finite tensors; [] when it is."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        return [f"{path.name}: cannot open ({exc.strerror or exc})"]
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return [f"{path.name}: not a regular file"]
        header, start, found = _header(fd, st.st_size, path.name)
        if found:
            return found
        layout, found = _layout(header, st.st_size - start, path.name)
        return found or _non_finite(fd, start, layout, path.name)
    finally:
        os.close(fd)


def _header(fd: int, size: int, name: str) -> tuple[dict[str, Any], int, list[str]]:
    if size < 8:
        return {}, 0, [f"{name}: {size} bytes, shorter than a safetensors header"]
    length = int.from_bytes(os.pread(fd, 8, 0), "little")
    if length > min(HEADER_BYTES, size - 8):
        return {}, 0, [f"{name}: header of {length} bytes does not fit (cap {HEADER_BYTES}, file {size})"]
    try:
        header = loads_untrusted(os.pread(fd, length, 8), "header")
    except ValueError as exc:  # "header is not JSON (why)"
        return {}, 0, [f"{name}: {str(exc)[:200]}"]
    if not isinstance(header, dict):
        return {}, 0, [f"{name}: header is not a JSON object"]
    return header, 8 + length, []


def _layout(header: dict[str, Any], data_bytes: int, name: str) -> tuple[list[tuple[str, str, int, int]], list[str]]:
    """(tensor, dtype, begin, end) sorted by position, or the problems of the header's schema and layout."""
    out: list[tuple[str, str, int, int]] = []
    for key, info in header.items():
        if key == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                return [], [f"{name}: __metadata__ is not a map of strings"]
            continue
        if not isinstance(info, dict) or info.get("dtype") not in _SIZES:
            return [], [f"{name}: tensor {key[:100]!r} has no known dtype"]
        shape: Any = info.get("shape")
        offsets: Any = info.get("data_offsets")
        if not _ints(shape) or not _ints(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
            return [], [f"{name}: tensor {key[:100]!r} has a malformed shape or data_offsets"]
        count = 1
        for dim in shape:
            count *= dim
        if offsets[1] - offsets[0] != count * _SIZES[info["dtype"]]:
            return [], [f"{name}: tensor {key[:100]!r} spans {offsets[1] - offsets[0]} bytes, its shape needs"
                        f" {count * _SIZES[info['dtype']]}"]  # fmt: skip
        out.append((key, info["dtype"], offsets[0], offsets[1]))
    out.sort(key=lambda t: (t[2], t[3]))
    at = 0
    for key, _, begin, end in out:
        if begin != at:
            what = "overlaps the one before" if begin < at else f"leaves a gap of {begin - at} bytes before it"
            return [], [f"{name}: tensor {key[:100]!r} {what}"]
        at = end
    if at != data_bytes:
        return [], [f"{name}: the tensors cover {at} bytes of {data_bytes} (cut short or trailing bytes)"]
    return out, []


def _ints(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


def _non_finite(fd: int, start: int, layout: list[tuple[str, str, int, int]], name: str) -> list[str]:
    found = []
    for key, dtype, begin, end in layout:
        if dtype not in _FLOATS:
            continue
        width, view, exp, mant = _FLOATS[dtype]
        nan = inf = 0
        step = CHUNK - CHUNK % width
        for pos in range(begin, end, step):
            raw = os.pread(fd, min(step, end - pos), start + pos)
            bits = np.frombuffer(raw, dtype=view)
            special = (bits & view(exp)) == view(exp)
            if special.any():
                nans = int(((bits & view(mant)) != 0)[special].sum())
                nan, inf = nan + nans, inf + int(special.sum()) - nans
        if nan or inf:
            found.append(f"{name}: tensor {key[:100]} has {nan} NaN and {inf} Inf value(s)")
    return found
