"""The one stage recorder: each stage's start, end (with seconds and result) or failure in the run's ledger.

Every stage records through ``StageRecorder``: the plain stages through the ``recorded`` decorator, the
train stage itself (``pipeline.train.TrainStage``), whose blocking and deferred drivers must write the
same events. A deferred train task runs in a new process at every wake, so its recorder is
``resumed`` from the ledger's ``stage_start`` instead of started.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any, Concatenate, ParamSpec, TypeVar

from trainyard.pipeline.results import StageResult
from trainyard.pipeline.run import Run

P = ParamSpec("P")
R = TypeVar("R", bound=StageResult)


class StageRecorder:
    """One stage of one run, as the ledger sees it."""

    def __init__(self, run: Run, name: str, elapsed: Callable[[], float]) -> None:
        self.run, self.name, self.elapsed = run, name, elapsed

    @classmethod
    def start(cls, run: Run, name: str) -> StageRecorder:
        """The stage starts now, in this process."""
        run.ledger.append(name, "stage_start")
        began = time.monotonic()
        return cls(run, name, lambda: time.monotonic() - began)

    @classmethod
    def resumed(cls, run: Run, name: str, began: float | None) -> StageRecorder:
        """The stage an earlier process started at ``began`` (epoch seconds, its ``stage_start``; None: unknown)."""
        return cls(run, name, lambda: time.time() - began if began is not None else 0.0)

    def note(self, event: str, **fields: Any) -> None:
        """An event of this stage between its start and its end."""
        self.run.ledger.append(self.name, event, **fields)

    def end(self, result: StageResult) -> None:
        self.run.ledger.append(self.name, "stage_end", seconds=self._seconds(), result=asdict(result))

    def failed(self, exc: Exception) -> None:
        self.run.ledger.append(
            self.name, "stage_failed", error=type(exc).__name__, message=str(exc)[:2000], seconds=self._seconds()
        )

    @contextmanager
    def failures(self) -> Iterator[None]:
        """Record an exception of the block as the stage's failure, and let it go on."""
        try:
            yield
        except Exception as exc:
            self.failed(exc)
            raise

    def _seconds(self) -> float:
        return round(self.elapsed(), 3)


def recorded(name: str) -> Callable[[Callable[Concatenate[Run, P], R]], Callable[Concatenate[Run, P], R]]:
    """Record the stage ``fn`` (whose first argument is the run) under ``name``: start, then end or failure."""

    def wrap(fn: Callable[Concatenate[Run, P], R]) -> Callable[Concatenate[Run, P], R]:
        @functools.wraps(fn)
        def run_stage(run: Run, *args: P.args, **kwargs: P.kwargs) -> R:
            stage = StageRecorder.start(run, name)
            with stage.failures():
                result = fn(run, *args, **kwargs)
            stage.end(result)
            return result

        return run_stage

    return wrap
