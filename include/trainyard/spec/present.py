"""How ``trainyard check`` prints its reports: text lines for a person, one JSON document for a program.

Text: one ``FILE: field.path: message`` line per error, then ``FILE: warning:
field.path: message`` per warning, then a count. JSON: a list with a row per
file, ``{file, ok, errors: [{field, message}], warnings: [{field, message}]}``.
Either way the exit code is 1 when any file has an error; warnings never change it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from trainyard.spec.review import FileReport, Finding

FORMATS = ("text", "json")


def exit_code(reports: Sequence[FileReport]) -> int:
    return 0 if all(r.ok for r in reports) else 1


def as_text(reports: Sequence[FileReport]) -> str:
    lines = [f"{r.file}: {_line(f)}" for r in reports for f in r.errors]
    lines += [f"{r.file}: warning: {_line(f)}" for r in reports for f in r.warnings]
    if all(r.ok for r in reports):
        lines.append(f"{len(reports)} spec(s) valid")
    return "\n".join(lines)


def as_json(reports: Sequence[FileReport]) -> str:
    return json.dumps([_row(r) for r in reports], indent=2)


def _row(report: FileReport) -> dict[str, Any]:
    return {
        "file": str(report.file),
        "ok": report.ok,
        "errors": [asdict(f) for f in report.errors],
        "warnings": [asdict(f) for f in report.warnings],
    }


def _line(f: Finding) -> str:
    return f"{f.field}: {f.message}" if f.field else f.message


def render(reports: Sequence[FileReport], output: str) -> str:
    """The reports in ``output`` (one of ``FORMATS``)."""
    return as_json(reports) if output == "json" else as_text(reports)
