"""Steps from the nodes' logs, for a script that writes no heartbeats: read incrementally, written as ledger
``step`` events in the runtime's shape (``source: "log"``).

``LogTail`` reads what a node's log gained since the last look, at most ``TAIL_BYTES`` a look (a log of
gigabytes costs one capped read: the older part of a burst is skipped, its last lines are what count), a
regular file only, opened without following a link (docs/architecture.md, rule 14: the log is the training
code's output). ``LogSteps`` is one attempt's: at each look it feeds every node's new lines to its
``logsteps.Scan`` and, when the furthest step moved, says it as one ``step`` event covering the steps since
the last one (``first_step``, ``steps``), with ``step_ms`` the time between the two looks over the steps
advanced: what a step really cost, as the runtime's own events measure it.

The driver decides when to look (``recovery.progress.ProgressLog``: at every poll until the attempt's first
step, so the resume delay is timed to a poll; then every ``training.progress_every_s``).
"""

from __future__ import annotations

import os
import re
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainyard.backends.base import LaunchPlan
from trainyard.checkpoint import registry
from trainyard.checkpoint.format import step_of
from trainyard.recovery.logsteps import LogStep, Scan
from trainyard.spec.models import TrainingSpec
from trainyard.text import printable

TAIL_BYTES = 256 * 1024
"""The most a look reads of one node's log: far past what a script prints between two looks."""
PARTIAL_CHARS = 8192
"""The most of an unfinished last line kept for the next look (a longer one is junk, dropped)."""
SOURCE = "log"
"""What a ``step`` event read from a log says of itself (the runtime's carry no ``source``)."""


def resume_step(resume_from: str, root: Path | None) -> int | None:
    """The step of the checkpoint an attempt resumes from as the orchestrator chose it: ``none`` is 0, ``latest``
    the lineage's pointer at launch (no pointer: 0), a path its ``step_NNNNNN`` name; None where it cannot say."""
    chosen = resume_from.strip().lower()
    if chosen in ("", "none"):
        return 0
    if chosen == "latest":
        if root is None:
            return None
        pointed = registry.latest(root) if root.is_dir() else None
        return 0 if pointed is None else step_of(pointed)
    return step_of(resume_from)


class LogTail:
    """The lines a log gained since the last ``read`` (split on ``\\n`` and ``\\r``: a progress bar rewrites
    its line with ``\\r``)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, ""
        self.last_line: str | None = None
        """The last non-empty line read (the evidence of a silent node)."""

    def read(self) -> list[str]:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return []  # not there yet, or a link: nothing read
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                return []
            if info.st_size < self.offset:  # truncated or replaced: start again
                self.offset, self.partial = 0, ""
            start = max(self.offset, info.st_size - TAIL_BYTES)
            skipped = start > self.offset
            os.lseek(fd, start, os.SEEK_SET)
            data = os.read(fd, info.st_size - start)
        finally:
            os.close(fd)
        self.offset = start + len(data)
        text = ("" if skipped else self.partial) + data.decode("utf-8", errors="replace")
        lines = re.split(r"\r\n|\r|\n", text)
        self.partial = lines.pop()[-PARTIAL_CHARS:]
        if skipped and lines:
            lines = lines[1:]  # the first line of a skipped burst starts mid-line
        said = [line for line in lines if line.strip()]
        if said:
            self.last_line = printable(said[-1].strip())
        return said


@dataclass(frozen=True)
class LogSilence:
    """How long the job's log has shown no new step, against ``training.log_silence_s`` (what ``look`` judges)."""

    quiet_s: float
    limit_s: float
    last_line: str
    """The last step line seen (the evidence: where the job stopped)."""

    def reason(self) -> str:
        return (
            f"the nodes' logs showed no new step for {self.quiet_s:.0f} s (training.log_silence_s:"
            f" {self.limit_s:g}); last step line: {self.last_line!r}"
        )


class LogSteps:
    """One attempt's nodes' logs as steps; ``look(now)`` returns the ``step`` event due, if the step moved."""

    def __init__(self, logs: Mapping[str, Path], pattern: re.Pattern[str] | None, attempt: int, world_size: int,
                 record: Callable[[dict[str, Any]], object], start_step: int | None = None,
                 silence_s: float | None = None) -> None:  # fmt: skip
        self.tails = {node: LogTail(path) for node, path in logs.items()}
        self.scans = {node: Scan(pattern) for node in logs}
        self.attempt, self.world_size, self.record = attempt, world_size, record
        self.written: tuple[float, int] | None = None
        """When the last event was written and its step."""
        self.start_step = start_step
        """The step the attempt resumes after (the orchestrator's checkpoint): the first event covers the steps
        since, trained before the first look saw one (None: unknown, it covers its own step only)."""
        self.furthest: LogStep | None = None
        self.node: str | None = None
        self.silence_s = silence_s
        self.target: int | None = None
        """The attempt's last step (``TRAINYARD_MAX_STEPS``): once the log shows it, silence is the ending."""
        """``training.log_silence_s``: a job whose log shows no new step for this long is hung (None: never)."""
        self.moved_at: float | None = None
        """When a read last found the furthest step moved (None: no step line yet, so no silence is timed)."""

    @classmethod
    def of(cls, plan: LaunchPlan, training: TrainingSpec, record: Callable[[dict[str, Any]], object]) -> LogSteps:
        """An attempt's: each node's log where the local launcher writes it (``<log_dir>/<node>.log``); a node
        whose log is not on this machine (a pod's) is not read. The spec's ``training.log_pattern`` finds the
        steps; its ``training.log_silence_s`` times their silence."""
        logs = {node: plan.log_dir / f"{node}.log" for node in plan.nodes}
        start = resume_step(plan.train_env.resume_from, plan.train_env.checkpoint_dir)
        pattern = re.compile(training.log_pattern) if training.log_pattern else None
        steps = cls(logs, pattern, plan.attempt, plan.world_size, record, start, training.log_silence_s)
        steps.target = plan.train_env.max_steps
        return steps

    def read(self, now: float | None = None) -> LogStep | None:
        """Read what the logs gained; the furthest step any of them showed (no event written)."""
        before = self.furthest.step if self.furthest is not None else None
        for node, tail in self.tails.items():
            seen = self.scans[node].feed(tail.read())
            if seen is not None and (self.furthest is None or seen.step > self.furthest.step):
                self.furthest, self.node = seen, node
        if self.furthest is not None and self.furthest.step != before:
            self.moved_at = time.time() if now is None else now
        return self.furthest

    def silence(self, now: float) -> LogSilence | None:
        """Read the logs; how long they have shown no new step, where ``silence_s`` is set and a step was seen."""
        if self.silence_s is None:
            return None
        self.read(now)
        if self.moved_at is None or self.furthest is None:
            return None
        if self.target is not None and self.furthest.step >= self.target:
            return None  # trained to the end: what follows (a last save, the teardown) prints no step
        return LogSilence(round(now - self.moved_at, 3), self.silence_s, self.furthest.line)

    def look(self, now: float) -> LogStep | None:
        """Read the logs; write a ``step`` event if the furthest step moved since the last one. The furthest step."""
        ahead = self.read(now)
        if ahead is None or (self.written is not None and ahead.step <= self.written[1]):
            return ahead
        fields: dict[str, Any] = {"step": ahead.step, "source": SOURCE, "attempt": self.attempt,
                                  "world_size": self.world_size, "node": self.node}  # fmt: skip
        if ahead.loss is not None:
            fields["loss"] = ahead.loss
        if self.written is not None:
            at, step = self.written
            fields.update(first_step=step + 1, steps=ahead.step - step)
            if now > at:
                fields["step_ms"] = round(1000 * (now - at) / (ahead.step - step), 3)
        elif (first := self._first()) is not None and first < ahead.step:
            fields.update(first_step=first, steps=ahead.step - first + 1)  # no time: unknown
        self.record(fields)
        self.written = (now, ahead.step)
        return ahead

    def _first(self) -> int | None:
        """The first step the attempt trained, for its first event: the lowest its logs showed (a script counting
        from 0 shows 0, after a resume the step it trains again), else the one after the step it resumes after,
        whichever is lower: steps trained before the first look saw a line count too (None: unknown)."""
        shown = [scan.first for scan in self.scans.values() if scan.first is not None]
        after = None if self.start_step is None else self.start_step + 1
        known = [*shown, *([after] if after is not None else [])]
        return min(known) if known else None

    def last_lines(self) -> dict[str, str | None]:
        return {node: tail.last_line for node, tail in self.tails.items()}
