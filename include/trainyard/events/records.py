"""The records of the fold (``trainyard.events.fold``): an attempt, each failure and decision of it, each
growth of its world, each group formed in place, the burn-in's verdicts and limits, the gate's verdict. Plain
frozen data in the spec's vocabularies (a failure kind is a ``FailureKind``, an action an ``Action``): the
controller (``recovery.state``), the report and the policy read them as they are, one class per record."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from trainyard.spec.models import Action, FailureKind

Decision = Action | Literal["regroup"]
"""What a decision did: one of the spec's actions, or a regroup in place (the attempt runs on)."""
AttemptState = Literal["running", "succeeded", "failed"]
ResumeSource = Literal["snapshot", "checkpoint"]
"""What a relaunched attempt's state came from (the ``resumed`` event's ``source``)."""


@dataclass(frozen=True)
class FailureSeen:
    """A ``failure_classified``: what failed, on whom, at which step."""

    attempt: int
    kind: FailureKind
    at: float
    evidence: str = ""
    culprits: tuple[str, ...] = ()
    step: int | None = None
    detected_at: float | None = None


@dataclass(frozen=True)
class DecisionTaken:
    """A ``decision`` about a failure; ``path`` ``in_place`` (a regroup) names the generation and who joined.

    Not the written event's class (``schema.DecisionMade``): that one is the wire's, every field optional
    and in the schema's plain types so that older ledgers still read; this is what the run knows of the
    decision, in the spec's vocabularies (its kind and action required), with when it was taken (``at``, the
    ledger's time stamp) and what came of a rollback (``rolled_back_to``, a later ``rolled_back`` event)."""

    attempt: int
    kind: FailureKind
    action: Decision
    at: float
    nodes: tuple[str, ...] = ()
    reason: str = ""
    delay_s: float = 0.0
    micro_batch: int | None = None
    to_step: int | None = None
    new_nodes: tuple[str, ...] | None = None
    path: str | None = None
    left_out: tuple[str, ...] = ()
    joiners: tuple[str, ...] = ()
    generation: int | None = None
    rolled_back_to: str | None = None
    """The path (or ``none``) a rollback restarted the lineage at (``rolled_back``); None: not yet done."""


@dataclass(frozen=True)
class Fault:
    """One failure of an attempt and the decision taken about it (either may be missing in a torn ledger)."""

    failure: FailureSeen | None = None
    decision: DecisionTaken | None = None


@dataclass(frozen=True)
class Growth:
    """The world grown back in place (``grown``): spares or re-admitted nodes joined at a step boundary."""

    attempt: int
    at: float
    generation: int | None
    nodes: tuple[str, ...]
    joiners: tuple[str, ...]
    micro_batch: int
    world_size: int | None = None


@dataclass(frozen=True)
class Drill:
    at: float
    fault: str | None
    node: str | None
    step: int | None


@dataclass(frozen=True)
class DrillWaited:
    """A drill armed for an attempt whose node was not in its group (``drill_waiting``), and why."""

    attempt: int | None
    fault: str | None
    node: str | None
    step: int | None
    reason: str


@dataclass(frozen=True)
class Formed:
    """A group formed in place (a training process's ``regrouped``): its generation, world size, first step."""

    at: float
    generation: int | None
    world_size: int | None
    from_step: int | None


@dataclass(frozen=True)
class AttemptRun:
    """One training attempt as the ledger tells it; ``nodes``/``micro_batch`` are its current group's."""

    number: int
    started: float
    start_nodes: tuple[str, ...]
    world_size: int
    start_micro_batch: int
    resume_from: str
    nodes: tuple[str, ...]
    micro_batch: int
    state: AttemptState = "running"
    """``running`` (no ``attempt_end``: it runs, or the process watching it died), ``succeeded``, ``failed``."""
    ended: float | None = None
    seconds: float | None = None
    last_step: int | None = None
    trigger: str | None = None
    reason: str | None = None
    resumed_step: int | None = None
    drills: tuple[Drill, ...] = ()
    faults: tuple[Fault, ...] = ()
    growths: tuple[Growth, ...] = ()
    regrouped_at: float | None = None
    """When the last regroup or growth was decided (its group's ranks start again from then)."""
    resume_step: int | None = None
    """The step of the checkpoint the orchestrator chose for it (``attempt_start``): its resumed step where no
    rank wrote a ``resumed``."""
    resumed_at: float | None = None
    """When rank 0 had its state back (its ``resumed``): the end of the state restore."""
    restore_s: float | None = None
    """How long rank 0 took to load that state (the ``resumed`` event's ``seconds``)."""
    resumed_source: ResumeSource | None = None
    """What rank 0 resumed from (the ``resumed`` event's ``source``): ``snapshot`` (an in-memory snapshot of the
    run) or ``checkpoint``; None where it did not say (a runtime from before snapshots, an adapter)."""
    resumed_why: str | None = None
    """Why that one, in the runtime's words (``resumed``'s ``why``), made printable: worker text."""
    copied_to_ranks: tuple[int, ...] = ()
    """From a snapshot: the ranks whose node lacked it and received a peer's copy."""

    @property
    def failures(self) -> list[FailureSeen]:
        return [f.failure for f in self.faults if f.failure is not None]

    @property
    def decisions(self) -> list[DecisionTaken]:
        return [f.decision for f in self.faults if f.decision is not None]

    @property
    def regroups(self) -> list[Fault]:
        """The faults healed in place (the attempt ran on)."""
        return [f for f in self.faults if f.decision is not None and f.decision.action == "regroup"]

    @property
    def decided(self) -> DecisionTaken | None:
        """The last decision that ended the attempt (not a regroup: that one runs on)."""
        return next((d for d in reversed(self.decisions) if d.action != "regroup"), None)

    @property
    def generation(self) -> int:
        """The group generation on the supervisor's store: 1, then one more per regroup or growth."""
        return 1 + len(self.regroups) + len(self.growths)


@dataclass(frozen=True)
class NodeJudged:
    """A burn-in ``node_verdict``: one node's figures, its second round if it was a suspect, and the verdict."""

    figures: dict[str, Any] | None = None
    again: Any = None
    suspect: str | None = None
    verdict: str | None = None
    reason: str | None = None
    collective: Any = None


@dataclass(frozen=True)
class Limits:
    """The burn-in's ``thresholds``: each probe's threshold and reference figure, and how long it took."""

    thresholds: dict[str, Any] | None
    references: dict[str, Any] | None
    seconds: float | None


@dataclass(frozen=True)
class Gated:
    """The gate's last verdict in the run (``checkpoint_checked``): the checkpoint it checked, the digest of the
    manifest it read, what it found wrong and what it could not check."""

    path: str
    valid: bool
    manifest_sha256: str | None
    problems: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    seconds: float | None = None
    at: float | None = None
    step: int | None = None
    """The step it checked; ``target_step`` the run's final step; ``steps_short`` how far the one is from the other."""
    target_step: int | None = None
    steps_short: int | None = None


@dataclass(frozen=True)
class StageError:
    """Why a stage's last try failed (``stage_failed``): the error's class and its message."""

    error: str
    message: str
