"""What every bench shares so that none can rot (house rule 17): its ``--smoke`` flag, its one JSON line, bounded waits.

A bench prints one JSON line last (``emit``); ``make bench`` keeps it and ``tests/integration/test_benches.py``
runs every bench's ``--smoke`` size and fails when the line does not come. A wait that could last forever (a
heartbeat that is never written, a server that never listens) is a failed bench, not a hung one: ``wait_until``
gives up after its bound and ``main`` turns that into a one-line message and exit status 1, with no JSON line.
A folder, not ``bench/bounds.py``: every ``bench/*.py`` is a bench.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

SMOKE_HELP = "the smallest run that still exercises every path (CI runs it; its numbers mean nothing)"


class BenchTimeout(RuntimeError):
    """A bounded wait in a bench ran out: what it waited for never came."""


def add_smoke(parser: argparse.ArgumentParser, what: str = SMOKE_HELP) -> None:
    """``--smoke``: ``what`` says what the bench's smallest run leaves out, where it leaves something out."""
    parser.add_argument("--smoke", action="store_true", help=what)


def wait_until(check: Callable[[], T | None], timeout_s: float, what: str, every_s: float = 0.01) -> T:
    """``check()``'s first value that is not None (nor False), polled every ``every_s``; ``BenchTimeout`` naming
    ``what`` after ``timeout_s``: a bench measures what happens, so what never happens must end it."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value is not None and value is not False:
            return value
        if time.monotonic() >= deadline:
            raise BenchTimeout(f"{what}: not seen within {timeout_s:g} s")
        time.sleep(every_s)


def emit(result: dict[str, Any]) -> None:
    """The bench's one JSON line, last on stdout (``make bench`` keeps the last line)."""
    print(json.dumps(result), flush=True)


def main(run: Callable[[], None]) -> None:
    """Run a bench's ``main``; a bound that ran out ends it with status 1 and one line saying what never came."""
    try:
        run()
    except BenchTimeout as exc:
        print(f"bench failed: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
