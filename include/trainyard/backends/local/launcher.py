"""Local backend: one torchrun agent per node, all on this machine.

Each node is its own process session with its own identity (TRAINYARD_NODE)
and log file; the agents meet through c10d rendezvous on a free 127.0.0.1
port and train over gloo, or NCCL where they have GPUs. Node 0's agent hosts
the rendezvous store. The agents get an allow-listed environment
(``trainyard.backends.local.environ``), never the Airflow worker's secrets.
Each agent is a fork of a zygote that imported torch and the script's framework
(``training.framework``) once, and so is each worker of any Python script
(``trainyard.backends.local.zygote``): a node starts without importing torch
or its framework again, at every relaunch.

In place (the plan names a coordination store), a node is no agent but its
``procs_per_node`` ranks, each a process of its own (a fork of the zygote for the
reference workload) with the world torchrun would give it (``rank_env``), so a
script that forms its own group from it trains as a fixed world. The node stays
the unit: it has failed when any of its ranks has, and it is killed, started
again and cancelled with all of them.

GPUs: the host's GPUs are split between the simulated nodes through
``CUDA_VISIBLE_DEVICES`` (node ``i`` gets ``[i * g, (i + 1) * g)`` for ``g`` =
``nodes.gpus_per_node``), so a node's ``cuda:LOCAL_RANK`` is a GPU of its own;
a spec that asks for more GPUs than the host has is refused before any
process starts. With ``g`` = 0 every GPU is hidden: two nodes must not meet
on one GPU because the spec did not mention them.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import psutil

from trainyard.atomic import open_append
from trainyard.backends.base import AttemptStatus, LaunchPlan, NodeState, NodeStatus
from trainyard.backends.local.environ import child_env
from trainyard.backends.local.procs import die_with_parent
from trainyard.backends.local.zygote_client import Forked, Zygote, usable, zygote_argv
from trainyard.errors import SpecError
from trainyard.protocol.env import TrainEnv
from trainyard.protocol.heartbeat import drop_local_folder, node_folder

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def visible_devices(env: Mapping[str, str], count: int) -> list[str]:
    """The host's GPUs as a child must name them: the worker's own ``CUDA_VISIBLE_DEVICES`` if it has one
    (its entries are physical ids or UUIDs, which a child's list must repeat), else ``0 .. count-1``."""
    if "CUDA_VISIBLE_DEVICES" in env:
        return [d.strip() for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    return [str(i) for i in range(count)]


def split_visible_devices(devices: list[str], nodes: int, per_node: int) -> list[str]:
    """``CUDA_VISIBLE_DEVICES`` of each of ``nodes`` simulated nodes on one host whose GPUs are ``devices``.

    Node ``i`` gets ``devices[i * per_node : (i + 1) * per_node]``; ``per_node`` 0 hides
    every GPU (the spec asked for none, so ranks must not share one by accident).
    ``ValueError`` names the fields to change when the host has too few.
    """
    if per_node < 0 or nodes < 0:
        raise ValueError(f"gpus per node ({per_node}) and nodes ({nodes}) must be >= 0")
    if per_node == 0:
        return [""] * nodes
    if nodes * per_node > len(devices):
        raise ValueError(
            f"nodes.gpus_per_node: {nodes} node(s) x {per_node} GPU(s) = {nodes * per_node}, but this host has"
            f" {len(devices)} GPU(s) visible; lower nodes.gpus_per_node (and nodes.procs_per_node with it) or the"
            f" node count to fit, or set nodes.gpus_per_node: 0 to train on CPUs"
        )
    return [",".join(devices[i * per_node : (i + 1) * per_node]) for i in range(nodes)]


def host_gpus(parent: Mapping[str, str]) -> list[str]:
    """This host's GPUs as the worker sees them (torch is imported only when a spec asks for GPUs)."""
    if "CUDA_VISIBLE_DEVICES" in parent:
        return visible_devices(parent, 0)
    import torch

    return visible_devices(parent, torch.cuda.device_count())


Proc = subprocess.Popen | Forked
WORLD_NAMES = ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun gives each rank, which an in-place launch gives too (``rank_env``)."""


@dataclass
class LocalHandle:
    plan: LaunchPlan
    port: int
    ranks: dict[str, list[Proc]] = field(default_factory=dict)
    """Node -> its processes: its torchrun agent, or (in place) one per local rank, in local rank order."""
    logs: dict[str, Path] = field(default_factory=dict)
    over: threading.Event = field(default_factory=threading.Event)
    """Set once the attempt is cancelled: a ``slow`` drill's duty cycle stops."""
    pidfds: dict[int, int] = field(default_factory=dict)
    """Pid -> a pidfd of it (``LocalLauncher.wait_exit``), opened while it ran: readable once it has ended."""

    @property
    def procs(self) -> dict[str, Proc]:
        """Node -> its first process (its torchrun agent, or its local rank 0)."""
        return {node: procs[0] for node, procs in self.ranks.items() if procs}

    def processes(self, nodes: list[str] | None = None) -> list[Proc]:
        """Every process of ``nodes`` (default: of every node)."""
        return [p for node in (self.ranks if nodes is None else nodes) for p in self.ranks.get(node, [])]


def rank_env(node_index: int, local_rank: int, per_node: int, nodes: int, port: int) -> dict[str, str]:
    """The world torchrun would give local rank ``local_rank`` of node ``node_index`` of ``nodes`` nodes of
    ``per_node`` ranks each, meeting at ``127.0.0.1:port``: with it a script that forms its own group (env://)
    trains as a fixed world under an in-place launch. The elastic group ignores ``RANK``/``WORLD_SIZE`` (each
    generation renumbers) and keeps ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``."""
    if not (0 <= local_rank < per_node and 0 <= node_index and nodes >= 1):
        raise ValueError(f"local rank {local_rank} of {per_node}, node {node_index} of {nodes}: out of range")
    return {
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(per_node),
        "RANK": str(node_index * per_node + local_rank),
        "WORLD_SIZE": str(nodes * per_node),
        "GROUP_RANK": str(node_index),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def node_state(codes: list[int | None]) -> tuple[NodeState, int | None]:
    """A node's state and exit code from its processes' codes: failed when any failed (the node is the unit of
    recovery), else running while any runs, else succeeded."""
    if failed := [c for c in codes if c not in (None, 0)]:
        return "failed", failed[0]
    if any(c is None for c in codes):
        return "running", None
    return "succeeded", 0


def torchrun_argv(plan: LaunchPlan, port: int, node_index: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={len(plan.nodes)}",
        f"--nproc-per-node={plan.procs_per_node}",
        # Static: each attempt's nodes and their order are the supervisor's, fixed; node 0's agent hosts the store
        # on ``port`` and the others connect, no more. torchrun's dynamic (c10d) rendezvous polls its state every
        # second while nodes join: most of a relaunch's restart (measured 1.7-2.0 s of it on the reference
        # workload's relaunch).
        "--rdzv-backend=static",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        f"--node-rank={node_index}",
        "--local-addr=127.0.0.1",
        "--max-restarts=0",  # restarts are the supervisor's decision, not torchrun's
        "--monitor-interval=0.1",  # torchrun's default: a dead worker seen in 0.1 s, not 0.5 s
        *plan.entry_argv(),
    ]


def node_contract(plan: LaunchPlan, node: str) -> TrainEnv:
    """The contract as ``node`` sees it: its name, its own store key (``LaunchPlan.for_node``), and its own
    folder of the attempt's heartbeat folder (what its ranks write there names it: recovery reads each node's
    beats and records from its folder)."""
    contract = plan.for_node(node)
    if contract.heartbeat_dir is None:
        return contract
    return replace(contract, heartbeat_dir=node_folder(contract.heartbeat_dir, node))


def node_env(plan: LaunchPlan, node: str, parent: Mapping[str, str] | None = None, gpus: str = "") -> dict[str, str]:
    """A node's agent environment: the allowed part of the worker's, the plan's contract as the node sees it,
    and its GPUs (``CUDA_VISIBLE_DEVICES``; "" hides them all)."""
    env = child_env(
        os.environ if parent is None else parent,
        {
            "GLOO_SOCKET_IFNAME": "lo",
            **plan.script_env,
            **node_contract(plan, node).to_env(),
            "CUDA_VISIBLE_DEVICES": gpus,
        },
        plan.pass_env,
    )
    # Local nodes share this machine's cores: one thread per rank unless told otherwise.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


class LocalLauncher:
    reattaches = False
    """Each node is a child of the task process and dies with it (``die_with_parent``)."""

    def __init__(self, gpus_per_node: int = 0) -> None:
        self.gpus_per_node = gpus_per_node
        """``nodes.gpus_per_node``: each node's share of this host's GPUs."""
        self.active: list[LocalHandle] = []
        """Attempts launched and not yet cancelled, so ``cancel_all`` can end them on a kill."""
        self.zygote: Zygote | None = None
        """Torchrun agents and in-place ranks of any Python script are forks of it (``backends.local.zygote``)."""
        self._zygote_key: tuple[list[str], dict[str, str]] | None = None
        """What ``zygote`` was started with: its command line and environment."""

    def close(self) -> None:
        """Let the zygote go (it exits once its forks have ended); a later launch starts another."""
        if self.zygote is not None:
            self.zygote.close()
            self.zygote = None

    def __del__(self) -> None:
        # The zygote's reader thread keeps it referenced, so without this it (~270 MB, torch imported) lived as long
        # as the process that made the launcher: a test worker collected one per test, 8 GB by half the suite.
        self.close()

    def gpu_split(self, nodes: int, parent: Mapping[str, str] | None = None) -> list[str]:
        """Each node's ``CUDA_VISIBLE_DEVICES``; ``SpecError`` when the host has too few GPUs."""
        parent = os.environ if parent is None else parent
        try:
            return split_visible_devices(host_gpus(parent) if self.gpus_per_node else [], nodes, self.gpus_per_node)
        except ValueError as exc:
            raise SpecError([str(exc)]) from None

    def launch(self, plan: LaunchPlan) -> LocalHandle:
        gpus = self.gpu_split(len(plan.nodes))  # before anything starts: a refused spec leaves nothing behind
        plan.log_dir.mkdir(parents=True, exist_ok=True)
        handle = LocalHandle(plan=plan, port=free_port())
        self.active.append(handle)
        for index, node in enumerate(plan.nodes):
            self._start(handle, node, index, gpus[index])
        if plan.train_env.store:
            log.info("attempt %d: %d node(s) x %d rank(s) group on the store at %s",
                     plan.attempt, len(plan.nodes), plan.procs_per_node, plan.train_env.store)  # fmt: skip
        else:
            log.info("attempt %d: %d node(s) rendezvous on 127.0.0.1:%d", plan.attempt, len(plan.nodes), handle.port)
        return handle

    def _start(self, handle: LocalHandle, node: str, index: int, gpus: str = "") -> None:
        plan = handle.plan
        path = plan.log_dir / f"{node}.log"  # a node's ranks append to its one log, as torchrun's do
        env, cwd = node_env(plan, node, gpus=gpus), plan.local_workdir()
        handle.logs[node] = path
        if not plan.train_env.store:
            handle.ranks[node] = [self._process(plan, torchrun_argv(plan, handle.port, index)[1:], env, path, cwd)]
            return
        # With a coordination store each rank is one plain process that forms its groups there
        # (``trainyard.runtime.elastic``): no torchrun agent and no rendezvous hosted by node 0, so any
        # node can die and the others run on. Each gets torchrun's world environment all the same.
        per_node, world = plan.procs_per_node, len(plan.nodes)
        handle.ranks[node] = [
            self._process(
                plan,
                plan.entry_argv(),
                {**env, **rank_env(index, r, per_node, max(world, index + 1), handle.port)},
                path,
                cwd,
            )
            for r in range(per_node)
        ]

    def _process(self, plan: LaunchPlan, argv: list[str], env: dict[str, str], path: Path, cwd: Path) -> Proc:
        """A node's process running ``python <argv>`` in ``cwd``: forked from the zygote where the zygote has imported
        what it runs (a torchrun agent, a rank of the reference workload or of a script whose framework it
        imported), else a new process."""
        if usable(argv, scripts=plan.framework != "none"):
            # Forked from a process that imported torch already: no start-up, no import's CPU beside training.
            try:
                return self._zygote(env, plan).spawn(argv, env, path, cwd)
            except RuntimeError as exc:
                log.warning("%s: %s; starting it as a new process", env.get("TRAINYARD_NODE", "a node"), exc)
                self.zygote = None
        return self._popen([sys.executable, *argv], env, path, cwd)

    def _popen(self, argv: list[str], env: dict[str, str], path: Path, cwd: Path) -> subprocess.Popen:
        with open_append(path) as out:  # training code may have planted a link for the next attempt
            return subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=cwd,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )

    def _zygote(self, env: Mapping[str, str], plan: LaunchPlan) -> Zygote:
        """The zygote, started with the part of a node's environment that every node shares and importing the
        plan's framework; started again when either changes (a framework may read its environment at import)."""
        shared = {k: v for k, v in env.items() if not k.startswith("TRAINYARD_") and k not in WORLD_NAMES}
        shared.pop("CUDA_VISIBLE_DEVICES", None)  # each node's own; read by torch when CUDA starts, in the rank
        script = plan.local_workdir() / plan.entrypoint if plan.entrypoint.endswith(".py") else None
        argv = zygote_argv(plan.framework, script)
        if self.zygote is None or not self.zygote.alive() or self._zygote_key != (argv, shared):
            if self.zygote is not None:
                self.zygote.close()  # it ends once its forks have; their handles still read their ends from it
            self.zygote = Zygote(shared, preexec_fn=die_with_parent, argv=argv)
            self._zygote_key = (argv, shared)
        return self.zygote

    def add_nodes(self, handle: LocalHandle, nodes: list[str]) -> None:
        """Start ``nodes``, all ranks of each, in the running attempt (joiners of an in-place regroup: they wait on
        the store). A node whose processes are not all gone is left alone (``kill_nodes`` it first)."""
        for node in nodes:
            if all(p.poll() is not None for p in handle.ranks.get(node, [])):
                index = handle.plan.nodes.index(node) if node in handle.plan.nodes else len(handle.ranks)
                self._start(handle, node, index)

    def kill_nodes(self, handle: LocalHandle, nodes: list[str], wait_s: float = 5.0) -> None:
        """SIGKILL these nodes' process trees, every rank's (a stopped process dies too, closing its sockets); the
        others run on."""
        tree = [p for proc in handle.processes(nodes) for p in process_tree(proc.pid)]
        signal_all(tree, signal.SIGKILL)
        for proc in handle.processes(nodes):  # reaped by their own handles first, which keep the code (-9)
            proc.wait(timeout=wait_s)
        ended(tree, wait_s)

    def signal_nodes(self, handle: LocalHandle, nodes: list[str], fault: str, factor: float = 1.0) -> None:
        """Act a drill out on these nodes' process trees from outside (``backends.base.SignalsNodes``)."""
        tree = [p for proc in handle.processes(nodes) for p in process_tree(proc.pid)]
        if fault == "kill":
            signal_all(tree, signal.SIGKILL)
        elif fault == "hang":
            signal_all(tree, signal.SIGSTOP)
        elif fault == "slow":
            threading.Thread(target=duty_cycle, args=(tree, factor, handle.over), daemon=True).start()
        else:
            raise ValueError(f"drill {fault!r} cannot be acted out from outside a process")

    def wait_exit(self, handle: LocalHandle, seconds: float) -> bool:
        """Wait up to ``seconds`` for a running process of the attempt to end (``backends.base.WakesOnExit``): a
        pidfd of each, opened once while it runs (its pid cannot be another process's then), is readable from its
        exit on, reaped or not, whether it is this process's child or the zygote's."""
        fds = []
        for proc in handle.processes():
            if proc.poll() is not None:
                continue
            if proc.pid not in handle.pidfds:
                try:
                    handle.pidfds[proc.pid] = os.pidfd_open(proc.pid)
                except OSError:  # gone since its poll: the next poll sees it
                    return True
            fds.append(handle.pidfds[proc.pid])
        if not fds:
            time.sleep(seconds)
            return False
        return bool(select.select(fds, [], [], seconds)[0])

    def poll(self, handle: LocalHandle) -> AttemptStatus:
        statuses = []
        for node, procs in handle.ranks.items():
            state, code = node_state([proc.poll() for proc in procs])
            statuses.append(NodeStatus(node, state, code, str(handle.logs[node]), host=node))
        return AttemptStatus(statuses)

    def cancel(self, handle: LocalHandle, grace_s: float | None = None) -> None:
        """SIGTERM every node's process tree, then SIGKILL what is left after ``grace_s`` (``end_tree``).

        torchrun starts its workers in sessions of their own, so killing the
        agent's process group is not enough: we collect the whole tree first.
        """
        handle.over.set()  # before the SIGCONT below: a slow drill's cycle must not stop them again
        end_tree([p for proc in handle.processes() for p in process_tree(proc.pid)], grace_s)
        for proc in handle.processes():
            if proc.poll() is None:
                proc.wait(timeout=5)
        if (beats := handle.plan.train_env.heartbeat_dir) is not None:
            for node in handle.ranks:
                drop_local_folder(node_folder(beats, node))
        for fd in handle.pidfds.values():
            os.close(fd)
        handle.pidfds.clear()
        if handle in self.active:
            self.active.remove(handle)

    def attach(self, plan: LaunchPlan) -> LocalHandle:
        """Local attempts cannot be watched from another process: they die with the task that launched them."""
        raise NotImplementedError(
            f"attempt {plan.attempt} of run {plan.run_id}: a local attempt cannot be re-attached (its processes"
            " ended with the task process that launched them); the next attempt is launched instead"
        )

    def exclude(self, nodes: list[str]) -> list[str]:
        """Nothing to mark: a local node is a name, and the next plan simply leaves it out."""
        return []

    def cancel_all(self) -> None:
        """End every attempt still running (the Airflow task is being killed)."""
        for handle in list(self.active):
            self.cancel(handle)


def process_tree(pid: int) -> list[psutil.Process]:
    """``pid`` and all its descendants (torchrun's workers live in sessions of their own)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


CANCEL_GRACE_S = 5.0
"""How long a cancelled attempt's processes get between SIGTERM and SIGKILL unless the caller says otherwise."""


def end_tree(tree: list[psutil.Process], grace_s: float | None = None) -> None:
    """SIGTERM ``tree``, then SIGKILL what is left after ``grace_s`` (None: ``CANCEL_GRACE_S``), and wait for it."""
    signal_all(tree, signal.SIGTERM)
    signal_all(tree, signal.SIGCONT)  # a stopped (hung) process handles its SIGTERM only once resumed
    alive = ended(tree, CANCEL_GRACE_S if grace_s is None else grace_s)
    signal_all(alive, signal.SIGKILL)
    ended(alive, 5.0)


def ended(procs: list[psutil.Process], timeout_s: float, every_s: float = 0.02) -> list[psutil.Process]:
    """Wait up to ``timeout_s`` for ``procs`` to end: those still running. A zombie has ended: its memory (and a
    GPU's) is released at its exit, not when it is reaped; an orphan waits for the host's init to reap it, which
    took ~1 s here (``psutil.wait_procs`` waits for that, and held a relaunch that long)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in procs if _running(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(every_s)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


SLOW_PERIOD_S = 0.2
"""A slow drill's running time per cycle; each is followed by ``factor`` times as long stopped."""


def duty_cycle(procs: list[psutil.Process], factor: float, over: threading.Event) -> None:
    """Stop and continue ``procs`` in turn (a straggler: each step takes ``1 + factor`` times as long) until
    ``over`` is set or they are gone; they are left running."""
    while not over.is_set() and any(p.is_running() for p in procs):
        signal_all(procs, signal.SIGSTOP)
        over.wait(SLOW_PERIOD_S * factor)
        signal_all(procs, signal.SIGCONT)
        time.sleep(SLOW_PERIOD_S)


def signal_all(procs: list[psutil.Process], sig: signal.Signals) -> None:
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
