"""The dataset gate: great-expectations over the real staged manifest, one failure per expectation.

GX takes seconds to import once per process; each check after that takes tens
of milliseconds, so every case builds and stages its own small dataset.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trainyard.errors import DataError
from trainyard.protocol.shards import write_shard
from trainyard.quality.dataset import RESULT_FILE, check_dataset
from trainyard.spec import DataExpectations
from trainyard.storage import LocalTier
from trainyard.storage.staging import stage

GOOD = [(2048, 256)] * 4  # (tokens, vocab_size) per shard


def make_dataset(root: Path, shards: list[tuple[int, int]], duplicate: bool = False) -> Path:
    """Write shards ``shard_0000.tok``... with distinct content (unless ``duplicate``) and stage them."""
    src, hot = root / "cold", root / "hot"
    for i, (tokens, vocab) in enumerate(shards):
        offset = 0 if duplicate else i
        write_shard(src / f"shard_{i:04d}.tok", (np.arange(tokens) + offset) % vocab, vocab)
    stage(LocalTier(src), hot)
    return hot


def failure(root: Path, shards: list[tuple[int, int]], **expect: Any) -> str:
    hot = make_dataset(root, shards, duplicate=expect.pop("duplicate", False))
    with pytest.raises(DataError) as err:
        check_dataset(hot, DataExpectations(**expect), result_dir=root / "run")
    return str(err.value)


def test_passing_dataset_reports_and_saves_the_result(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    hot = make_dataset(tmp_path, GOOD)
    expect = DataExpectations(min_shards=2, max_shards=8, min_tokens_per_shard=1024, max_vocab=256, dtypes=["uint16"])
    with caplog.at_level(logging.INFO):
        report = check_dataset(hot, expect, result_dir=tmp_path / "run")
    assert (report.shards, report.non_empty, report.tokens, report.vocab_size) == (4, 4, 4 * 2048, 256)
    assert report.expectations == 6
    saved = json.loads((tmp_path / "run" / RESULT_FILE).read_text())
    assert saved["success"] is True and saved["statistics"]["evaluated_expectations"] == 6
    assert report.result == str(tmp_path / "run" / RESULT_FILE)
    # GX draws tqdm bars ("Calculating Metrics: ...") on stderr unless they are turned off.
    assert "Calculating Metrics" not in capfd.readouterr().err
    # Task logs run at INFO; GX's own INFO lines (one per context) are noise there.
    assert [r.getMessage() for r in caplog.records if r.name.startswith("great_expectations")] == []


def test_without_result_dir_nothing_is_saved(tmp_path: Path) -> None:
    report = check_dataset(make_dataset(tmp_path, GOOD), DataExpectations())
    assert report.result is None and report.expectations == 5  # no max_vocab: one check fewer
    assert not list(tmp_path.rglob(RESULT_FILE))


@pytest.mark.parametrize(
    ("shards", "expect", "words", "culprit"),
    [
        (GOOD[:1], {"min_shards": 2}, "shard count at least 2", "1 shard(s) staged"),
        (GOOD, {"max_shards": 3}, "shard count between 1 and 3", "4 shard(s) staged"),
        (
            [*GOOD[:3], (12, 256)],
            {"min_tokens_per_shard": 1024},
            "tokens per shard at least 1024",
            "shard_0003.tok (12 tokens)",
        ),
        (
            [(9000, 256), *GOOD[1:]],
            {"max_tokens_per_shard": 4096},
            "tokens per shard between 1 and 4096",
            "shard_0000.tok (9000 tokens)",
        ),
        ([*GOOD[:2], (2048, 1000)], {"max_vocab": 256}, "vocab_size at most 256", "shard_0002.tok (vocab_size 1000)"),
        ([*GOOD[:1], (2048, 70_000)], {"dtypes": ["uint16"]}, "token dtype one of uint16", "shard_0001.tok (uint32)"),
    ],
    ids=["too_few_shards", "too_many_shards", "tokens_below_min", "tokens_above_max", "vocab_above_max", "wrong_dtype"],
)
def test_each_failed_expectation_is_named_with_its_shards(
    tmp_path: Path, shards: list[tuple[int, int]], expect: dict[str, Any], words: str, culprit: str
) -> None:
    message = failure(tmp_path, shards, **expect)
    assert message.startswith(f"shards in {tmp_path / 'hot'} failed 1 of ")
    assert f"{words} (expectations." in message and culprit in message


def test_duplicate_content_names_both_shards(tmp_path: Path) -> None:
    message = failure(tmp_path, GOOD[:3], duplicate=True)
    assert "shard contents unique by digest (expectations.unique_shards)" in message
    # A local copy's digest is xxh3-128 (no sha256 in its manifest entry): duplicates are still found.
    assert all(f"shard_000{i}.tok (xxh3-128:" in message for i in range(3))
    # The same data may repeat when the spec says so.
    assert check_dataset(tmp_path / "hot", DataExpectations(unique_shards=False)).shards == 3


def test_corrupt_header_fails_through_the_suite_with_the_others(tmp_path: Path) -> None:
    src = tmp_path / "cold"
    src.mkdir()
    (src / "shard_0000.tok").write_bytes(b"not a shard at all")
    write_shard(src / "shard_0001.tok", np.arange(5), 256)
    stage(LocalTier(src), tmp_path / "hot")
    with pytest.raises(DataError) as err:
        check_dataset(tmp_path / "hot", DataExpectations(min_tokens_per_shard=100))
    message = str(err.value)
    assert "failed 2 of 5" in message
    assert "shard headers readable: shard_0000.tok: truncated header (18 of 20 bytes)" in message
    assert "tokens per shard at least 100" in message and "shard_0001.tok (5 tokens)" in message
    assert "shard_0000.tok (" not in message  # a corrupt shard breaks one expectation, not every column's


def test_failure_saves_the_result_and_names_its_path(tmp_path: Path) -> None:
    message = failure(tmp_path, [(12, 256)] * 13, min_tokens_per_shard=1024)
    path = tmp_path / "run" / RESULT_FILE
    assert message.endswith(f"(full result: {path})")
    assert "shard_0009.tok (12 tokens) and 3 more" in message and "shard_0010.tok" not in message
    saved = json.loads(path.read_text())
    assert saved["success"] is False
    failed = [r for r in saved["results"] if not r["success"]]
    assert [r["expectation_config"]["type"] for r in failed] == ["expect_column_values_to_be_between"]
    assert failed[0]["result"]["unexpected_count"] == 13


def test_no_staged_shards_points_at_staging(tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    hot.mkdir()
    with pytest.raises(
        DataError, match=r"shard count at least 1 .*: 0 shard\(s\) staged \(no \*\.tok keys in .*_staged\.json"
    ):
        check_dataset(hot, DataExpectations())


def test_importing_the_gate_does_not_import_great_expectations() -> None:
    # DAG files import this module indirectly; GX and pandas cost seconds to import.
    code = "import sys, trainyard.quality.dataset; print(sorted({'great_expectations', 'pandas'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
