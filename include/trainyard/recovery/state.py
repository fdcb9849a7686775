"""The controller's view of the run's training: the ledger's one fold (``trainyard.events.fold``), adapted.

``TrainState`` holds the fold's ``TrainRun`` and folds later events onto it
(a driver keeps one and folds only what was appended since its last look).
Its attempts are the fold's records read in the controller's terms (``Attempt``
wraps an ``AttemptRun``: the ``Course`` an attempt runs with, the last failure
``classify`` made of it, the decision that ended it, the fold's own
``DecisionTaken``, the faults it healed in place). Nothing here reads an event
or copies a record: what the ledger says is what the fold says.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from trainyard.events.fold import TrainRun
from trainyard.events.records import AttemptRun, AttemptState, DecisionTaken
from trainyard.recovery.classify import Classified
from trainyard.recovery.policy import AttemptRecord
from trainyard.spec.models import FailureKind

STAGE = "train"
"""The ledger stage of every event the controller records or folds."""


@dataclass(frozen=True)
class Course:
    """What an attempt runs with; decisions change it."""

    nodes: list[str]
    micro_batch: int
    resume_from: str
    """``latest``, ``none`` or a checkpoint path (a rollback target, or the run's starting point)."""


@dataclass(frozen=True)
class Attempt:
    """One of the fold's attempts (``AttemptRun``) as the controller reads it: the ``Course`` it runs with, the
    last failure ``classify`` made of it, the decision that ended it (the fold's ``DecisionTaken``), the faults
    it healed in place. No field of its own: every figure is the fold's, the generation included."""

    run: AttemptRun

    @property
    def number(self) -> int:
        return self.run.number

    @property
    def course(self) -> Course:
        return Course(list(self.run.nodes), self.run.micro_batch, self.run.resume_from)

    @property
    def started(self) -> float:
        return self.run.started

    @property
    def state(self) -> AttemptState:
        """``running``: no ``attempt_end`` recorded (it runs, or the process watching it died)."""
        return self.run.state

    @property
    def seconds(self) -> float | None:
        return self.run.seconds

    @property
    def last_step(self) -> int | None:
        return self.run.last_step

    @property
    def classified(self) -> Classified | None:
        failure = self.run.failures[-1] if self.run.failures else None
        return (
            None
            if failure is None
            else Classified(failure.kind, failure.evidence, list(failure.culprits), failure.step)
        )

    @property
    def decided(self) -> DecisionTaken | None:
        """The last decision that ended the attempt (not a regroup: that one runs on)."""
        return self.run.decided

    @property
    def regroups(self) -> tuple[tuple[FailureKind, int | None], ...]:
        """In-place regroups so far: (kind, the step its failure was seen at); the attempt runs on."""
        return tuple((f.decision.kind, f.failure.step if f.failure else None) for f in self.run.regroups if f.decision)

    @property
    def regrouped_at(self) -> float | None:
        """When the last regroup (or growth) was decided (its group's ranks start again from then)."""
        return self.run.regrouped_at

    @property
    def generation(self) -> int:
        """The attempt's group generation on the supervisor's store (the fold's: 1, then one per regroup or growth)."""
        return self.run.generation


@dataclass(frozen=True)
class TrainState:
    """The run's training as its ledger tells it. ``TrainState().fold(events)``; fold later events onto it."""

    run: TrainRun = field(default_factory=TrainRun)

    @classmethod
    def of(cls, events: Iterable[Mapping[str, Any]]) -> TrainState:
        return cls().fold(events)

    def fold(self, events: Iterable[Mapping[str, Any]]) -> TrainState:
        """This state with ``events`` (later ledger events, in write order) applied; events of other stages are skipped."""
        return TrainState(self.run.fold(events))

    @property
    def resume_from(self) -> str | None:
        """The run's starting checkpoint (``resume_point``): decided once per run; None: not yet."""
        return self.run.resume_from

    @property
    def start_step(self) -> int | None:
        return self.run.start_step

    @cached_property
    def attempts(self) -> tuple[Attempt, ...]:
        return tuple(Attempt(a) for a in self.run.attempts)

    @cached_property
    def history(self) -> tuple[AttemptRecord, ...]:
        """Every decision so far, for ``policy.decide``."""
        started = {a.number: a.resumed_step or 0 for a in self.run.attempts}
        last = {a.number: a.last_step for a in self.run.attempts}
        return tuple(
            AttemptRecord(
                d.attempt,
                d.kind,
                d.action,
                list(d.nodes),
                progressed=(last.get(d.attempt) or 0) > started.get(d.attempt, 0),
            )
            for d in self.run.decisions
        )

    @property
    def used(self) -> frozenset[str]:
        """Nodes any attempt ran on or a decision took (a spare used once is no longer spare)."""
        return self.run.used

    @property
    def stage_start(self) -> float | None:
        """When the latest train task process began (the last ``stage_start``)."""
        return self.run.stage_start

    @property
    def last(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    @property
    def unfinished(self) -> bool:
        """The last attempt has no recorded end: still running, or left behind by a task process that died."""
        return self.last is not None and self.last.state == "running"

    @property
    def failures(self) -> list[Classified]:
        return [a.classified for a in self.attempts if a.classified is not None]

    def target_step(self, max_steps: int) -> int | None:
        return None if self.start_step is None else self.start_step + max_steps

    def spares_left(self, spares: Iterable[str]) -> list[str]:
        return [n for n in spares if n not in self.used]
