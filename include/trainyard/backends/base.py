"""The launcher protocol every backend implements: ``launch``, ``poll``, ``cancel``, ``attach``, ``exclude``.

A plan says everything an attempt needs; statuses use one vocabulary whatever
the backend, so the supervisor and the recovery policy never ask which
backend ran the attempt.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from trainyard.protocol.env import TrainEnv

NodeState = Literal["running", "succeeded", "failed"]


@dataclass(frozen=True)
class LaunchPlan:
    run_id: str
    attempt: int
    nodes: list[str]
    procs_per_node: int
    entrypoint: str
    """Dotted module (run with ``-m``) or a ``.py`` script."""
    args: list[str]
    train_env: TrainEnv
    """The training contract, the same on every node (a launcher adds each node's ``for_node``)."""
    log_dir: Path
    pass_env: tuple[str, ...] = ()
    """Names of the worker's variables a local process may also see (``training.pass_env``)."""
    store_keys: Mapping[str, str] = field(default_factory=dict, repr=False)
    """Node -> its key to the attempt's coordination store (secrets: each node gets only its own, ``for_node``)."""
    workdir: str | None = None
    """``training.workdir`` rendered: where the ranks start; None: the backend's default (``local_workdir``; on
    Kubernetes the image's ``WORKDIR``)."""
    script_env: Mapping[str, str] = field(default_factory=dict)
    """``training.env`` rendered: set for every rank, under the contract (which wins)."""
    framework: str = "auto"
    """``training.framework``: what the script trains with (``trainyard.preload``), imported before its ranks start
    where a backend can (the local zygote)."""

    @property
    def env(self) -> dict[str, str]:
        """The contract as TRAINYARD_* variables (without the per-node ones)."""
        return self.train_env.to_env()

    def for_node(self, node: str, host: str | None = None) -> TrainEnv:
        """The contract as ``node`` sees it: its name, host and its own store key (``TrainEnv.for_node``)."""
        return self.train_env.for_node(node, host, self.store_keys.get(node))

    @property
    def heartbeat_dir(self) -> Path:
        """Where the attempt's ranks beat; the drivers watch no attempt without one."""
        if self.train_env.heartbeat_dir is None:
            raise ValueError(f"attempt {self.attempt} of run {self.run_id}: the plan has no heartbeat folder")
        return self.train_env.heartbeat_dir

    @property
    def world_size(self) -> int:
        return len(self.nodes) * self.procs_per_node

    def local_workdir(self) -> Path:
        """Where a local node starts: ``workdir``, else a ``.py`` entrypoint's folder (as ``python train.py`` is
        run from its repo), else the run's folder (the attempt's log folder is in it)."""
        if self.workdir:
            return Path(self.workdir)
        return Path(self.entrypoint).absolute().parent if self.entrypoint.endswith(".py") else self.log_dir.parent

    def entry_argv(self) -> list[str]:
        target = [self.entrypoint] if self.entrypoint.endswith(".py") else ["-m", self.entrypoint]
        return [*target, *self.args]


@dataclass(frozen=True)
class NodeStatus:
    """One node of an attempt: its ``slot`` in the plan and the ``host`` it really ran on.

    Recovery blames, marks and replaces *hosts*: on Kubernetes the pods are
    pinned to the plan's set of hosts, and the scheduler puts pod *i* on any of
    them, so the slot (``plan.nodes[i]``) says nothing about where it ran.
    """

    slot: str
    """The plan's node name at this node's index (the Indexed Job's completion index)."""
    state: NodeState
    exit_code: int | None = None
    log: str = ""
    """Path of the node's log file, for evidence."""
    reason: str = ""
    """Why a node failed, when the backend knows more than an exit code
    (Kubernetes: ``OOMKilled``, ``Evicted``, ``NodeLost``, ``ImagePullBackOff``, ``Unschedulable``, ...)."""
    host: str = ""
    """Where it ran (a pod's ``spec.nodeName``); "" while not placed. Local processes: the slot."""

    @property
    def node(self) -> str:
        """The slot, for callers from before slot and host were told apart."""
        return self.slot

    @property
    def where(self) -> str:
        """The host, or the slot while it has none: the name to show and to blame."""
        return self.host or self.slot


@dataclass(frozen=True)
class AttemptStatus:
    nodes: list[NodeStatus] = field(default_factory=list)

    @property
    def state(self) -> NodeState:
        states = {n.state for n in self.nodes}
        if "failed" in states:
            return "failed"
        return "succeeded" if states == {"succeeded"} else "running"

    def failed(self) -> list[NodeStatus]:
        return [n for n in self.nodes if n.state == "failed"]


def status_to_dicts(status: AttemptStatus) -> list[dict[str, Any]]:
    """JSON-safe records (a trigger event's payload, whatever the backend)."""
    return [asdict(n) for n in status.nodes]


def status_from_dicts(items: Iterable[Mapping[str, Any]]) -> AttemptStatus:
    """The records back; one written before slot and host were told apart (``node``) has that name as both."""
    out = []
    for item in items:
        fields = dict(item)
        if "node" in fields:
            old = fields.pop("node")
            fields.setdefault("slot", old)
            fields.setdefault("host", old)
        out.append(NodeStatus(**fields))
    return AttemptStatus(out)


class Launcher(Protocol):
    """What the drivers (``recovery.supervisor``, ``recovery.deferred``) call; handles are the backend's own."""

    @property
    def reattaches(self) -> bool:
        """Whether ``attach`` finds an attempt another process launched (pods do; local processes die with
        the process that started them)."""
        ...

    def launch(self, plan: LaunchPlan) -> Any:
        """Start every node of the attempt; returns a handle for ``poll`` and ``cancel``."""
        ...

    def poll(self, handle: Any) -> AttemptStatus: ...

    def cancel(self, handle: Any, grace_s: float | None = None) -> None:
        """End every process (or pod) of the attempt; safe to call twice. ``grace_s``: how long they get to end
        on their own before they are killed (None: the backend's own grace)."""
        ...

    def exclude(self, nodes: list[str]) -> list[str]:
        """Keep later attempts off ``nodes`` (recovery left them out); returns the nodes it could mark."""
        ...

    def attach(self, plan: LaunchPlan) -> Any:
        """The handle of ``plan``'s attempt, launched earlier by another process (a resumed or retried task)."""
        ...

    def cancel_all(self) -> None:
        """End every attempt this launcher launched or attached and has not cancelled (the task is killed)."""
        ...


@runtime_checkable
class DefersAttempts(Launcher, Protocol):
    """A launcher whose attempts a trigger can watch while the task is away (``Backend.defers``)."""

    def describe(self, handle: Any) -> dict[str, Any]:
        """The attempt's handle as plain JSON, for its backend's trigger (opaque to every layer between)."""
        ...


@runtime_checkable
class RegroupingLauncher(Launcher, Protocol):
    """A launcher whose attempts can change their nodes while they run (in-place recovery: the local backend)."""

    def kill_nodes(self, handle: Any, nodes: list[str]) -> None:
        """End these nodes' processes now (SIGKILL: a hung one must close its sockets); the others run on."""
        ...

    def add_nodes(self, handle: Any, nodes: list[str]) -> None:
        """Start these nodes in the running attempt (joiners: they wait on the coordination store)."""
        ...


@runtime_checkable
class WakesOnExit(Protocol):
    """A launcher that can wait for any of an attempt's processes to end (the local backend: its processes are
    this host's): the watch between its polls, so a node's death is seen when it happens, not up to a poll
    later (a poll every 0.5-1.5 s was most of a relaunch's detection)."""

    def wait_exit(self, handle: Any, seconds: float) -> bool:
        """Wait up to ``seconds`` for a running process of the attempt to end: whether one did."""
        ...


@runtime_checkable
class SignalsNodes(Protocol):
    """A launcher that can act a drill out on a node's processes from outside them (the local backend): for a
    script that does not act out trainyard's drills itself (``recovery.drills``)."""

    def signal_nodes(self, handle: Any, nodes: list[str], fault: str, factor: float = 1.0) -> None:
        """``kill``: SIGKILL the nodes' processes; ``hang``: SIGSTOP them; ``slow``: stop them ``factor`` times as
        long as they run, until the attempt ends."""
        ...


class CoordinationStore(Protocol):
    """The coordination stores of a run's in-place attempts, the orchestrator's side: the nodes' keys, the
    address the ranks dial, the coordinator (``recovery.storehost.StoreHost``: served by the task process;
    ``backends.kubernetes.store.PodStore``: by a pod per attempt)."""

    def keys(self, attempt: int) -> dict[str, str]: ...

    def address_for(self, attempt: int) -> str: ...

    def coordinator(self, attempt: int) -> Any: ...

    def reach(self, attempt: int) -> str | None:
        """Where another process of the orchestrator (a trigger) dials the attempt's store; None: nowhere."""
        ...


@runtime_checkable
class ServesStores(RegroupingLauncher, Protocol):
    """A regrouping launcher whose attempts bring their own coordination store (no task process stays to serve
    one: the deferred Kubernetes task). ``plan_for(attempt)``: a plan of that attempt, for its names."""

    def coordination_store(
        self,
        secrets_dir: Path,
        nodes: list[str],
        plan_for: Callable[[int], LaunchPlan],
        on_refused: Callable[[int, str, str], None] | None = None,
    ) -> CoordinationStore: ...
