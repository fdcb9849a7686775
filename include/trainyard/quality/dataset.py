"""The dataset gate: the staged files meet the spec's data expectations, checked by great-expectations.

This module owns turning a staged dataset into tables, turning ``DataExpectations`` into
great-expectations suites over them, and turning GX's validation results into one ``DataError``
that names each failed expectation and its files in plain words. Per ``dataset.format``:

- ``tok``: one row per staged ``*.tok`` shard (manifest size and digest, header tokens,
  vocab_size and dtype);
- ``numpy``: one row per ``.bin``/``.npy`` token array (its layout checked against its size, its
  largest token id found by a bounded scan: ``protocol.arrays``);
- ``parquet``/``jsonl``: a table of files and a table of sampled documents (``quality.text``).

Beside the shards, the files ``dataset.files`` names (a vocabulary, a tokenizer) are checked by size and
sha256 as staged (``storage.datafiles``; never opened as data, never unpickled): a required one missing
or not as the spec says fails the gate with the rest; an optional one missing is a warning in the result.

GX is called directly (see ``trainyard.quality.gx``); GX and pandas take
seconds to import, and DAG files import this module indirectly, so both are
imported inside ``check_dataset`` only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainyard.atomic import write_json_atomic
from trainyard.errors import DataError
from trainyard.protocol.arrays import ArrayError, read_array, scan_tokens
from trainyard.protocol.shards import SHARD_SUFFIX, read_header
from trainyard.quality import text
from trainyard.quality.gx import Check, Suite, could_not_run, import_gx
from trainyard.quality.results import DataCheckResult
from trainyard.spec import FORMAT_SUFFIXES, DataExpectations, DataFile, DataFormat, TokenDtype
from trainyard.storage.datafiles import check_staged
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
# A token array has no vocab_size: its largest id stands for it; ``read_error`` is None for a readable one.
ARRAY_COLUMNS = ("key", "size", "digest", "tokens", "max_token", "dtype", "read_error")


def check_dataset(
    hot_dir: Path,
    expect: DataExpectations,
    result_dir: Path | None = None,
    *,
    format: DataFormat = "tok",
    dtype: TokenDtype | None = None,
    text_column: str = "text",
    files: Sequence[DataFile] = (),
    warnings: Sequence[str] = (),
) -> DataCheckResult:
    """Validate the staged files of ``hot_dir`` against ``expect`` with great-expectations.

    ``format`` is ``dataset.format``; ``dtype`` (a ``numpy`` dataset's) and ``text_column`` (a text
    one's) come from the spec beside it. Raise ``DataError`` naming each failed expectation and up
    to ten offending files (or documents). With ``result_dir``, the GX validation result is saved to
    ``result_dir / "data_quality.json"`` whether the check passes or fails (a text format's holds
    two: ``files`` and ``documents``). ``files`` (``dataset.files``) are checked beside the shards; ``warnings``
    (staging's) are carried into the result with the check's own.
    """
    started = time.monotonic()
    extra = check_staged(hot_dir, files, read_staged(hot_dir))
    gx = import_gx()
    if format in ("parquet", "jsonl"):
        files, docs = text.tables(hot_dir, read_staged(hot_dir), format, text_column, expect.sample_rows)
        parts = [
            ("files", files, _suite(gx, expect, "text")),
            ("documents", docs, text.document_suite(gx, expect, text_column, docs)),
        ]
    elif format == "numpy":
        assert dtype is not None, "the spec requires dataset.dtype with format numpy"
        parts = [("files", array_table(hot_dir, dtype), _suite(gx, expect, "numpy"))]
    else:
        parts = [("staged_shards", shard_table(hot_dir), _suite(gx, expect, "tok"))]
    results = [suite.validate(table, name, "key", SHOWN) for name, table, suite in parts]
    saved = results[0] if len(results) == 1 else {
        "success": all(r["success"] for r in results), **{name: r for (name, _, _), r in zip(parts, results)}
    }  # fmt: skip
    result_path = None
    if result_dir is not None:
        result_path = Path(result_dir) / RESULT_FILE
        write_json_atomic(result_path, saved)
    if not all(r["success"] for r in results):
        raise DataError("; ".join([_failure_message(hot_dir, format, parts, results, result_path), *extra.problems]))
    if extra.problems:
        raise DataError(f"dataset.files in {hot_dir}: " + "; ".join(extra.problems))
    for warning in extra.warnings:
        log.warning("data quality: %s", warning)
    seconds = round(time.monotonic() - started, 3)
    table, checks = parts[0][1], sum(len(suite.checks) for _, _, suite in parts)
    log.info("data quality: %d %s files passed %d expectations in %.2f s", len(table), format, checks, seconds)
    tokens = table["tokens"] if "tokens" in table else None
    vocab = table["vocab_size"] if "vocab_size" in table else table["max_token"] + 1 if "max_token" in table else None
    return DataCheckResult(
        shards=len(table),
        non_empty=int(((tokens if tokens is not None else table["documents"]) > 0).sum()),
        tokens=int(tokens.sum()) if tokens is not None else 0,
        vocab_size=int(vocab.max()) if vocab is not None and len(vocab) else 0,
        expectations=checks,
        seconds=seconds,
        result=str(result_path) if result_path else None,
        format=format,
        documents=len(parts[1][1]) if len(parts) > 1 else 0,
        extra_files=extra.verified,
        warnings=[*warnings, *extra.warnings],
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


def array_table(hot_dir: Path, dtype: TokenDtype) -> pd.DataFrame:
    """One row per staged ``.bin``/``.npy`` key, in key order; an unreadable array is a row with ``read_error``.

    Each array's token ids are scanned in bounded chunks for the largest one (the vocabulary check):
    the gate reads every byte of the dataset once, and its memory stays one chunk.
    """
    import pandas as pd

    staged = read_staged(hot_dir)
    rows = []
    for key in sorted(k for k in staged if k.endswith(FORMAT_SUFFIXES["numpy"])):
        row: dict[str, Any] = {"key": key, "size": staged[key].get("size"), "digest": _digest(staged[key])}
        try:
            path = key_path(hot_dir, key)
            array = read_array(path, dtype)
            row.update(tokens=array.tokens, dtype=array.dtype_name, max_token=scan_tokens(path, array))
        except ArrayError as exc:
            row.update(read_error=str(exc), tokens=None, max_token=None)
        except OSError as exc:
            row.update(read_error=f"cannot read ({exc.strerror or exc})", tokens=None, max_token=None)
        rows.append(row)
    table = pd.DataFrame(rows, columns=list(ARRAY_COLUMNS))
    return table.astype({"size": "Int64", "tokens": "Int64", "max_token": "Int64"})


def _digest(entry: dict[str, Any]) -> str | None:
    # "digest" ("xxh3-128:...", "sha256:...", ...); manifests staged before it had only "sha256".
    return entry.get("digest") or (f"sha256:{entry['sha256']}" if entry.get("sha256") else None)


def _shard_row(hot_dir: Path, key: str, entry: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"key": key, "size": entry.get("size"), "digest": _digest(entry)}
    try:
        path = key_path(hot_dir, key)
        header = read_header(path)
    except DataError as exc:
        # read_header says "shard <full path>: <what is wrong>"; the key already names the shard.
        row["header_error"] = str(exc).removeprefix(f"shard {hot_dir / key}: ")
        return row
    row.update(tokens=header.tokens, vocab_size=header.vocab_size, dtype=header.dtype.name)
    return row


def _suite(gx: Any, expect: DataExpectations, kind: str) -> Suite:
    """The file suite of a ``tok``, ``numpy`` or ``text`` dataset, each expectation named by its spec field."""
    suite = Suite(gx)
    add = suite.add
    files = "shard" if kind == "tok" else "file"
    if kind == "tok":
        add(
            "shard headers readable",
            "ExpectColumnValuesToBeNull",
            lambda row: f"{row['key']}: {row['header_error']}",
            column="header_error",
        )
    else:
        add(
            "files readable",
            "ExpectColumnValuesToBeNull",
            lambda r: f"{r['key']}: {r['read_error']}",
            column="read_error",
        )
    add(
        f"{files} count {_bounds(expect.min_shards, expect.max_shards)} (expectations.min_shards/max_shards)",
        "ExpectTableRowCountToBeBetween",
        None,
        min_value=expect.min_shards,
        max_value=expect.max_shards,
    )
    if kind == "text":
        add(
            "documents per file at least 1",
            "ExpectColumnValuesToBeBetween",
            lambda row: f"{row['key']} (no documents)",
            column="documents",
            min_value=1,
        )
    else:
        _token_checks(add, expect, files, kind)
    if expect.unique_shards:
        add(
            f"{files} contents unique by digest (expectations.unique_shards)",
            "ExpectColumnValuesToBeUnique",
            lambda row: f"{row['key']} ({str(row['digest'])[:21]})",
            column="digest",
        )
    return suite


def _token_checks(add: Any, expect: DataExpectations, files: str, kind: str) -> None:
    add(
        f"tokens per {files} {_bounds(expect.min_tokens_per_shard, expect.max_tokens_per_shard)}"
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
    if expect.max_vocab is None:
        return
    if kind == "tok":
        add(
            f"vocab_size at most {expect.max_vocab} (expectations.max_vocab)",
            "ExpectColumnValuesToBeBetween",
            lambda row: f"{row['key']} (vocab_size {row['vocab_size']})",
            column="vocab_size",
            max_value=expect.max_vocab,
        )
    else:  # no header declares a vocabulary: every token id must fit the model's embedding
        add(
            f"token ids below {expect.max_vocab} (expectations.max_vocab)",
            "ExpectColumnValuesToBeBetween",
            lambda row: f"{row['key']} (largest id {row['max_token']})",
            column="max_token",
            max_value=expect.max_vocab - 1,
        )


def _bounds(low: int, high: int | None) -> str:
    return f"at least {low}" if high is None else f"between {low} and {high}"


def _failure_message(
    hot_dir: Path,
    format: str,
    parts: list[tuple[str, pd.DataFrame, Suite]],
    results: list[dict[str, Any]],
    result_path: Path | None,
) -> str:
    problems, total, failed_count = [], 0, 0
    for (_, table, suite), result in zip(parts, results):
        failed = suite.failed(result)
        rows = {row["key"]: row for row in table.astype(object).where(table.notna(), None).to_dict("records")}
        problems += [_problem(check, outcome, rows, hot_dir, format) for check, outcome in failed]
        total, failed_count = total + len(suite.checks), failed_count + len(failed)
    # "shards ..." also keeps "DataError: shard..." greppable in task logs, as the other shard errors read.
    what = "shards" if format == "tok" else f"{format} files"
    message = f"{what} in {hot_dir} failed {failed_count} of {total} data expectations: " + "; ".join(problems)
    if result_path is not None:
        message += f" (full result: {result_path})"
    return message


def _problem(check: Check, outcome: dict[str, Any], rows: dict[str, dict[str, Any]], hot_dir: Path, format: str) -> str:
    """One failed expectation in plain words, with the files (or documents) that broke it."""
    if (reason := could_not_run(outcome)) is not None:
        return f"{check.name}: could not be evaluated ({reason})"
    found = outcome["result"]
    if check.detail is None:  # a table-level check: the file count, the duplicate ratio
        observed = found["observed_value"]
        if check.expectation.__class__.__name__ == "ExpectColumnProportionOfUniqueValuesToBeBetween":
            return f"{check.name}: {1 - observed:.1%} of the sampled texts repeat an earlier one"
        suffixes = "/".join(f"*{s}" for s in FORMAT_SUFFIXES[format])  # type: ignore[index]
        hint = f" (no {suffixes} keys in {hot_dir / STAGED_MANIFEST}; did stage_dataset run?)" if not observed else ""
        return f"{check.name}: {observed} {'shard' if format == 'tok' else 'file'}(s) staged{hint}"
    keys = [item["key"] for item in found.get("partial_unexpected_index_list", [])]
    details = [check.detail(rows[key]) for key in keys[:SHOWN]]
    more = found.get("unexpected_count", len(keys)) - len(details)
    return f"{check.name}: " + ", ".join(details) + (f" and {more} more" if more > 0 else "")
