"""The one way a test waits for something to become true: poll it, with a bound, and fail naming what it waited for.

A test never asserts how long something took (a shared 2-core machine makes any such figure a coin toss, and
speed is ``bench/``'s to measure); what it times is a bound it waits for. A wait that runs out fails the test
with ``what`` and, where given, ``context()`` (a log's tail, say). This is the only sleep the tests' polling
needs: elsewhere a test sleeps only inside a real process it started.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class WaitedTooLong(AssertionError):
    """A bounded wait ran out: what it waited for never became true."""


def wait_for(
    predicate: Callable[[], T],
    timeout_s: float,
    what: str,
    every_s: float = 0.05,
    context: Callable[[], str] | None = None,
) -> T:
    """``predicate()``'s first truthy answer, asked every ``every_s`` for up to ``timeout_s`` (asked once more at
    the bound, so a slow last poll still counts); ``WaitedTooLong`` naming ``what`` if it never gave one.

    ``predicate`` may itself fail the test (an ``assert`` that a process it waits on still runs, say)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if result := predicate():
            return result
        if time.monotonic() >= deadline:
            detail = f"\n{context()}" if context is not None else ""
            raise WaitedTooLong(f"waited {timeout_s:g} s for {what}; it never came{detail}")
        time.sleep(min(every_s, max(0.0, deadline - time.monotonic())))
