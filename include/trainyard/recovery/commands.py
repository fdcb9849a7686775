"""What the training controller says: the commands a driver carries out, in order, ending in one of ``TERMINAL``.

``Record`` appends a ledger event; its typed constructors (``Record.of``) build the record through the
event schema (``trainyard.events.schema``), so what the controller writes is what the fold reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainyard.events.schema import Event
from trainyard.recovery.state import Course


@dataclass(frozen=True)
class AttemptResult:
    attempt: int
    seconds: float
    last_step: int | None


@dataclass(frozen=True)
class Record:
    """Append ``event`` (stage ``train``) to the ledger; ``log`` is a line for the task's log too."""

    event: str
    fields: dict[str, Any]
    log: str = ""

    @classmethod
    def of(cls, record: Event, log: str = "") -> Record:
        """The record of a typed event (its kind and its declared fields)."""
        return cls(record.event, record.fields(), log)


@dataclass(frozen=True)
class Cancel:
    """End every process (or pod) of the attempt; a no-op for one that already ended."""

    attempt: int
    course: Course


@dataclass(frozen=True)
class RollBack:
    """Set the checkpoints after ``to_step`` aside and restart the lineage there (records ``rolled_back``)."""

    to_step: int


@dataclass(frozen=True)
class ExcludeNodes:
    """Keep later attempts off ``nodes`` (the launcher marks them where it can; records ``nodes_marked``)."""

    attempt: int
    nodes: list[str]
    reason: str


@dataclass(frozen=True)
class KillNodes:
    """End these nodes' processes (a hung node holds its sockets open until it dies); the rest run on."""

    attempt: int
    nodes: list[str]


@dataclass(frozen=True)
class Publish:
    """Publish the attempt's next group generation on the supervisor's store: its ranks regroup in place."""

    attempt: int
    generation: int
    nodes: list[str]
    """The new group's nodes, in rank order."""
    micro_batch: int
    joiners: list[str]
    """Nodes that join with nothing in memory: the survivors broadcast them the state."""


@dataclass(frozen=True)
class Launch:
    """Record ``attempt_start`` and launch the attempt's plan (the driver builds it from these)."""

    attempt: int
    course: Course
    warm: list[str] = field(default_factory=list)
    """Spares started with the attempt: they connect, build the model and wait on the store to be listed."""


@dataclass(frozen=True)
class StartNodes:
    """Start these nodes in the running attempt, outside its group: they wait on the store, ready to join
    (a node left out for a dead process, started again: reaching the store ready is its re-test)."""

    attempt: int
    nodes: list[str]
    once_formed: int | None = None
    """Not before every member formed this generation: where nodes share cores (the local backend), a
    start-up beside the survivors' regroup would slow their first step."""


@dataclass(frozen=True)
class Watch:
    """Wait for news of the attempt (poll it, or defer on its trigger)."""

    attempt: int
    course: Course


@dataclass(frozen=True)
class WaitUntil:
    """Wait until ``at`` (epoch seconds; a retry's backoff), then report ``BackoffOver``."""

    at: float


@dataclass(frozen=True)
class Finish:
    result: AttemptResult


@dataclass(frozen=True)
class Fail:
    """End the train task: ``kind`` ``lease_lost`` (another run holds the lineage), ``lost_sight`` (worth a
    task retry) or the failure kind the policy gave up on."""

    reason: str
    kind: str
    evidence: str = ""


Command = (
    Record
    | Cancel
    | KillNodes
    | Publish
    | StartNodes
    | RollBack
    | ExcludeNodes
    | Launch
    | Watch
    | WaitUntil
    | Finish
    | Fail
)
TERMINAL = (Watch, WaitUntil, Finish, Fail)
"""Every command list ends with exactly one of these, and has no other."""
