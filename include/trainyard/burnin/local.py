"""Run the pressure test on local candidate nodes: one process each, one store to meet at.

Local "nodes" share this machine's cores, so their local probes take turns
(``go/<node>`` one at a time): run together they would measure the scheduler,
not the node. The collective probe runs with every node that reported. A node
that does not start, report or join within its deadline is dead, and is
killed; nothing outlives the stage.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from trainyard.spec import PressureTestSpec

log = logging.getLogger(__name__)
STARTUP_S = 10.0  # importing torch in several fresh processes on a small machine


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


def _wait(store: dist.Store, key: str, proc: subprocess.Popen, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if store.check([key]):
            return True
        if proc.poll() is not None:
            return store.check([key])
        time.sleep(0.05)
    return False


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # SIGKILL also ends a stopped (hung) process
    proc.wait()


def run_burn_in(
    candidates: list[str], cfg: PressureTestSpec, scratch: Path, log_dir: Path, drills: dict[str, tuple[str, float]]
) -> BurnInRun:
    """Probe every candidate; ``drills`` maps a node to (fault, factor) for rehearsals."""
    started = time.monotonic()
    log_dir.mkdir(parents=True, exist_ok=True)
    plan = Schedule.of(cfg, len(candidates))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    budget = STARTUP_S + cfg.duration_s + 4 * plan.grace_s
    procs = {
        node: subprocess.Popen(
            [sys.executable, "-m", "trainyard.burnin.node", "--node", node, "--store", f"127.0.0.1:{store.port}",
             "--slot", str(plan.slot_s), "--collective-s", str(plan.collective_s), "--size", str(cfg.matmul_size),
             "--membw-mb", str(cfg.membw_mb), "--disk-mb", str(cfg.disk_mb),
             "--sizes-kb", ",".join(map(str, cfg.collective_sizes_kb)), "--scratch", str(scratch),
             "--timeout", str(budget), "--fault", drills.get(node, ("none", 0.0))[0],
             "--factor", str(drills.get(node, ("none", 0.0))[1])],
            stdout=(log_dir / f"{node}.log").open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "TRAINYARD_NODE": node, "OMP_NUM_THREADS": "1"},
        )
        for node in candidates
    }
    result = BurnInRun()
    try:
        ready_by = time.monotonic() + min(cfg.timeout_s, STARTUP_S)
        for node, proc in procs.items():
            if not _wait(store, f"ready/{node}", proc, ready_by):
                result.dead[node] = f"did not start within {min(cfg.timeout_s, STARTUP_S):.0f} s"
        for node, proc in procs.items():
            if node in result.dead:
                continue
            store.set(f"go/{node}", "1")
            if _wait(store, f"local/{node}", proc, time.monotonic() + plan.slot_s + plan.grace_s):
                result.local[node] = json.loads(store.get(f"local/{node}"))
            else:
                result.dead[node] = _why(node, proc, log_dir, f"no report within {plan.slot_s + plan.grace_s:.1f} s")
                _kill(proc)
        members = [n for n in candidates if n in result.local]
        store.set("members", json.dumps(members))
        if len(members) > 1:
            by = time.monotonic() + plan.collective_s + 2 * plan.grace_s + 5
            for node in members:
                if _wait(store, f"collective/{node}", procs[node], by):
                    result.collective[node] = json.loads(store.get(f"collective/{node}"))
                else:
                    result.dead[node] = _why(node, procs[node], log_dir, "did not complete the all-reduce")
    finally:
        for proc in procs.values():
            _kill(proc)
    result.seconds = round(time.monotonic() - started, 3)
    return result


def _why(node: str, proc: subprocess.Popen, log_dir: Path, default: str) -> str:
    """The reason a node is dead: its exit and last log line, else the missed deadline."""
    if proc.poll() is None or proc.returncode == 0:
        return default
    lines = (log_dir / f"{node}.log").read_text(errors="replace").strip().splitlines()
    return f"exited {proc.returncode}: {lines[-1][:200] if lines else 'no output'}"


def drills_from(cfg: PressureTestSpec, environ: dict[str, str] | None = None) -> dict[str, tuple[str, float]]:
    """Drills of the spec plus ``TRAINYARD_BURNIN_DRILLS`` (``node-1=throttle:0.3;node-2=crash``), which wins."""
    drills = {d.node: (d.fault, d.factor) for d in cfg.drills}
    text = (os.environ if environ is None else environ).get("TRAINYARD_BURNIN_DRILLS", "")
    for item in filter(None, (part.strip() for part in text.split(";"))):
        node, _, what = item.partition("=")
        fault, _, factor = what.partition(":")
        if fault not in ("throttle", "crash", "hang"):
            raise ValueError(f"TRAINYARD_BURNIN_DRILLS: {item!r}: fault must be throttle, crash or hang")
        drills[node.strip()] = (fault, float(factor) if factor else 0.3)
    return drills
