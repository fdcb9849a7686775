"""safetensors headers are judged in the orchestrator: bounded, and every float type's NaN seen (issue 49, 7)."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest

from trainyard.checkpoint import safetensor


def write(path: Path, tensors: dict[str, tuple[str, list[int], bytes]], raw_header: bytes | None = None) -> Path:
    header, data = {}, b""
    for name, (dtype, shape, payload) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(payload)]}
        data += payload
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def test_a_header_of_huge_dimensions_is_a_problem_not_an_exception(tmp_path: Path) -> None:
    dims = ", ".join(["9" * 4000] * 3)
    header = f'{{"t": {{"dtype": "F32", "shape": [{dims}], "data_offsets": [0, 4]}}}}'.encode()
    [problem] = safetensor.problems(write(tmp_path / "digits.safetensors", {}, header))
    assert "digits" in problem
    shape = [1] * (safetensor.MAX_DIMS + 1)
    [problem] = safetensor.problems(write(tmp_path / "dims.safetensors", {"t": ("F32", shape, b"\0" * 4)}))
    assert "dimensions" in problem
    huge = [10**18] * 4
    [problem] = safetensor.problems(write(tmp_path / "count.safetensors", {"t": ("U8", huge, b"")}))
    assert "elements" in problem


# (dtype, bytes of one NaN, of one Inf or None where the type has none, of one finite value)
PATTERNS = [
    ("F8_E4M3", b"\x7f", None, b"\x7e"),
    ("F8_E4M3FNUZ", b"\x80", None, b"\x7f"),
    ("F8_E5M2FNUZ", b"\x80", None, b"\x7f"),
    ("F8_E8M0", b"\xff", None, b"\xfe"),
    ("F8_E5M2", b"\x7e", b"\x7c", b"\x7b"),
    ("F16", struct.pack("<e", float("nan")), struct.pack("<e", float("inf")), struct.pack("<e", 1.0)),
    ("BF16", b"\xc0\x7f", b"\x80\x7f", b"\x80\x3f"),
    ("F32", struct.pack("<f", float("nan")), struct.pack("<f", float("-inf")), struct.pack("<f", 1.0)),
    ("F64", struct.pack("<d", float("nan")), struct.pack("<d", float("inf")), struct.pack("<d", 1.0)),
    ("C64", struct.pack("<ff", 1.0, float("nan")), struct.pack("<ff", float("inf"), 0.0), struct.pack("<ff", 1, 2)),
]


@pytest.mark.parametrize("dtype,nan,inf,finite", PATTERNS, ids=[p[0] for p in PATTERNS])
def test_every_float_types_nan_and_inf_are_seen(tmp_path: Path, dtype: str, nan: bytes, inf, finite: bytes) -> None:
    ok = write(tmp_path / "ok.safetensors", {"t": (dtype, [2], finite * 2)})
    assert safetensor.problems(ok) == []
    [problem] = safetensor.problems(write(tmp_path / "nan.safetensors", {"t": (dtype, [2], nan + finite)}))
    assert problem.endswith("tensor t has 1 NaN and 0 Inf value(s)")
    if inf is not None:
        [problem] = safetensor.problems(write(tmp_path / "inf.safetensors", {"t": (dtype, [2], inf + finite)}))
        assert problem.endswith("tensor t has 0 NaN and 1 Inf value(s)")


def test_packed_formats_without_nan_are_known_and_end_at_a_byte(tmp_path: Path) -> None:
    assert safetensor.problems(write(tmp_path / "f6.safetensors", {"t": ("F6_E2M3", [4], b"\xff" * 3)})) == []
    assert safetensor.problems(write(tmp_path / "f4.safetensors", {"t": ("F4", [2], b"\xff")})) == []
    [problem] = safetensor.problems(write(tmp_path / "odd.safetensors", {"t": ("F4", [3], b"\xff\xff")}))
    assert "byte boundary" in problem


def test_the_digest_is_of_the_bytes_judged(tmp_path: Path) -> None:
    path = write(tmp_path / "m.safetensors", {"t": ("F32", [2], struct.pack("<ff", 1, 2)), "i": ("I8", [3], b"abc")})
    checked = safetensor.check(tmp_path, path.name)
    assert checked.problems == []
    assert checked.digest == (path.stat().st_size, hashlib.sha256(path.read_bytes()).hexdigest())
