"""Validate a ``.safetensors`` file without torch and without unpickling: header, layout, finite values.

The format is plain: 8 bytes (little-endian header length), a JSON header naming each tensor's dtype, shape
and byte range in the data that follows, then the data. So the orchestrator checks it itself (nothing here
runs code a training process wrote; docs/architecture.md, rule 11): the header is read bounded and
schema-checked, the tensors' ranges must tile the data exactly (no gap, no overlap, nothing past the end),
and every floating-point value is finite -- judged on the raw bits with numpy, chunk by chunk, so memory
stays bounded whatever the file's size.

The header runs in the orchestrator, so its cost is bounded by its size, not by what it says: a number has
at most ``MAX_DIGITS`` digits (Python's ``int`` of a long digit string, and products of such, cost
quadratic time), a shape at most ``MAX_DIMS`` dimensions and ``MAX_ELEMENTS`` elements. Every dtype the
format has is declared in ``DTYPES`` with how its NaN and Inf look; one whose bit patterns are all finite
says so. The file is read once, through ``readonce.Once``: the digest ``check`` returns is of the very bytes
judged, for ``validate`` to compare with the manifest.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainyard.checkpoint.readonce import Once

HEADER_BYTES = 100 << 20
"""The cap on the JSON header (safetensors' own reader refuses more)."""
CHUNK = 64 << 20
MAX_DIGITS = 19
"""Digits of one number in the header: an int64's, as safetensors' own reader parses them."""
MAX_DIMS = 64
MAX_ELEMENTS = 1 << 62
"""Elements of one tensor: past this no file could hold it (safetensors' reader overflows a usize)."""

Count = Callable[[np.ndarray], tuple[int, int]]


def _ieee(exp: int, mant: int) -> Count:
    """NaN and Inf of an IEEE-like format: an all-ones exponent; NaN if the mantissa is not zero."""

    def count(bits: np.ndarray) -> tuple[int, int]:
        special = (bits & bits.dtype.type(exp)) == bits.dtype.type(exp)
        if not special.any():
            return 0, 0
        nan = int(((bits & bits.dtype.type(mant)) != 0)[special].sum())
        return nan, int(special.sum()) - nan

    return count


def _nan_when(mask: int, value: int) -> Count:
    """Formats without Inf whose one NaN pattern is ``bits & mask == value``."""
    return lambda bits: (int(((bits & bits.dtype.type(mask)) == value).sum()), 0)


@dataclass(frozen=True)
class Dtype:
    bits: int
    """Bits of one element (4 and 6 for the packed MX formats)."""
    view: Any = np.uint8
    """The unsigned integer type the raw bytes are read as."""
    non_finite: Count | None = None
    """Counts (NaN, Inf) in raw bits; None: every bit pattern is a finite number (or not a float at all)."""


# Every dtype of the safetensors format (its Rust ``Dtype``). The float8 "fn"/"fnuz" formats have no Inf:
# E4M3's NaN is S.1111.111, the "fnuz" ones' is the negative zero pattern 0x80, E8M0's (a scale) is 0xFF.
# F4 (E2M1) and F6 (E2M3, E3M2), the MX element formats, have no NaN or Inf at all. C64 is two F32s.
DTYPES: dict[str, Dtype] = {
    "BOOL": Dtype(8), "U8": Dtype(8), "I8": Dtype(8), "I16": Dtype(16), "U16": Dtype(16),
    "I32": Dtype(32), "U32": Dtype(32), "I64": Dtype(64), "U64": Dtype(64),
    "F4": Dtype(4), "F6_E2M3": Dtype(6), "F6_E3M2": Dtype(6),
    "F8_E5M2": Dtype(8, np.uint8, _ieee(0x7C, 0x03)),
    "F8_E4M3": Dtype(8, np.uint8, _nan_when(0x7F, 0x7F)),
    "F8_E4M3FNUZ": Dtype(8, np.uint8, _nan_when(0xFF, 0x80)),
    "F8_E5M2FNUZ": Dtype(8, np.uint8, _nan_when(0xFF, 0x80)),
    "F8_E8M0": Dtype(8, np.uint8, _nan_when(0xFF, 0xFF)),
    "F16": Dtype(16, np.uint16, _ieee(0x7C00, 0x03FF)),
    "BF16": Dtype(16, np.uint16, _ieee(0x7F80, 0x007F)),
    "F32": Dtype(32, np.uint32, _ieee(0x7F800000, 0x007FFFFF)),
    "C64": Dtype(64, np.uint32, _ieee(0x7F800000, 0x007FFFFF)),
    "F64": Dtype(64, np.uint64, _ieee(0x7FF0000000000000, 0x000FFFFFFFFFFFFF)),
}  # fmt: skip


class _TooLong(ValueError):
    pass


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_DIGITS:
        raise _TooLong(f"a number of {len(digits)} digits (at most {MAX_DIGITS})")
    return int(digits)


@dataclass(frozen=True)
class Checked:
    problems: list[str]
    digest: tuple[int, str] | None
    """Size and sha256 of the bytes judged; None if the file could not be opened."""


def problems(path: Path) -> list[str]:
    """Why ``path`` is not a whole safetensors file of finite tensors; [] when it is."""
    return check(path.parent, path.name).problems


def check(folder: Path, rel: str) -> Checked:
    """``folder/rel`` judged and hashed in one read: its problems and the digest of what was judged."""
    name = rel
    try:
        once = Once(folder, rel)
    except OSError as exc:
        return Checked([f"{name}: cannot open ({exc.strerror or exc})"], None)
    with once:
        found = _judge(once, name)
        return Checked(found, once.finish())


def _judge(once: Once, name: str) -> list[str]:
    header, found = _header(once, name)
    if found:
        return found
    layout, found = _layout(header, once.size - once.pos, name)
    return found or _non_finite(once, layout, name)


def _header(once: Once, name: str) -> tuple[dict[str, Any], list[str]]:
    if once.size < 8:
        return {}, [f"{name}: {once.size} bytes, shorter than a safetensors header"]
    length = int.from_bytes(once.read(8), "little")
    if length > min(HEADER_BYTES, once.size - 8):
        return {}, [f"{name}: header of {length} bytes does not fit (cap {HEADER_BYTES}, file {once.size})"]
    try:
        header = json.loads(once.read(length), parse_int=_bounded_int)
    except _TooLong as exc:
        return {}, [f"{name}: header holds {exc}"]
    except (ValueError, RecursionError) as exc:
        return {}, [f"{name}: header is not JSON ({str(exc)[:200]})"]
    if not isinstance(header, dict):
        return {}, [f"{name}: header is not a JSON object"]
    return header, []


def _layout(header: dict[str, Any], data_bytes: int, name: str) -> tuple[list[tuple[str, str, int, int]], list[str]]:
    """(tensor, dtype, begin, end) sorted by position, or the problems of the header's schema and layout."""
    out: list[tuple[str, str, int, int]] = []
    for key, info in header.items():
        if key == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                return [], [f"{name}: __metadata__ is not a map of strings"]
            continue
        if not isinstance(info, dict) or info.get("dtype") not in DTYPES:
            return [], [f"{name}: tensor {key[:100]!r} has no known dtype"]
        shape: Any = info.get("shape")
        offsets: Any = info.get("data_offsets")
        if not _ints(shape) or not _ints(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
            return [], [f"{name}: tensor {key[:100]!r} has a malformed shape or data_offsets"]
        need = _bytes_of(shape, DTYPES[info["dtype"]].bits)
        if isinstance(need, str):
            return [], [f"{name}: tensor {key[:100]!r} {need}"]
        if offsets[1] - offsets[0] != need:
            return [], [f"{name}: tensor {key[:100]!r} spans {offsets[1] - offsets[0]} bytes, its shape needs {need}"]
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


def _bytes_of(shape: list[int], bits: int) -> int | str:
    """The bytes a shape of ``bits``-bit elements takes, or why the shape is refused."""
    if len(shape) > MAX_DIMS:
        return f"has {len(shape)} dimensions (at most {MAX_DIMS})"
    count = 1
    for dim in shape:
        count *= dim  # each factor has at most MAX_DIGITS digits and the product stops at MAX_ELEMENTS
        if count > MAX_ELEMENTS:
            return f"has more than {MAX_ELEMENTS} elements"
    if count * bits % 8:
        return f"has {count} elements of {bits} bits, which do not end at a byte boundary"
    return count * bits // 8


def _ints(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


def _non_finite(once: Once, layout: list[tuple[str, str, int, int]], name: str) -> list[str]:
    found = []
    start = once.pos
    for key, dtype, begin, end in layout:
        once.skip_to(start + begin)  # the tensors tile the data: nothing is skipped, the position is checked
        spec = DTYPES[dtype]
        width = max(spec.bits // 8, 1)
        step = CHUNK - CHUNK % width
        nan = inf = 0
        for pos in range(begin, end, step):
            raw = once.read(min(step, end - pos))
            if spec.non_finite is not None and raw:
                bits = np.frombuffer(raw, dtype=spec.view, count=len(raw) // np.dtype(spec.view).itemsize)
                n, i = spec.non_finite(bits)
                nan, inf = nan + n, inf + i
        if nan or inf:
            found.append(f"{name}: tensor {key[:100]} has {nan} NaN and {inf} Inf value(s)")
    return found
