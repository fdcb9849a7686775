"""The data gate beyond ``*.tok``: real numpy token arrays, Parquet and JSON Lines files, staged and checked.

Each case writes its files as the tools teams use write them (``np.memmap`` as nanoGPT does,
``np.save``, pyarrow, one JSON object per line), stages them, and asserts what the gate says.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainyard.errors import DataError
from trainyard.protocol.arrays import ArrayError, open_array, read_array, scan_tokens
from trainyard.quality.dataset import RESULT_FILE, check_dataset
from trainyard.spec import FORMAT_SUFFIXES, DataExpectations
from trainyard.storage import LocalTier
from trainyard.storage.staging import stage


def write_bin(path: Path, tokens: np.ndarray, dtype: str = "uint16") -> None:
    """As nanoGPT's prepare.py writes train.bin: a raw memmap, no header."""
    path.parent.mkdir(parents=True, exist_ok=True)
    out = np.memmap(path, dtype=dtype, mode="w+", shape=(len(tokens),))
    out[:] = tokens
    out.flush()
    del out


def staged(root: Path, fmt: str) -> Path:
    stage(LocalTier(root / "cold"), root / "hot", suffixes=FORMAT_SUFFIXES[fmt])  # type: ignore[index]
    return root / "hot"


def fails(hot: Path, **kwargs: Any) -> str:
    with pytest.raises(DataError) as err:
        check_dataset(hot, **kwargs)
    return str(err.value)


# ---------------------------------------------------------------- numpy token arrays


def numpy_dataset(root: Path) -> Path:
    cold = root / "cold"
    write_bin(cold / "train.bin", np.arange(4096) % 50_000)
    np.save(cold / "part_0001.npy", (np.arange(3000, dtype=np.uint32) * 7) % 50_000)
    (cold / "meta.pkl").write_bytes(b"\x80\x04not staged, never unpickled")
    return cold


def test_numpy_arrays_pass_and_report(tmp_path: Path) -> None:
    numpy_dataset(tmp_path)
    (tmp_path / "cold" / "train.bin").unlink()
    write_bin(tmp_path / "cold" / "train.bin", np.arange(4096) % 50_000, "uint32")
    expect = DataExpectations(min_shards=2, min_tokens_per_shard=1000, max_vocab=50_304, dtypes=["uint32"])
    report = check_dataset(staged(tmp_path, "numpy"), expect, tmp_path / "run", format="numpy", dtype="uint32")
    assert (report.format, report.shards, report.tokens, report.vocab_size) == ("numpy", 2, 4096 + 3000, 2999 * 7 + 1)
    assert report.expectations == 6
    assert json.loads((tmp_path / "run" / RESULT_FILE).read_text())["success"] is True


@pytest.mark.parametrize(
    ("change", "expect", "words"),
    [
        (
            lambda cold: write_bin(cold / "b.bin", np.array([1, 2, 60_000])),
            {"max_vocab": 50_304},
            "token ids below 50304 (expectations.max_vocab): b.bin (largest id 60000)",
        ),
        (
            lambda cold: (cold / "odd.bin").write_bytes(b"\x01\x00\x02"),
            {},
            "files readable: odd.bin: size 3 bytes is not a multiple of 2 (uint16, dataset.dtype)",
        ),
        (
            lambda cold: write_bin(cold / "short.bin", np.arange(10)),
            {"min_tokens_per_shard": 100},
            "tokens per file at least 100 (expectations.min_tokens_per_shard/max_tokens_per_shard): short.bin (10"
            " tokens)",
        ),
        (
            lambda cold: np.save(cold / "wide.npy", np.arange(10, dtype=np.uint32)),
            {},
            "files readable: wide.npy: the .npy header says <u4 but dataset.dtype is uint16 (<u2)",
        ),
        (
            lambda cold: np.save(cold / "obj.npy", np.array([{"x": 1}], dtype=object), allow_pickle=True),
            {},
            "files readable: obj.npy: an object array (it would need unpickling)",
        ),
        (
            lambda cold: np.save(cold / "grid.npy", np.zeros((3, 4), dtype=np.uint16)),
            {},
            "files readable: grid.npy: shape (3, 4); a token array is 1-D",
        ),
        (
            lambda cold: (cold / "cut.npy").write_bytes(_npy_bytes(np.arange(100, dtype=np.uint16))[:-10]),
            {},
            "files readable: cut.npy: size mismatch (truncated): the header says 100 tokens",
        ),
        (
            lambda cold: (cold / "junk.npy").write_bytes(b"PK\x03\x04 not numpy"),
            {},
            "files readable: junk.npy: not a readable .npy file",
        ),
        (
            lambda cold: write_bin(cold / "copy.bin", np.arange(4096) % 50_000),
            {},
            "file contents unique by digest (expectations.unique_shards): copy.bin (xxh3-128:",
        ),
    ],
    ids=[
        "token_out_of_range",
        "odd_byte_size",
        "too_few_tokens",
        "npy_dtype_disagrees",
        "npy_object_array",
        "npy_2d",
        "npy_truncated",
        "npy_not_numpy",
        "duplicate_file",
    ],
)
def test_each_numpy_expectation_fails_naming_the_file(
    tmp_path: Path, change: Any, expect: dict[str, Any], words: str
) -> None:
    cold = numpy_dataset(tmp_path)
    (cold / "part_0001.npy").unlink()  # a uint32 .npy: the uint16 cases below have one of their own
    change(cold)
    message = fails(staged(tmp_path, "numpy"), expect=DataExpectations(**expect), format="numpy", dtype="uint16")
    assert message.startswith(f"numpy files in {tmp_path / 'hot'} failed 1 of "), message
    assert words in message, message


def _npy_bytes(array: np.ndarray) -> bytes:
    import io

    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def test_token_arrays_are_scanned_in_bounded_chunks_and_mapped_read_only(tmp_path: Path) -> None:
    tokens = np.arange(10_001, dtype=np.uint32) % 9_999
    np.save(tmp_path / "a.npy", tokens)
    array = read_array(tmp_path / "a.npy", "uint32")
    assert (array.tokens, array.dtype_name) == (10_001, "uint32") and array.offset in (128, 64)
    assert scan_tokens(tmp_path / "a.npy", array, chunk=1000) == 9_998  # the largest id, across 11 chunks
    mapped = open_array(tmp_path / "a.npy", "uint32")
    assert np.array_equal(mapped, tokens) and not mapped.flags.writeable
    (tmp_path / "empty.bin").write_bytes(b"")
    assert len(open_array(tmp_path / "empty.bin", "uint16")) == 0
    (tmp_path / "odd.bin").write_bytes(b"\0" * 6)
    with pytest.raises(ArrayError, match="size 6 bytes is not a multiple of 4"):
        read_array(tmp_path / "odd.bin", "uint32")


# ---------------------------------------------------------------- text: Parquet and JSON Lines


def texts(count: int, start: int = 0) -> list[str]:
    return [f"document number {i} says something of its own" for i in range(start, start + count)]


def write_jsonl(path: Path, rows: list[Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))


def write_parquet(path: Path, column: dict[str, list[Any]], row_group_size: int = 50) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(column), path, row_group_size=row_group_size)


def test_text_files_pass_and_report(tmp_path: Path) -> None:
    write_parquet(tmp_path / "cold" / "part-0.parquet", {"content": texts(120), "id": list(range(120))})
    write_parquet(tmp_path / "cold" / "part-1.parquet", {"content": texts(80, 120), "id": list(range(80))})
    (tmp_path / "cold" / "_SUCCESS").write_bytes(b"")
    report = check_dataset(
        staged(tmp_path, "parquet"), DataExpectations(min_chars=10), tmp_path / "run", format="parquet",
        text_column="content",
    )  # fmt: skip
    assert (report.format, report.shards, report.non_empty, report.documents) == ("parquet", 2, 2, 200)
    saved = json.loads((tmp_path / "run" / RESULT_FILE).read_text())
    assert saved["success"] is True and set(saved) == {"success", "files", "documents"}


def test_text_reads_a_bounded_sample_shared_among_the_files(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "cold" / "a.jsonl", [{"text": t} for t in texts(1000)])
    # A malformed line past the sample is not read: the sample is what bounds the gate's memory and time.
    write_jsonl(tmp_path / "cold" / "b.jsonl", [{"text": t} for t in texts(300, 1000)] + ["{broken"])
    report = check_dataset(staged(tmp_path, "jsonl"), DataExpectations(sample_rows=200), format="jsonl")
    assert report.documents == 200  # 100 from each file


@pytest.mark.parametrize(
    ("fmt", "rows", "expect", "words"),
    [
        (
            "jsonl",
            [{"text": "a" * 50}, {"text": None}, {"other": 1}],
            {},
            "'text' present and not null (dataset.text_column): docs.jsonl:line 23, docs.jsonl:line 24",
        ),
        (
            "parquet",
            {"text": ["a" * 50, None, "b" * 50]},
            {},
            "'text' present and not null (dataset.text_column): docs.parquet:row 21",
        ),
        (
            "jsonl",
            [{"text": "hi"}],
            {"min_chars": 10},
            "text length between 10 and 1000000 characters"
            " (expectations.min_chars/max_chars): docs.jsonl:line 22 (2 chars)",
        ),
        (
            "parquet",
            {"text": ["x" * 5000]},
            {"max_chars": 4096},
            "text length between 1 and 4096 characters"
            " (expectations.min_chars/max_chars): docs.parquet:row 20 (5000 chars)",
        ),
        (
            "jsonl",
            [{"text": "same text"}] * 20,
            {"max_duplicate_ratio": 0.05},
            "duplicate texts at most 5% of those sampled (expectations.max_duplicate_ratio): 42.2% of the sampled"
            " texts repeat an earlier one",
        ),  # 45 texts, 26 distinct
        ("jsonl", ['{"text": "unterminated'], {}, "files readable: docs.jsonl: line 22: not JSON"),
        ("jsonl", ['["a", "list"]'], {}, "files readable: docs.jsonl: line 22: a list, expected a JSON object"),
        ("jsonl", [{"text": 42}], {}, "files readable: docs.jsonl: line 22: 'text' is a number, expected a string"),
        (
            "parquet",
            {"body": ["x"]},
            {},
            "files readable: docs.parquet: no column 'text' (columns: body); set dataset.text_column",
        ),
        ("parquet", {"text": [1, 2]}, {}, "files readable: docs.parquet: column 'text' is int64, expected strings"),
    ],
    ids=[
        "jsonl_null_and_missing",
        "parquet_null",
        "too_short",
        "too_long",
        "too_many_duplicates",
        "malformed_line",
        "line_not_an_object",
        "text_not_a_string",
        "parquet_no_column",
        "parquet_not_text",
    ],
)
def test_each_text_expectation_fails_naming_the_document(
    tmp_path: Path, fmt: str, rows: Any, expect: dict[str, Any], words: str
) -> None:
    cold = tmp_path / "cold"
    base = texts(20)
    if fmt == "jsonl":
        # line 1 of 'docs.jsonl' is a blank line: skipped, yet counted, so line numbers match an editor's.
        write_jsonl(cold / "docs.jsonl", ["", *({"text": t} for t in base), *rows])
        write_jsonl(cold / "other.jsonl", [{"text": t} for t in texts(5, 500)])
    elif isinstance(rows.get("text", [None])[0], str):  # good rows 0..19 first, then the case's
        write_parquet(cold / "docs.parquet", {"text": base + rows["text"]})
    else:
        write_parquet(cold / "docs.parquet", rows)
    message = fails(staged(tmp_path, fmt), expect=DataExpectations(**expect), format=fmt)
    assert message.startswith(f"{fmt} files in {tmp_path / 'hot'} failed 1 of "), message
    assert words in message, message


def test_a_corrupt_parquet_file_and_a_corrupt_row_group_are_named(tmp_path: Path) -> None:
    cold = tmp_path / "cold"
    write_parquet(cold / "good.parquet", {"text": texts(100)})
    (cold / "zero.parquet").write_bytes(b"PAR1 this is not parquet at all PAR1")
    write_parquet(cold / "torn.parquet", {"text": texts(100, 100)}, row_group_size=50)
    data = bytearray((cold / "torn.parquet").read_bytes())
    data[200:400] = b"\xff" * 200  # inside row group 0's pages; the footer still reads
    (cold / "torn.parquet").write_bytes(bytes(data))
    message = fails(staged(tmp_path, "parquet"), expect=DataExpectations(), format="parquet")
    assert "files readable: torn.parquet: row group 0: unreadable (" in message, message
    assert "zero.parquet: not a readable Parquet file (" in message, message
    assert "good.parquet" not in message


def test_an_empty_text_file_holds_no_documents(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "cold" / "a.jsonl", [{"text": t} for t in texts(10)])
    (tmp_path / "cold" / "b.jsonl").write_text("\n\n")
    message = fails(staged(tmp_path, "jsonl"), expect=DataExpectations(), format="jsonl")
    assert "documents per file at least 1: b.jsonl (no documents)" in message, message


# ---------------------------------------------------------------- the reference workload reads token arrays


def test_the_reference_workload_reads_token_arrays_as_one_stream(tmp_path: Path) -> None:
    from trainyard.workload.data import BatchPlan, TokenStream, micro_batches

    write_bin(tmp_path / "a.bin", np.arange(100) % 50, "uint32")
    np.save(tmp_path / "b.npy", np.arange(100, 160, dtype=np.uint32) % 50)
    (tmp_path / "meta.pkl").write_bytes(b"\x80\x04never read")
    stream = TokenStream.open(tmp_path, "uint32")
    assert (len(stream), stream.vocab_size) == (160, None)
    assert stream.window(95, 10).tolist() == [45, 46, 47, 48, 49, 0, 1, 2, 3, 4]  # across a.bin -> b.npy
    plan = BatchPlan(global_batch=4, micro_batch=2, world_size=1, rank=0)
    stream.id_limit = 50
    assert len(micro_batches(stream, plan, step=1, seed=0, seq_len=8)) == 2
    stream.id_limit = 40  # the model's --vocab-size is smaller than the data's ids
    with pytest.raises(DataError, match=r"step 1: token id 4\d is not below the model's --vocab-size 40"):
        micro_batches(stream, plan, step=1, seed=0, seq_len=8)
    (tmp_path / "a.bin").write_bytes(b"\0" * 400 + b"\1")
    with pytest.raises(DataError, match=r"token array .*a\.bin: size 401 bytes is not a multiple of 4 \(uint32"):
        TokenStream.open(tmp_path, "uint32")
