"""``dataset.format`` and its fields: the default keeps every existing spec as it was; a field of another
format is named with its fix, never ignored."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainyard.spec import FORMAT_SUFFIXES, check_files, load_spec

BASE = """\
dataset: {{source: "file:///data/tokens", name: tokens{dataset}}}
nodes: {{count: 1}}
training: {{max_steps: 10, global_batch: 8, micro_batch: 2, checkpoint_every: 5{training}}}
"""
SCRIPT = ", entrypoint: train.py"


def write(tmp_path: Path, dataset: str = "", training: str = "") -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(BASE.format(dataset=dataset, training=training))
    return path


def test_the_default_is_the_tok_format_with_its_expectations(tmp_path: Path) -> None:
    ds = load_spec(write(tmp_path)).dataset
    assert (ds.format, ds.dtype, ds.text_column) == ("tok", None, "text")
    assert FORMAT_SUFFIXES[ds.format] == (".tok",)


@pytest.mark.parametrize(
    ("dataset", "training"),
    [
        (", format: numpy, dtype: uint16", ""),
        (", format: numpy, dtype: uint32", ", args: {data-dtype: uint32}"),
        (", format: numpy, dtype: uint32, expectations: {max_vocab: 50304, min_tokens_per_shard: 1024}", SCRIPT),
        (", format: parquet, text_column: content", SCRIPT),
        (", format: jsonl, expectations: {min_chars: 10, max_chars: null, max_duplicate_ratio: 0.0}", SCRIPT),
    ],
    ids=["npy_uint16", "npy_uint32_workload", "npy_vocab", "parquet_column", "jsonl_bounds"],
)
def test_valid_format_sections(tmp_path: Path, dataset: str, training: str) -> None:
    assert check_files([write(tmp_path, dataset, training)]) == []
    # A run pins the whole spec, every default written out (pipeline.run's spec.json); it loads as it was.
    pinned = tmp_path / "spec.json"
    pinned.write_text(load_spec(write(tmp_path, dataset, training)).model_dump_json())
    assert load_spec(pinned) == load_spec(write(tmp_path, dataset, training))


@pytest.mark.parametrize(
    ("dataset", "training", "expected"),
    [
        (", format: csv", "", "dataset.format: 'csv' is not allowed; expected 'tok', 'numpy', 'parquet' or 'jsonl'"),
        (", format: numpy", "", "dataset.dtype: required with dataset.format: numpy; write uint16 or uint32"),
        (", format: numpy, dtype: int64", "", "dataset.dtype: 'int64' is not allowed; expected 'uint16' or 'uint32'"),
        (", dtype: uint16", "", "dataset.dtype: only for dataset.format: numpy (this dataset is tok); remove it"),
        (", text_column: body", "", "dataset.text_column: only for text formats (parquet, jsonl; this dataset is tok)"),
        (", format: parquet, text_column: ''", SCRIPT, "dataset.text_column: string should have at least 1 character"),
        (
            ", format: jsonl, expectations: {max_vocab: 100}",
            SCRIPT,
            "dataset.expectations.max_vocab: only checked for token formats (tok, numpy); this dataset is jsonl",
        ),
        (
            ", format: numpy, dtype: uint16, expectations: {min_chars: 5}",
            "",
            "dataset.expectations.min_chars: only checked for text formats (parquet, jsonl); this dataset is numpy",
        ),
        (
            ", format: jsonl, expectations: {min_chars: 10, max_chars: 5}",
            SCRIPT,
            "dataset.expectations.max_chars: 5 must be >= min_chars (10)",
        ),
        (
            ", format: jsonl, expectations: {max_duplicate_ratio: 1.5}",
            SCRIPT,
            "dataset.expectations.max_duplicate_ratio: 1.5 is out of range; it should be less than or equal to 1",
        ),
        (
            ", format: parquet, expectations: {sample_rows: 0}",
            SCRIPT,
            "dataset.expectations.sample_rows: 0 is out of range",
        ),
        (
            ", format: parquet",
            "",
            "dataset.format: parquet is text, which trainyard.workload cannot train on (it reads token ids);"
            " set training.entrypoint to your script",
        ),
        (
            ", format: numpy, dtype: uint32",
            "",
            "training.args.data-dtype: 'uint16' but dataset.dtype is 'uint32'; trainyard.workload reads .bin files"
            " with --data-dtype (default uint16): set training.args.data-dtype: uint32",
        ),
    ],
    ids=[
        "unknown_format",
        "numpy_without_dtype",
        "numpy_bad_dtype",
        "dtype_for_tok",
        "text_column_for_tok",
        "empty_text_column",
        "token_expectation_for_text",
        "text_expectation_for_tokens",
        "chars_bounds_crossed",
        "ratio_out_of_range",
        "sample_rows_zero",
        "text_with_reference_workload",
        "workload_dtype_disagrees",
    ],
)
def test_format_mistakes_get_one_line_naming_field_and_fix(
    tmp_path: Path, dataset: str, training: str, expected: str
) -> None:
    path = write(tmp_path, dataset, training)
    problems = check_files([path])
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{path}: ") and expected in problems[0], problems


NPY = ", format: numpy, dtype: uint16"
SHA = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"


def test_dataset_files_name_what_the_script_reads_beside_its_shards(tmp_path: Path) -> None:
    files = f", files: [{{name: meta.pkl, sha256: {SHA}, size: 4}}, {{name: tok/vocab.json, required: false}}]"
    assert check_files([write(tmp_path, NPY + files)]) == []
    ds = load_spec(write(tmp_path, NPY + files)).dataset
    assert [(f.name, f.sha256, f.size, f.required) for f in ds.files] == [
        ("meta.pkl", SHA, 4, True),
        ("tok/vocab.json", None, None, False),
    ]
    assert load_spec(write(tmp_path)).dataset.files == []  # a spec without the field reads as before


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ("[{name: ../meta.pkl}]", "dataset.files[0].name: '../meta.pkl' is not a relative path inside the dataset"),
        ("[{name: /data/meta.pkl}]", "dataset.files[0].name: '/data/meta.pkl' is not a relative path inside the"),
        ("[{name: 'a//b'}]", "dataset.files[0].name: 'a//b' is not a relative path inside the dataset"),
        ("[{name: ''}]", "dataset.files[0].name: string should have at least 1 character"),
        ("[{name: m.pkl, sha256: ABC}]", "dataset.files[0].sha256: 'ABC' is not a sha256 digest: 64 lowercase hex"),
        ("[{name: m.pkl, size: -1}]", "dataset.files[0].size: -1 is out of range"),
        (
            "[{name: m.pkl, hash: x}]",
            "dataset.files[0].hash: unknown field; allowed here: name, required, sha256, size",
        ),
        (
            "[{name: meta.pkl}, {name: meta.pkl, required: false}]",
            "dataset.files[1].name: 'meta.pkl' is listed twice (first as dataset.files[0])",
        ),
        (
            "[{name: train.bin}]",
            "dataset.files[0].name: 'train.bin' is a shard of dataset.format numpy (its .bin/.npy files are staged"
            " and checked as shards already); remove it from dataset.files",
        ),
    ],
    ids=["dotdot", "absolute", "empty_part", "empty", "sha_shape", "negative_size", "unknown_field", "twice", "shard"],
)
def test_dataset_files_mistakes_name_the_item_and_the_fix(tmp_path: Path, files: str, expected: str) -> None:
    path = write(tmp_path, f"{NPY}, files: {files}")
    problems = check_files([path])
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{path}: ") and expected in problems[0], problems
