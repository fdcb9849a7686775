"""Each stage's start, end (with seconds and result) or failure in the run's ledger."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from trainyard.pipeline.run import Run


def recorded(name: str) -> Callable[[Callable[..., dict[str, Any]]], Callable[..., dict[str, Any]]]:
    """Record the stage's start, end (with seconds and result) or failure in the run's ledger."""

    def wrap(fn: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
        def run_stage(run: Run, *args: Any, **kwargs: Any) -> dict[str, Any]:
            started = time.monotonic()
            run.ledger.append(name, "stage_start")
            try:
                result = fn(run, *args, **kwargs)
            except Exception as exc:
                stage_failed(run, name, exc, time.monotonic() - started)
                raise
            run.ledger.append(name, "stage_end", seconds=round(time.monotonic() - started, 3), result=result)
            return result

        run_stage.__name__ = fn.__name__
        run_stage.__doc__ = fn.__doc__
        return run_stage

    return wrap


def stage_failed(run: Run, name: str, exc: Exception, seconds: float) -> None:
    run.ledger.append(
        name, "stage_failed", error=type(exc).__name__, message=str(exc)[:2000], seconds=round(seconds, 3)
    )
