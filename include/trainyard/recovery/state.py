"""The controller's view of the run's training: the ledger's one fold (``trainyard.events.fold``), adapted.

``TrainState`` holds the fold's ``TrainRun`` and folds later events onto it
(a driver keeps one and folds only what was appended since its last look).
Its attempts are the fold's, in the controller's terms: the ``Course`` an
attempt runs with, the last failure ``classify`` made of it, the decision that
ended it (``Decided``), the faults it healed in place. Nothing here reads an
event itself: what the ledger says is what the fold says.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal, cast

from trainyard.events.fold import TrainRun
from trainyard.events.records import AttemptRun, DecisionTaken
from trainyard.recovery.classify import Classified
from trainyard.recovery.policy import AttemptRecord
from trainyard.spec.models import Action, FailureKind

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
class Decided:
    """A recorded decision about a failed attempt (``decision`` event), and whether it was carried out."""

    action: Action
    kind: FailureKind
    at: float
    delay_s: float = 0.0
    reason: str = ""
    micro_batch: int | None = None
    new_nodes: list[str] | None = None
    to_step: int | None = None
    rolled_back_to: str | None = None
    """The path (or ``none``) a rollback restarted the lineage at (``rolled_back`` event); None: not yet done."""


@dataclass(frozen=True)
class Attempt:
    number: int
    course: Course
    started: float
    world_size: int
    state: Literal["running", "succeeded", "failed"] = "running"
    """``running``: no ``attempt_end`` recorded (it runs, or the process watching it died)."""
    seconds: float | None = None
    last_step: int | None = None
    classified: Classified | None = None
    decided: Decided | None = None
    regroups: tuple[tuple[FailureKind, int | None], ...] = ()
    """In-place regroups so far: (kind, the step its failure was seen at); the attempt runs on."""
    regrouped_at: float | None = None
    """When the last regroup (or growth) was decided (its group's ranks start again from then)."""
    grown: int = 0
    """Times the world grew back in place (spares or re-admitted nodes joined at a step boundary)."""

    @property
    def generation(self) -> int:
        """The attempt's group generation on the supervisor's store: 1, then one more per regroup or growth."""
        return 1 + len(self.regroups) + self.grown


def _decided(d: DecisionTaken) -> Decided:
    return Decided(cast(Action, d.action), cast(FailureKind, d.kind), d.at, d.delay_s, d.reason, d.micro_batch,
                   None if d.new_nodes is None else list(d.new_nodes), d.to_step, d.rolled_back_to)  # fmt: skip


def _attempt(a: AttemptRun) -> Attempt:
    failure = a.failures[-1] if a.failures else None
    classified = (
        None
        if failure is None
        else Classified(cast(FailureKind, failure.kind), failure.evidence, list(failure.culprits), failure.step)
    )
    regroups = tuple(
        (cast(FailureKind, f.decision.kind), f.failure.step if f.failure else None)
        for f in a.regroups
        if f.decision is not None
    )
    return Attempt(
        number=a.number,
        course=Course(list(a.nodes), a.micro_batch, a.resume_from),
        started=a.started,
        world_size=a.world_size,
        state=cast(Literal["running", "succeeded", "failed"], a.state),
        seconds=a.seconds,
        last_step=a.last_step,
        classified=classified,
        decided=None if (d := a.decided) is None else _decided(d),
        regroups=regroups,
        regrouped_at=a.regrouped_at,
        grown=len(a.growths),
    )


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
        return tuple(_attempt(a) for a in self.run.attempts)

    @cached_property
    def history(self) -> tuple[AttemptRecord, ...]:
        """Every decision so far, for ``policy.decide``."""
        started = {a.number: a.resumed_step or 0 for a in self.run.attempts}
        last = {a.number: a.last_step for a in self.run.attempts}
        return tuple(
            AttemptRecord(
                d.attempt,
                cast(FailureKind, d.kind),
                cast(Action, d.action),
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
