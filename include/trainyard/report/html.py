"""Small HTML pieces every page of a run shares: times, numbers, state badges, tables, long text folded."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from trainyard.report.charts import esc


def when(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts)) + " UTC"


def num(value: Any, digits: int = 2) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def badge(state: Any) -> str:
    state = str(state or "unknown")
    return f'<span class="state {esc(state)}">{esc(state)}</span>'


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], cls: str = "") -> str:
    """``rows`` hold HTML already escaped by the caller."""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{cls}"><tr>{head}</tr>{body}</table>'


def long(text: Any, keep: int = 120) -> str:
    """Evidence and reasons can hold a traceback: the start inline, the rest on demand."""
    text = str(text or "")
    if len(text) <= keep:
        return esc(text)
    return f"<details><summary>{esc(text[:keep])}\u2026</summary><pre>{esc(text)}</pre></details>"
