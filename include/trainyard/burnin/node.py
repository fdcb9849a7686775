"""One candidate node's side of the pressure test: ``python -m trainyard.burnin.node``.

The protocol runs over a key-value store the orchestrator hosts, so it is the
same for a local process and a pod. The node says ``ready/<node>``, then
carries out numbered instructions ``do/<node>/<i>`` and answers each under
``done/<node>/<i>``:

- ``probe``: one turn of the local probes, a few each (on one host the
  candidates take turns, on a cluster all probe at once; either way a
  machine whose speed drifts drifts for all of them; and again in a
  confirmation round);
- ``join``: join the nodes that reported in a gloo group;
- ``allreduce``: the group's all-reduce bus bandwidth;
- ``pairs``: point-to-point bandwidth with each partner of a schedule of
  rounds of disjoint pairs, which says *whose* link is slow where an
  all-reduce only says the ring is;
- ``exit``.

Every value is signed with the node's per-run key, read from
``TRAINYARD_BURNIN_KEY`` (``trainyard.burnin.sealing``): an instruction the
orchestrator did not sign is refused (the node says so under
``tampered/<node>`` and exits 3). Drills act here, so a rehearsal fails in the
same place a real node would.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import statistics
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainyard.burnin.gpu import gpu_checks
from trainyard.burnin.probes import Throttle, busbw_gbps, disk_mbps, matmul_gflops, memory_gbps, pair_gbps
from trainyard.burnin.sealing import KEY_ENV, StoreTampered, seal, unseal

TAMPERED_EXIT = 3


def local_figures(args: argparse.Namespace, throttle: Throttle, seconds: float) -> dict[str, Any]:
    """One turn of the local probes, ``seconds`` in all."""
    share = seconds / 3
    write, read = disk_mbps(Path(args.scratch), args.disk_mb, share, throttle)
    return {
        # one window per turn: the orchestrator takes the median over the turns
        "matmul_gflops": round(matmul_gflops(args.size, share, throttle, windows=1), 3),
        "membw_gbps": round(memory_gbps(args.membw_mb, share, throttle, windows=1), 3),
        "disk_write_mbps": round(write, 1),
        "disk_read_mbps": round(read, 1),
        "gpu": gpu_checks(share, throttle),
    }


def join(store: dist.Store, node: str, members: list[str], timeout_s: float) -> None:
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("pg", store),
        rank=members.index(node),
        world_size=len(members),
        timeout=timedelta(seconds=timeout_s),
    )


def allreduce(sizes_kb: list[int], budget_s: float, throttle: Throttle) -> dict[str, float]:
    return {f"{kb}KB": round(busbw_gbps(kb << 10, budget_s / len(sizes_kb), throttle), 4) for kb in sizes_kb}


def pairs(
    node: str, members: list[str], rounds: list[list[list[str]]], nbytes: int, budget_s: float, throttle: Throttle
) -> dict[str, float]:
    """Bandwidth with each partner this node meets in ``rounds``; every member keeps the rounds in step.

    A partner met in several rounds (turns) counts with the median of them:
    each turn is one window, as a local probe's turn is.
    """
    seen: dict[str, list[float]] = {}
    for pairs_of_round in rounds:
        for a, b in pairs_of_round:
            if node in (a, b):
                peer = b if node == a else a
                gbps = pair_gbps(members.index(peer), node == a, nbytes, budget_s / len(rounds), throttle, windows=1)
                seen.setdefault(peer, []).append(gbps)
        dist.barrier()  # the next round starts together: a pair never shares its links with the last round's
    return {peer: round(statistics.median(values), 4) for peer, values in seen.items()}


def act_out(fault: str) -> None:
    """Crash or hang on purpose (a drill): exactly what a broken node does to the protocol."""
    if fault == "crash":
        raise SystemExit(f"drill: node crashed on purpose ({os.environ.get('TRAINYARD_NODE')})")
    if fault == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)


def throttles(args: argparse.Namespace) -> tuple[Throttle, Throttle]:
    """(local probes, collective traffic): a ``throttle`` drill slows the first, ``slow_link`` the second.

    A ``blip`` slows only the first round of local probes: a burst of someone
    else's work, which the confirmation round must clear.
    """
    return (
        Throttle(args.factor if args.fault in ("throttle", "blip") else 0.0),
        Throttle(args.factor if args.fault == "slow_link" else 0.0),
    )


class SignedStore:
    """This node's view of the store: what it writes is sealed with its key, what it reads must be."""

    def __init__(self, store: dist.Store, key: str):
        self.store, self.key = store, key

    def set(self, name: str, payload: str) -> None:
        self.store.set(name, seal(self.key, name, payload))

    def get(self, name: str) -> str:
        return unseal(self.key, name, self.store.get(name))


def protocol(signed: SignedStore, args: argparse.Namespace) -> None:
    signed.set(f"ready/{args.node}", "1")
    local, link = throttles(args)
    members: list[str] = []
    try:
        for i in itertools.count():
            order = json.loads(signed.get(f"do/{args.node}/{i}"))
            what = order["do"]
            if what == "exit":
                return
            if what == "probe":
                if i == 0:
                    act_out(args.fault)
                blip_over = args.fault == "blip" and order["round"] > 1
                answer: Any = local_figures(args, Throttle() if blip_over else local, order["seconds"])
            elif what == "join":
                members = order["members"]
                join(signed.store, args.node, members, args.timeout)
                answer = "joined"
            elif what == "allreduce":
                answer = allreduce([int(s) for s in args.sizes_kb.split(",")], args.collective_s, link)
            elif what == "pairs":
                answer = pairs(args.node, members, order["rounds"], order["bytes"], order["seconds"], link)
            else:
                raise SystemExit(f"unknown instruction {what!r} from the orchestrator")
            signed.set(f"done/{args.node}/{i}", json.dumps(answer))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The node's arguments, as ``trainyard.burnin.args.node_args`` writes them."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--node", required=True)
    p.add_argument("--store", required=True, help="host:port of the orchestrator's store")
    p.add_argument("--collective-s", type=float, required=True)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--membw-mb", type=int, default=64)
    p.add_argument("--disk-mb", type=int, default=64)
    p.add_argument("--sizes-kb", default="64,1024,8192")
    p.add_argument("--scratch", required=True, help="a folder on the hot tier")
    p.add_argument("--timeout", type=float, default=60)
    p.add_argument("--fault", choices=["none", "throttle", "blip", "slow_link", "crash", "hang"], default="none")
    p.add_argument("--factor", type=float, default=0.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    torch.set_num_threads(1)  # local nodes share this machine's cores, as ranks will
    host, port = args.store.rsplit(":", 1)
    key = os.environ.get(KEY_ENV, "")
    if not re.fullmatch(r"[0-9a-f]{64}", key):
        raise SystemExit(f"{KEY_ENV} must hold this node's per-run key (64 hex digits); the orchestrator sets it")
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=args.timeout))
    signed = SignedStore(store, key)
    try:
        protocol(signed, args)
    except StoreTampered as exc:
        signed.set(f"tampered/{args.node}", str(exc))
        print(f"refused: {exc}", flush=True)
        raise SystemExit(TAMPERED_EXIT) from None


if __name__ == "__main__":
    main()
