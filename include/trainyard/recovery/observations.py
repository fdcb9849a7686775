"""What the training controller is told: the run's fixed inputs (``Context``) and each observation a driver makes.

Drivers build these from what they see (a poll, a trigger's event, the clock); ``controller.step`` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from trainyard.backends.base import NodeStatus
from trainyard.recovery.classify import Failure
from trainyard.spec import RecoverySpec


@dataclass(frozen=True)
class Context:
    """The run's fixed inputs: the spec's numbers and the nodes burn-in chose."""

    recovery: RecoverySpec
    nodes: list[str]
    """The first attempt's nodes."""
    spares: list[str]
    """Healthy nodes burn-in did not pick, to replace lost ones."""
    micro_batch: int
    global_batch: int
    min_nodes: int
    procs_per_node: int
    reattach: bool
    """The launcher can watch an attempt an earlier task process launched (Kubernetes); local
    attempts die with the process that started them, so the next attempt is launched instead."""
    elastic: bool = False
    """The attempt's ranks form their groups on the supervisor's store and survive a peer's loss
    (the local backend with trainyard's runtime): a failure may be healed in place (``Regroup``)."""


@dataclass(frozen=True)
class Checkpoints:
    """The hot checkpoints when a failure is judged (the driver looks; the policy needs them)."""

    valid_steps: list[int] = field(default_factory=list)
    """Steps of valid checkpoints, ascending."""
    latest_step: int | None = None
    """Step of the lineage's latest checkpoint (``LATEST``), if any."""


@dataclass(frozen=True)
class TaskStarted:
    """A train task process began (first try, a retry, a resumed deferral): carry on from the ledger."""

    at: float


@dataclass(frozen=True)
class AttemptSucceeded:
    attempt: int
    at: float
    last_step: int | None = None
    """The heartbeats' newest step."""


@dataclass(frozen=True)
class AttemptFailed:
    """An attempt ended badly, with what the driver saw (``failure``: classify's input)."""

    attempt: int
    at: float
    failure: Failure
    reason: str
    checkpoints: Checkpoints = field(default_factory=Checkpoints)
    ungrouped: str = ""
    """Why the attempt's ranks cannot regroup in place though it runs on the store ("" when they can, or when it
    does not): they never formed its first group there (the script does not use the elastic group)."""
    batch_followed: bool = False
    """The script said it applies the batch settings (a ``batch_followed`` of its rank 0, in the writers' files
    the controller's fold does not read: the driver looks when a failure is judged)."""


@dataclass(frozen=True)
class Hang:
    """A watcher saw ranks without progress; the driver had no closer look (no node evidence)."""

    attempt: int
    at: float
    suspects: list[str]
    reason: str
    checkpoints: Checkpoints = field(default_factory=Checkpoints)
    ungrouped: str = ""
    """As ``AttemptFailed.ungrouped``."""
    batch_followed: bool = False
    """As ``AttemptFailed.batch_followed``."""


@dataclass(frozen=True)
class Beatless:
    """No rank of the attempt has beaten by the time one that did would have been called hung: the script
    writes no heartbeats, so hang detection is off for it (its liveness is its processes' exits)."""

    attempt: int
    at: float
    reason: str


@dataclass(frozen=True)
class Timeout:
    """The watcher woke without news: the attempt runs on."""

    attempt: int
    at: float


@dataclass(frozen=True)
class LostSight:
    """The cluster did not answer; the attempt may well be running (a retried task re-attaches)."""

    attempt: int
    at: float
    message: str


@dataclass(frozen=True)
class SparesReady:
    """Nodes outside the group wait ready on the store (warm spares, re-admitted nodes) while the world is
    smaller than the first attempt's: it can grow back in place."""

    attempt: int
    at: float
    nodes: list[str]


@dataclass(frozen=True)
class BackoffOver:
    at: float


@dataclass(frozen=True)
class LeaseLost:
    """Another run holds the pipeline's checkpoint lineage now: this run must stop writing to it."""

    at: float
    message: str


Observation = (
    TaskStarted
    | AttemptSucceeded
    | AttemptFailed
    | Hang
    | Beatless
    | Timeout
    | LostSight
    | BackoffOver
    | LeaseLost
    | SparesReady
)


@dataclass(frozen=True)
class Reported:
    """What an attempt's watcher (the Kubernetes trigger) reported, typed: the driver looks again before
    it becomes an ``Observation`` (a fresh poll has the pods' logs as evidence)."""

    status: Literal["succeeded", "failed", "hang", "timeout", "error", "fault"]
    message: str
    attempt: int | None = None
    """None: an event of a trigger that did not say (the ledger's last attempt)."""
    nodes: list[NodeStatus] = field(default_factory=list)
    suspects: list[str] = field(default_factory=list)
