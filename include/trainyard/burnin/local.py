"""Run the pressure test on local candidate nodes: one process each, on this machine.

A candidate gets an allow-listed environment (``trainyard.backends.local.environ``),
its name and its per-run key, never the Airflow worker's secrets.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from trainyard.atomic import open_append
from trainyard.backends.local.environ import child_env
from trainyard.backends.local.launcher import LocalLauncher, host_gpus
from trainyard.burnin.args import Drill, node_args
from trainyard.burnin.protocol import STARTUP_S, BurnInRun, Schedule, host_store, run_protocol
from trainyard.burnin.sealing import KEY_ENV, node_key, run_secret
from trainyard.burnin.verdict import Recheck
from trainyard.spec import PressureTestSpec


def candidate_env(node: str, key: str, parent: dict[str, str] | None = None, gpus: str | None = None) -> dict[str, str]:
    """What a local candidate's process sees: the allowed part of the worker's environment, its name, its key,
    and its GPUs where the spec splits them (``gpus``, its ``CUDA_VISIBLE_DEVICES``; None leaves the worker's)."""
    own = {"TRAINYARD_NODE": node, "OMP_NUM_THREADS": "1", KEY_ENV: key}
    return child_env(
        os.environ if parent is None else parent, own if gpus is None else {**own, "CUDA_VISIBLE_DEVICES": gpus}
    )


def candidate_gpus(candidates: list[str], gpus_per_node: int, parent: dict[str, str] | None = None) -> dict[str, str]:
    """Each candidate's ``CUDA_VISIBLE_DEVICES``: the host's GPUs split as training splits them
    (``nodes.gpus_per_node``), so a candidate measures a node's share, not the whole host; {} with 0 (every
    candidate sees the worker's GPUs, as before). Spares beyond the host's shares reuse them in turn: local
    candidates probe one at a time, so two never measure one GPU at once. ``SpecError`` if not one share fits."""
    if not gpus_per_node:
        return {}
    shares = len(host_gpus(os.environ if parent is None else parent)) // gpus_per_node
    split = LocalLauncher(gpus_per_node).gpu_split(max(1, min(len(candidates), shares)), parent)
    return {node: split[i % len(split)] for i, node in enumerate(candidates)}


class LocalCandidate:
    def __init__(self, node: str, args: list[str], log: Path, key: str, gpus: str | None = None):
        self.node, self.log = node, log
        with open_append(log) as out:  # never through a link planted in the run folder
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "trainyard.burnin.node", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=candidate_env(node, key, gpus=gpus),
            )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # SIGKILL also ends a stopped (hung) process
        self.proc.wait()

    def why(self, default: str) -> str:
        if self.proc.poll() is None or self.proc.returncode == 0:
            return default
        lines = self.log.read_text(errors="replace").strip().splitlines()
        return f"exited {self.proc.returncode}: {lines[-1][:200] if lines else 'no output'}"


def run_burn_in(
    candidates: list[str],
    cfg: PressureTestSpec,
    scratch: Path,
    log_dir: Path,
    drills: dict[str, tuple[str, float]],
    recheck: Callable[[BurnInRun], Recheck] | None = None,
    *,
    gpus_per_node: int = 0,
) -> BurnInRun:
    """Probe every candidate; ``drills`` maps a node to (fault, factor) for rehearsals; ``gpus_per_node``
    (``nodes.gpus_per_node``) gives each candidate its own GPUs, as training will."""
    gpus = candidate_gpus(candidates, gpus_per_node)  # SpecError before any process starts
    log_dir.mkdir(parents=True, exist_ok=True)
    plan = Schedule.of(cfg, len(candidates))
    store = host_store()
    endpoint = f"127.0.0.1:{store.port}"
    secret = run_secret()
    keys = {node: node_key(secret, node) for node in candidates}
    nodes = {
        node: LocalCandidate(
            node,
            node_args(
                node, endpoint, plan, cfg, str(scratch), plan.budget(cfg), Drill(*drills.get(node, ("none", 0.0)))
            ),
            log_dir / f"{node}.log",
            keys[node],
            gpus.get(node),
        )
        for node in candidates
    }
    return run_protocol(store, nodes, cfg, STARTUP_S, keys, recheck, shared=True)  # one host's cores
