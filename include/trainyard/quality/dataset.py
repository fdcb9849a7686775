"""The dataset gate: the staged shards meet the spec's data expectations, checked by great-expectations.

This module owns turning a staged dataset into a table (one row per staged
``*.tok`` shard: manifest size and digest, header tokens, vocab_size and
dtype), turning ``DataExpectations`` into a great-expectations suite over that
table, and turning GX's validation result into a ``DataError`` that names each
failed expectation and its shards in plain words.

GX is called directly (see ``trainyard.quality.gx``); GX and pandas take
seconds to import, and DAG files import this module indirectly, so both are
imported inside ``check_dataset`` only.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainyard.atomic import write_json_atomic
from trainyard.errors import DataError
from trainyard.protocol.shards import SHARD_SUFFIX, read_header
from trainyard.quality.gx import Check, Suite, could_not_run, import_gx
from trainyard.spec import DataExpectations
from trainyard.storage.hot import STAGED_MANIFEST
from trainyard.storage.keys import key_path
from trainyard.storage.staged import read_staged

if TYPE_CHECKING:
    import pandas as pd

log = logging.getLogger(__name__)

RESULT_FILE = "data_quality.json"
# How many offending shards an error names per expectation; the JSON result counts them all.
SHOWN = 10
# One column per fact the suite checks; ``header_error`` is None for a readable header.
COLUMNS = ("key", "size", "digest", "tokens", "vocab_size", "dtype", "header_error")


@dataclass(frozen=True)
class DatasetReport:
    shards: int
    non_empty: int
    tokens: int
    vocab_size: int
    expectations: int
    """How many expectations great-expectations evaluated (all passed)."""
    seconds: float
    """Wall time of the check, GX import included (the bulk of it on a cold process)."""
    result: str | None
    """Where the GX validation result was saved, if anywhere."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_dataset(hot_dir: Path, expect: DataExpectations, result_dir: Path | None = None) -> DatasetReport:
    """Validate the staged shards of ``hot_dir`` against ``expect`` with great-expectations.

    Raise ``DataError`` naming each failed expectation and up to ten offending
    shards. With ``result_dir``, the GX validation result is saved to
    ``result_dir / "data_quality.json"`` whether the check passes or fails.
    """
    started = time.monotonic()
    table = shard_table(hot_dir)
    suite = _suite(expect)
    result = suite.validate(table, "staged_shards", "key", SHOWN)
    result_path = None
    if result_dir is not None:
        result_path = Path(result_dir) / RESULT_FILE
        write_json_atomic(result_path, result)
    if not result["success"]:
        raise DataError(_failure_message(hot_dir, table, suite, result, result_path))
    seconds = round(time.monotonic() - started, 3)
    log.info("data quality: %d shards passed %d expectations in %.2f s", len(table), len(suite.checks), seconds)
    return DatasetReport(
        shards=len(table),
        non_empty=int((table["tokens"] > 0).sum()),
        tokens=int(table["tokens"].sum()),
        vocab_size=int(table["vocab_size"].max()),
        expectations=len(suite.checks),
        seconds=seconds,
        result=str(result_path) if result_path else None,
    )


def shard_table(hot_dir: Path) -> pd.DataFrame:
    """One row per staged ``*.tok`` key, in key order; an unreadable header is a row with ``header_error``.

    An unreadable shard becomes a row rather than an immediate error so that it
    fails through the same suite, report and saved result as every other
    problem, alongside any others the dataset has.
    """
    import pandas as pd

    staged = read_staged(hot_dir)
    rows = [_shard_row(hot_dir, key, staged[key]) for key in sorted(staged) if key.endswith(SHARD_SUFFIX)]
    table = pd.DataFrame(rows, columns=list(COLUMNS))
    # Nullable integers: a corrupt shard's missing counts must not turn every count into a float.
    return table.astype({"size": "Int64", "tokens": "Int64", "vocab_size": "Int64"})


def _shard_row(hot_dir: Path, key: str, entry: dict[str, Any]) -> dict[str, Any]:
    # "digest" ("xxh3-128:...", "sha256:...", ...); manifests staged before it had only "sha256".
    digest = entry.get("digest") or (f"sha256:{entry['sha256']}" if entry.get("sha256") else None)
    row: dict[str, Any] = {"key": key, "size": entry.get("size"), "digest": digest}
    try:
        path = key_path(hot_dir, key)
        header = read_header(path)
    except DataError as exc:
        # read_header says "shard <full path>: <what is wrong>"; the key already names the shard.
        row["header_error"] = str(exc).removeprefix(f"shard {hot_dir / key}: ")
        return row
    row.update(tokens=header.tokens, vocab_size=header.vocab_size, dtype=header.dtype.name)
    return row


def _suite(expect: DataExpectations) -> Suite:
    """The suite for ``expect``, each expectation named by the spec field a user would change."""
    suite = Suite(import_gx())
    add = suite.add
    add(
        "shard headers readable",
        "ExpectColumnValuesToBeNull",
        lambda row: f"{row['key']}: {row['header_error']}",
        column="header_error",
    )
    add(
        f"shard count {_bounds(expect.min_shards, expect.max_shards)} (expectations.min_shards/max_shards)",
        "ExpectTableRowCountToBeBetween",
        None,
        min_value=expect.min_shards,
        max_value=expect.max_shards,
    )
    add(
        f"tokens per shard {_bounds(expect.min_tokens_per_shard, expect.max_tokens_per_shard)}"
        " (expectations.min_tokens_per_shard/max_tokens_per_shard)",
        "ExpectColumnValuesToBeBetween",
        lambda row: f"{row['key']} ({row['tokens']} tokens)",
        column="tokens",
        min_value=expect.min_tokens_per_shard,
        max_value=expect.max_tokens_per_shard,
    )
    add(
        f"token dtype one of {', '.join(expect.dtypes) or '(none)'} (expectations.dtypes)",
        "ExpectColumnValuesToBeInSet",
        lambda row: f"{row['key']} ({row['dtype']})",
        column="dtype",
        value_set=list(expect.dtypes),
    )
    if expect.max_vocab is not None:
        add(
            f"vocab_size at most {expect.max_vocab} (expectations.max_vocab)",
            "ExpectColumnValuesToBeBetween",
            lambda row: f"{row['key']} (vocab_size {row['vocab_size']})",
            column="vocab_size",
            max_value=expect.max_vocab,
        )
    if expect.unique_shards:
        add(
            "shard contents unique by digest (expectations.unique_shards)",
            "ExpectColumnValuesToBeUnique",
            lambda row: f"{row['key']} ({str(row['digest'])[:21]})",
            column="digest",
        )
    return suite


def _bounds(low: int, high: int | None) -> str:
    return f"at least {low}" if high is None else f"between {low} and {high}"


def _failure_message(
    hot_dir: Path, table: pd.DataFrame, suite: Suite, result: dict[str, Any], result_path: Path | None
) -> str:
    failed = suite.failed(result)
    rows = {row["key"]: row for row in table.astype(object).where(table.notna(), None).to_dict("records")}
    problems = [_problem(check, outcome, rows, hot_dir) for check, outcome in failed]
    # "shards ..." also keeps "DataError: shard..." greppable in task logs, as the other shard errors read.
    message = f"shards in {hot_dir} failed {len(failed)} of {len(suite.checks)} data expectations: " + "; ".join(
        problems
    )
    if result_path is not None:
        message += f" (full result: {result_path})"
    return message


def _problem(check: Check, outcome: dict[str, Any], rows: dict[str, dict[str, Any]], hot_dir: Path) -> str:
    """One failed expectation in plain words, with the shards that broke it."""
    if (reason := could_not_run(outcome)) is not None:
        return f"{check.name}: could not be evaluated ({reason})"
    found = outcome["result"]
    if check.detail is None:  # the shard count
        observed = found["observed_value"]
        hint = (
            f" (no *{SHARD_SUFFIX} keys in {hot_dir / STAGED_MANIFEST}; did stage_dataset run?)" if not observed else ""
        )
        return f"{check.name}: {observed} shard(s) staged{hint}"
    keys = [item["key"] for item in found.get("partial_unexpected_index_list", [])]
    details = [check.detail(rows[key]) for key in keys[:SHOWN]]
    more = found.get("unexpected_count", len(keys)) - len(details)
    return f"{check.name}: " + ", ".join(details) + (f" and {more} more" if more > 0 else "")
