"""Light burn-in candidates: threads that speak the node's own protocol but only sleep through their probes.

``trainyard.burnin.node.protocol`` runs as it does in a pod (the store, the signed numbered instructions and
answers); ``LIGHT`` replaces its probes (looked up at each call) with sleeps of the time they are given that
report a healthy node and record when they ran (``RAN``). For the protocol's tests and the bench's
thousand-node curves, where real probes (a process each, importing torch) cannot share two cores.
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from trainyard.burnin import node
from trainyard.burnin.probes import Throttle


@dataclass(frozen=True)
class Ran:
    node: str
    what: str
    start: float
    end: float
    seconds: float
    detail: Any = None


# A store client looks up its own socket's name (for its logs); this sandbox has no DNS server, so one lookup
# in ~70 waits out the resolver's 5 s timeout (measured: 256 connects one after another, 4 took 5.0 s). A new
# thread's resolver reads this at its first lookup: 1 s at worst.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

RAN: list[Ran] = []
_LOCK = threading.Lock()


def _record(name: str, what: str, start: float, seconds: float, detail: Any = None) -> None:
    with _LOCK:
        RAN.append(Ran(name, what, start, time.monotonic(), seconds, detail))


def _healthy() -> float:
    return 1.0 + random.uniform(-0.02, 0.02)


def local_figures(args: Any, throttle: Throttle, seconds: float) -> dict[str, Any]:
    start = time.monotonic()
    time.sleep(seconds)
    _record(args.node, "probe", start, seconds)
    return {
        "matmul_gflops": 50 * _healthy(),
        "membw_gbps": 10 * _healthy(),
        "disk_write_mbps": 500 * _healthy(),
        "disk_read_mbps": 900 * _healthy(),
        "gpu": {"skipped": "light candidate"},
    }


def join(store: Any, name: str, members: list[str], timeout_s: float) -> None:
    return None


def allreduce(sizes_kb: list[int], budget_s: float, throttle: Throttle) -> dict[str, float]:
    time.sleep(budget_s)
    return {f"{kb}KB": 2.0 * _healthy() for kb in sizes_kb}


def pairs(
    name: str, members: list[str], rounds: list[list[list[str]]], nbytes: int, budget_s: float, throttle: Throttle
) -> dict[str, float]:
    start = time.monotonic()
    time.sleep(budget_s)
    _record(name, "pairs", start, budget_s, rounds)
    peers = {b if a == name else a for r in rounds for a, b in r if name in (a, b)}
    return {peer: 1.0 * _healthy() for peer in peers}


LIGHT = {"local_figures": local_figures, "join": join, "allreduce": allreduce, "pairs": pairs}


def candidate(args_list: list[str], key: str) -> None:
    """One candidate from its pod's (or process's) arguments and key, until the orchestrator says exit."""
    args = node.parse(args_list)
    host, port = args.store.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=args.timeout))
    try:
        node.protocol(node.SignedStore(store, key), args)
    except Exception:  # the orchestrator stopped waiting (its pod deleted): where a pod would exit
        pass


class ThreadCandidate:
    """A light candidate as the orchestrator's protocol sees one (``burnin.protocol.Candidate``)."""

    def __init__(self, args_list: list[str], key: str):
        self.asked = 0
        self.thread = threading.Thread(target=candidate, args=(args_list, key), daemon=True)
        self.thread.start()

    def alive(self) -> bool:
        self.asked += 1
        return self.thread.is_alive()

    def kill(self) -> None:
        pass  # told to exit by the protocol; a thread cannot be killed

    def why(self, default: str) -> str:
        return default
