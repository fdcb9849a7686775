"""The ``Backend`` protocol: what a place that runs nodes (this host, a Kubernetes cluster) provides.

A backend provides the pressure test's candidates and their cool-down, the
node-level launch of the pressure test's probes (``ProbeSite``), the training
``Launcher``, the kinds of its nodes, and the marks that keep later runs off an
evicted node (``exclude``) until a re-test passes it (``readmit``). One
implementation per backend (``backends/local/backend.py``,
``backends/kubernetes/backend.py``), chosen by ``nodes.backend`` in
``trainyard.backends.registry``; nothing else asks which backend it is.

The pressure test itself (its schedule, store, keys, verdict) is
``trainyard.burnin``'s, a layer above: burnin builds each probe's arguments
and secrets and drives the candidates a ``ProbeSite`` starts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from trainyard.backends.base import Launcher


class Candidate(Protocol):
    """One candidate node's probe process or pod, as the pressure test's protocol sees it."""

    def alive(self) -> bool: ...

    def kill(self) -> None: ...

    def why(self, default: str) -> str:
        """Why it failed (exit and last words), else ``default`` (the deadline it missed)."""
        ...


@dataclass(frozen=True)
class Probe:
    """``python -m trainyard.burnin.node ARGS`` on one candidate, with ``env`` (its per-run key) beside its name."""

    node: str
    args: list[str]
    env: Mapping[str, str]
    log: Path
    """Where a local process writes its output (a pod's log stays in the cluster)."""


@dataclass(frozen=True)
class ProbeRun:
    """What every probe of one pressure test shares."""

    run_id: str
    """Names the pods: unique across pipelines."""
    store: str
    """``host:port`` of the orchestrator's store, as the candidates reach it."""
    scratch: str
    """The disk probe's folder (on the hot tier)."""
    timeout_s: float
    """Each probe's protocol timeout."""


class ProbeSite(Protocol):
    """Where a backend starts the pressure test's probes."""

    bind: str
    """The address the orchestrator's store listens on, for the candidates to reach it."""
    shared: bool
    """The candidates are slices of one host (its cores): probes take turns, and a whole slow batch is a busy host."""

    def reach(self) -> str:
        """The host the candidates dial for the store."""
        ...

    def scratch(self, hot_root: Path) -> str:
        """The disk probe's folder on the hot tier (a pod sees only this folder of it)."""
        ...

    def startup_s(self, default_s: float, timeout_s: float) -> float:
        """How long a candidate may take to start (``timeout_s``: the spec's ``pressure_test.timeout_s``)."""
        ...

    def start(self, probes: Sequence[Probe], run: ProbeRun) -> dict[str, Candidate]:
        """Start every probe; node -> its candidate. ``SpecError`` before any starts when they cannot all run."""
        ...


class History(Protocol):
    """The fleet history's cool-down (``trainyard.burnin.fleet.Fleet``), for a backend with no marks of its own."""

    def cooling(self, nodes: Sequence[str], now: float, cooldown_s: float) -> dict[str, float]: ...

    def due(self, nodes: Sequence[str], now: float, cooldown_s: float) -> list[str]: ...


@dataclass(frozen=True)
class Pool:
    """The nodes one pressure test probes."""

    names: list[str]
    """Every node to probe, those due for a re-test included."""
    retest: list[str] = field(default_factory=list)
    """Evicted earlier and past their cool-down: re-admitted when they pass."""
    sitting_out: dict[str, float] = field(default_factory=dict)
    """Node -> when its cool-down ends (epoch seconds), for nodes left out of this test."""


class Backend(Protocol):
    name: str
    defers: bool
    """Whether a train task may leave an attempt to a trigger (pods need no babysitter; processes do)."""
    wake_every_s: float | None
    """How often a deferred train task wakes at the latest (its lease on the lineage is renewed then, and a
    backoff is cut to it); None: its tasks never defer."""
    trigger: str | None
    """The classpath of the Airflow trigger that watches its attempts while a task defers (it takes the
    ``recovery.deferred.AttemptWatch`` and nothing else); None: its tasks never defer."""
    marks: str | None
    """The label that marks an evicted node (the ledger's ``nodes_marked``); None: the fleet history is the mark."""
    snapshot_root: Path | None
    """Node-local memory that outlives a relaunch of an attempt's processes, where each node keeps its in-memory
    snapshots (``runtime.snapshots``); None: a relaunch starts on fresh nodes' memory (a pod scheduled again)."""

    def candidates(self) -> list[str]:
        """The nodes training may run on, ``nodes.count + nodes.spare`` at most; ``NodeUnhealthy`` under ``nodes.min``."""
        ...

    def pool(self, history: History, now: float, cooldown_s: float) -> Pool:
        """The candidates to pressure-test now: past evictions sit out ``cooldown_s``, then are re-tested."""
        ...

    def kinds(self, nodes: Sequence[str]) -> dict[str, str]:
        """Each node's kind, for the fleet history (only nodes of one kind are compared)."""
        ...

    def probe_site(self) -> ProbeSite: ...

    def launcher(self) -> Launcher: ...

    def exclude(self, nodes: Sequence[str], reasons: Mapping[str, str] | None = None) -> list[str]:
        """Mark ``nodes`` evicted, so later runs keep off them; returns the nodes marked."""
        ...

    def readmit(self, nodes: Sequence[str]) -> list[str]:
        """Take the marks off ``nodes`` (they passed a re-test); returns the nodes cleared."""
        ...
