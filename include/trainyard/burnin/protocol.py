"""The orchestrator's side of the pressure test, whatever runs the candidates.

Candidates meet at a store this process hosts (see ``trainyard.burnin.node``
for their side). Their local probes take turns (``go/<node>`` one at a time):
local nodes share cores and would otherwise measure the scheduler, and on a
cluster it costs little. Then every node that reported joins the all-reduce.
A node that does not start, report or join within its deadline is dead and
is stopped; nothing outlives the stage. Every value is signed with the
candidate's per-run key (``trainyard.burnin.sealing``): a value someone else
wrote fails the stage, it never decides a node's fate.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch.distributed as dist

from trainyard.burnin.sealing import StoreTampered, seal, unseal
from trainyard.spec import PressureTestSpec

STARTUP_S = 10.0  # importing torch in several fresh processes on a small machine


class Candidate(Protocol):
    """One candidate node's process or pod, as the orchestrator sees it."""

    def alive(self) -> bool: ...

    def kill(self) -> None: ...

    def why(self, default: str) -> str:
        """Why it failed (exit and last words), else ``default`` (the deadline it missed)."""
        ...


@dataclass
class BurnInRun:
    """What each candidate reported; ``dead`` says why a node has no figures."""

    local: dict[str, dict[str, Any]] = field(default_factory=dict)
    collective: dict[str, dict[str, float]] = field(default_factory=dict)
    dead: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass(frozen=True)
class Schedule:
    slot_s: float
    collective_s: float
    grace_s: float

    @classmethod
    def of(cls, cfg: PressureTestSpec, candidates: int) -> Schedule:
        """Split ``duration_s``: 60% for the local probes (in turns), 30% for the collective."""
        return cls(0.6 * cfg.duration_s / max(candidates, 1), 0.3 * cfg.duration_s, min(cfg.timeout_s, 5.0))

    def budget(self, cfg: PressureTestSpec) -> float:
        """How long a candidate may wait on the store before it gives up on the orchestrator."""
        return STARTUP_S + cfg.duration_s + 4 * self.grace_s


def host_store(host: str = "127.0.0.1") -> dist.TCPStore:
    """The store candidates meet at, on a free port of ``host`` (0.0.0.0: reachable from pods)."""
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


def _wait(store: dist.Store, key: str, node: Candidate, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if store.check([key]):
            return True
        if not node.alive():
            return store.check([key])
        time.sleep(0.05)
    return False


def _read(store: dist.Store, key: str, node_key: str) -> str:
    return unseal(node_key, key, store.get(key))


def _dead(store: dist.Store, name: str, node_key: str, why: str) -> str:
    """``why``, unless the candidate said it exited over a forged instruction: then nobody is to blame but the store."""
    key = f"tampered/{name}"
    if store.check([key]):
        raise StoreTampered(f"candidate {name}: {_read(store, key, node_key)}")
    return why


def run_protocol(
    store: dist.Store, nodes: Mapping[str, Candidate], cfg: PressureTestSpec, startup_s: float, keys: dict[str, str]
) -> BurnInRun:
    """Drive started candidates through ready, local probes in turns, and the all-reduce.

    ``keys`` holds each candidate's per-run key: what it signs with, and what
    the orchestrator signs its instructions to it with.
    """
    started = time.monotonic()
    plan = Schedule.of(cfg, len(nodes))
    result = BurnInRun()
    try:
        ready_by = time.monotonic() + min(cfg.timeout_s, startup_s)
        for name, node in nodes.items():
            if _wait(store, f"ready/{name}", node, ready_by):
                _read(store, f"ready/{name}", keys[name])
            else:
                late = f"did not start within {min(cfg.timeout_s, startup_s):.0f} s"
                result.dead[name] = _dead(store, name, keys[name], late)
        for name, node in nodes.items():
            if name in result.dead:
                continue
            store.set(f"go/{name}", seal(keys[name], f"go/{name}", "1"))
            if _wait(store, f"local/{name}", node, time.monotonic() + plan.slot_s + plan.grace_s):
                result.local[name] = json.loads(_read(store, f"local/{name}", keys[name]))
            else:
                result.dead[name] = _dead(
                    store, name, keys[name], node.why(f"no report within {plan.slot_s + plan.grace_s:.1f} s")
                )
                node.kill()
        members = [n for n in nodes if n in result.local]
        for name in nodes:  # each its own copy, signed with its own key
            store.set(f"members/{name}", seal(keys[name], f"members/{name}", json.dumps(members)))
        if len(members) > 1:
            by = time.monotonic() + plan.collective_s + 2 * plan.grace_s + 5
            for name in members:
                if _wait(store, f"collective/{name}", nodes[name], by):
                    result.collective[name] = json.loads(_read(store, f"collective/{name}", keys[name]))
                else:
                    why = nodes[name].why("did not complete the all-reduce")
                    result.dead[name] = _dead(store, name, keys[name], why)
    finally:
        for node in nodes.values():
            node.kill()
    result.seconds = round(time.monotonic() - started, 3)
    return result


def drills_from(cfg: PressureTestSpec, environ: dict[str, str] | None = None) -> dict[str, tuple[str, float]]:
    """Drills of the spec plus ``TRAINYARD_BURNIN_DRILLS`` (``node-1=throttle:0.3;node-2=crash``), which wins."""
    drills: dict[str, tuple[str, float]] = {d.node: (d.fault, d.factor) for d in cfg.drills}
    text = (os.environ if environ is None else environ).get("TRAINYARD_BURNIN_DRILLS", "")
    for item in filter(None, (part.strip() for part in text.split(";"))):
        node, _, what = item.partition("=")
        fault, _, factor = what.partition(":")
        if fault not in ("throttle", "crash", "hang"):
            raise ValueError(f"TRAINYARD_BURNIN_DRILLS: {item!r}: fault must be throttle, crash or hang")
        drills[node.strip()] = (fault, float(factor) if factor else 0.3)
    return drills
