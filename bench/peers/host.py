"""The bench's side of the peers: host what they need, start their 3 nodes, bound them, read their ledger.

- torchft: the Lighthouse runs in this process (``torchft.coordination.LighthouseServer``), tuned for a
  3-node run on one machine: ``join_timeout_ms=1000``, ``quorum_tick_ms=100``,
  ``heartbeat_timeout_ms=1000`` (torchft's CLI defaults are 60000, 100 and 5000: with them a dead
  replica would hold the quorum for 5 s).
- NVRx: its TCPStore is hosted here before the nodes start, so its rank 0 (which would host it) finds
  the port taken and joins as a client: killing any node then leaves the store up.

Each peer runs its nodes as plain processes in sessions of their own, under the same bounds as the
torchrun baseline: ``limit_s`` in all, and ``stall_s`` without a new step once the fault has fired.
Whatever is left at the end, and the NVRx monitor processes (which detach themselves, so they are no
descendants), is SIGKILLed by process id.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
from peers.versus import no_fault_step_ms

from trainyard.backends.local.launcher import process_tree, signal_all
from trainyard.events.fold import TrainRun, fold
from trainyard.events.ledger import Ledger
from trainyard.protocol.shards import write_synthetic_corpus
from trainyard.recovery.figures import figures_from

HERE = Path(__file__).resolve().parent
PEERS = {"torchft": "torchft", "nvrx": "nvidia_resiliency_ext"}
"""Peer name -> the package it needs (imported only inside the peer and the hosting below)."""
NODES = 3


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def _hosted(peer: str) -> Iterator[dict[str, str]]:
    """What the peer's nodes connect to, alive for the whole run; the environment that names it."""
    if peer == "torchft":
        os.environ.setdefault("RUST_LOG", "warn")  # read once, at import: the Lighthouse logs every quorum at info
        from torchft.coordination import LighthouseServer

        lighthouse = LighthouseServer(
            bind="[::]:0", min_replicas=2, join_timeout_ms=1000, quorum_tick_ms=100, heartbeat_timeout_ms=1000
        )
        try:
            yield {"TORCHFT_LIGHTHOUSE": lighthouse.address()}
        finally:
            lighthouse.shutdown()
    else:
        import torch.distributed as dist

        port = free_port()
        store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
        try:
            yield {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(NODES)}
        finally:
            del store


def peer_run(peer: str, root: Path, steps: int, at: int, model_args: list[str], limit_s: float,
             stall_s: float) -> dict[str, Any]:  # fmt: skip
    """One peer's figures (``figures_from`` the fold of the events its nodes wrote), or ``ran: false`` and why."""
    if importlib.util.find_spec(PEERS[peer]) is None:
        return {"ran": False, "why": f"{PEERS[peer]} is not installed: pip install -r requirements-bench.txt"}
    data = root / "data"
    write_synthetic_corpus(data, shards=2, tokens_per_shard=16_384)
    ledger = Ledger(root / "events.jsonl")
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "TORCH_CPP_LOG_LEVEL": "ERROR",
        "TRAINYARD_DATA_DIR": str(data),
        "TRAINYARD_CHECKPOINT_DIR": str(root / "ckpt"),  # required by the contract; the peers keep state in memory
        "TRAINYARD_EVENTS_DIR": str(ledger.events_dir),
        "TRAINYARD_PEERS_LEDGER": str(ledger.path),
        "TRAINYARD_MAX_STEPS": str(steps),
        "TRAINYARD_GLOBAL_BATCH": "12",
        "TRAINYARD_MICRO_BATCH": "2",
        "TRAINYARD_DRILLS": json.dumps([{"fault": "kill", "node": "node-1", "step": at}]),
        "TRAINYARD_PEERS": str(NODES),
        "TRAINYARD_PEERS_READY": str(root / "ready"),
        "TRAINYARD_PEERS_PIDS": str(root / "pids"),
    }
    ledger.append("train", "stage_start", peer=peer)
    ledger.append("train", "attempt_start", attempt=1)
    started = time.monotonic()
    stopped, nodes = "", []
    try:
        with _hosted(peer) as hosted:
            for i in range(NODES):
                node = {"TRAINYARD_NODE": f"node-{i}", "RANK": str(i)}
                if peer == "torchft":
                    node |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
                with (root / f"node-{i}.log").open("wb") as log:
                    nodes.append(
                        subprocess.Popen(
                            [sys.executable, str(HERE / f"{peer}_peer.py"), *model_args],
                            env={**env, **hosted, **node},
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,
                        )
                    )
            stopped = _watch(nodes, ledger, started, limit_s, stall_s)
    except Exception as exc:  # hosting or starting failed: the peer says why, with what ran of it
        stopped = f"{type(exc).__name__}: {exc}"
    finally:
        _kill_all(nodes, root / "pids")
    if len(nodes) < NODES:
        return {"ran": False, "why": f"{peer} could not be started: {stopped}"}
    seconds = round(time.monotonic() - started, 3)
    ledger.append("train", "stage_end", seconds=seconds)
    if stopped:
        print(f"{peer}: {stopped}; stopped. Its nodes' last words:", file=sys.stderr)
        for i in range(NODES):
            log_path = root / f"node-{i}.log"
            tail = log_path.read_text(errors="replace").splitlines()[-15:] if log_path.exists() else []
            print(f"--- node-{i}\n" + "\n".join(tail), file=sys.stderr)
    return peer_figures(ledger, [p.returncode for p in nodes], stopped, seconds)


def peer_figures(ledger: Ledger, exits: list[int | None], stopped: str, seconds: float) -> dict[str, Any]:
    """The peer's figures as trainyard's are computed, plus the peer's no-fault median step time."""
    state = fold(ledger.events("train"))  # once, for the figures and what the peer said
    figures = figures_from(state)
    resumed = any(f["resume_delay_s"] is not None for f in figures["failures"])
    finished = not stopped and state.train.finished
    return {
        "ran": True,
        "resume_delay_s": figures["resume_delay_s"],
        "detection_s": figures["detection_s"],
        "lost_steps": figures["lost_steps"] if resumed else None,
        "ettr": figures["ettr"] if finished else None,
        "resumed": resumed,
        "finished": finished,
        "stopped": stopped,
        "step_ms": None if (ms := no_fault_step_ms(state.train)) is None else round(ms, 1),
        "wall_s": seconds,
        "exit_codes": exits,
    }


def _watch(nodes: list[subprocess.Popen[bytes]], ledger: Ledger, started: float, limit_s: float,
           stall_s: float) -> str:  # fmt: skip
    """Wait for every node to exit; why it was stopped instead ("" when the nodes ended on their own)."""
    while any(p.poll() is None for p in nodes):
        if time.monotonic() - started > limit_s:
            return f"not finished within {limit_s:.0f} s"
        train = TrainRun.of(ledger.events("train"))
        fault = train.fired[0].at if train.fired else None
        last = max((e["ts"] for e in train.steps), default=0.0)
        if fault is not None and time.time() - max(fault, last) > stall_s:
            return f"no new step for {stall_s:.0f} s after the fault"
        time.sleep(0.5)
    return ""


def _kill_all(nodes: list[subprocess.Popen[bytes]], pids: Path) -> None:
    """SIGKILL each node's tree, and the detached processes the nodes listed in ``pids`` (NVRx's monitors)."""
    extra = []
    for path in pids.glob("*") if pids.exists() else []:
        try:
            extra.append(psutil.Process(int(path.read_text())))
        except (ValueError, psutil.NoSuchProcess):
            pass
    for node in nodes:
        signal_all(process_tree(node.pid), signal.SIGKILL)
    signal_all(extra, signal.SIGKILL)
    for node in nodes:
        node.wait(timeout=60)  # SIGKILLed: a node still there after a minute is stuck in the kernel, a failed bench
