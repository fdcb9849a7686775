"""The text formats' side of the data gate: staged Parquet or JSON Lines files as two tables and a suite.

This module owns reading text corpora as untrusted input, bounded: ``expectations.sample_rows``
documents in all, shared evenly among the files and taken from the start of each (a Parquet file a
row group at a time, reading only the text column; a JSON Lines file a line at a time, each line
at most ``MAX_LINE`` bytes), so memory stays bounded on a corpus of any size. It turns them into a
table of files (size, digest, documents read, the first problem that stopped the read: a corrupt
file, a missing or non-text column, a malformed line, naming its line or row group) and a table of
documents (length and digest of each sampled text, null where the text is null or missing), and
builds the document suite: non-null text, length within bounds, a duplicate ratio under the bar.
``quality.dataset`` runs both and words the failures.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainyard.atomic import loads_untrusted
from trainyard.quality.gx import Suite
from trainyard.spec import FORMAT_SUFFIXES, DataExpectations, DataFormat
from trainyard.storage.keys import key_path

if TYPE_CHECKING:
    import pandas as pd

# A JSON Lines line longer than this is refused, not read: it bounds one read however the file is made.
MAX_LINE = 64 << 20
FILE_COLUMNS = ("key", "size", "digest", "documents", "read_error")
DOC_COLUMNS = ("key", "chars", "digest")
# What reading one file yields per document: (where, characters, text digest); None for a null text.
Document = tuple[str, int | None, str | None]


class Unreadable(Exception):
    """Why a text file could not be read further; the message names the line or row group."""


def tables(
    hot_dir: Path, staged: dict[str, dict[str, Any]], fmt: DataFormat, column: str, sample_rows: int
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The staged files of ``fmt`` and the documents sampled from them, in key order."""
    import pandas as pd

    keys = sorted(k for k in staged if k.endswith(FORMAT_SUFFIXES[fmt]))
    share = max(1, sample_rows // max(len(keys), 1))
    files: list[dict[str, Any]] = []
    docs: list[dict[str, Any]] = []
    for key in keys:
        entry = staged[key]
        digest = entry.get("digest") or (f"sha256:{entry['sha256']}" if entry.get("sha256") else None)
        row: dict[str, Any] = {"key": key, "size": entry.get("size"), "digest": digest}
        read = _jsonl if fmt == "jsonl" else _parquet
        before = len(docs)
        try:
            for where, chars, digest in read(key_path(hot_dir, key), column, share):
                docs.append({"key": f"{key}:{where}", "chars": chars, "digest": digest})
        except Unreadable as exc:
            row["read_error"] = str(exc)
        except OSError as exc:
            row["read_error"] = f"cannot read ({exc.strerror or exc})"
        # An unreadable file with nothing read breaks one expectation (readable), not "has documents" too.
        row["documents"] = (len(docs) - before) or (None if "read_error" in row else 0)
        files.append(row)
    file_table = pd.DataFrame(files, columns=list(FILE_COLUMNS)).astype({"size": "Int64", "documents": "Int64"})
    doc_table = pd.DataFrame(docs, columns=list(DOC_COLUMNS)).astype({"chars": "Int64", "digest": "object"})
    return file_table, doc_table


def _document(where: str, text: object, column: str) -> Document:
    if text is None:
        return where, None, None
    if not isinstance(text, str):
        raise Unreadable(f"{where}: {column!r} is {_json_type(text)}, expected a string")
    return where, len(text), hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def _jsonl(path: Path, column: str, limit: int) -> Iterator[Document]:
    """The first ``limit`` documents of a JSON Lines file; blank lines are skipped."""
    with path.open("rb") as fh:
        number, taken = 0, 0
        while taken < limit:
            line = fh.readline(MAX_LINE + 1)
            number += 1
            if not line:
                return
            if len(line) > MAX_LINE:
                raise Unreadable(f"line {number}: longer than {MAX_LINE >> 20} MiB")
            if not line.strip():
                continue
            try:
                item = loads_untrusted(line, f"line {number}")
            except ValueError as exc:  # nesting and encoding included: "line N is not JSON (why)"
                raise Unreadable(str(exc)[:160].replace(" is not JSON", ": not JSON", 1)) from None
            if not isinstance(item, dict):
                raise Unreadable(f"line {number}: {_json_type(item)}, expected a JSON object")
            yield _document(f"line {number}", item.get(column), column)
            taken += 1


def _parquet(path: Path, column: str, limit: int) -> Iterator[Document]:
    """The first ``limit`` documents of a Parquet file, one row group of the text column at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        schema = parquet.schema_arrow
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise Unreadable(f"not a readable Parquet file ({str(exc)[:160]})") from None
    if column not in schema.names:
        raise Unreadable(f"no column {column!r} (columns: {', '.join(schema.names[:20])}); set dataset.text_column")
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise Unreadable(f"column {column!r} is {kind}, expected strings")
    row, taken = 0, 0
    for group in range(parquet.num_row_groups):
        if taken >= limit:
            return
        try:
            texts = parquet.read_row_group(group, columns=[column]).column(0).slice(0, limit - taken).to_pylist()
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise Unreadable(f"row group {group}: unreadable ({str(exc)[:160]})") from None
        for text in texts:
            yield _document(f"row {row}", text, column)
            row, taken = row + 1, taken + 1
        row += parquet.metadata.row_group(group).num_rows - len(texts)


def _json_type(value: object) -> str:
    names = {bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "an object", str: "a string"}
    return names.get(type(value), type(value).__name__)


def document_suite(gx: Any, expect: DataExpectations, column: str, docs: pd.DataFrame) -> Suite:
    """Non-null text, length within bounds, duplicates under the bar; each named by its spec field."""
    suite = Suite(gx)
    suite.add(
        f"{column!r} present and not null (dataset.text_column)",
        "ExpectColumnValuesToNotBeNull",
        lambda row: str(row["key"]),
        column="chars",
    )
    bounds = f"at least {expect.min_chars}" if expect.max_chars is None else (
        f"between {expect.min_chars} and {expect.max_chars}"
    )  # fmt: skip
    suite.add(
        f"text length {bounds} characters (expectations.min_chars/max_chars)",
        "ExpectColumnValuesToBeBetween",
        lambda row: f"{row['key']} ({row['chars']} chars)",
        column="chars",
        min_value=expect.min_chars,
        max_value=expect.max_chars,
    )
    if docs["digest"].notna().any():  # with no text at all, the null check above says it all
        suite.add(
            f"duplicate texts at most {expect.max_duplicate_ratio:.0%} of those sampled"
            " (expectations.max_duplicate_ratio)",
            "ExpectColumnProportionOfUniqueValuesToBeBetween",
            None,
            column="digest",
            min_value=1 - expect.max_duplicate_ratio,
        )
    return suite
