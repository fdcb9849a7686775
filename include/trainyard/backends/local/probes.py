"""The pressure test's probes on this host: one process per candidate node (``LocalProbes``).

A candidate gets an allow-listed environment (``trainyard.backends.local.environ``),
its name, the secrets the pressure test gives it (its per-run key), and its
share of the host's GPUs; never the Airflow worker's secrets.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from trainyard.atomic import open_append
from trainyard.backends.backend import Candidate, Probe, ProbeRun
from trainyard.backends.local.environ import child_env
from trainyard.backends.local.launcher import LocalLauncher, host_gpus


def candidate_env(
    node: str, own: Mapping[str, str], parent: Mapping[str, str] | None = None, gpus: str | None = None
) -> dict[str, str]:
    """What a local candidate's process sees: the allowed part of the worker's environment, its name, ``own``
    (its key), and its GPUs where the spec splits them (``gpus``, its ``CUDA_VISIBLE_DEVICES``; None leaves the
    worker's)."""
    env = {"TRAINYARD_NODE": node, "OMP_NUM_THREADS": "1", **own}
    return child_env(
        os.environ if parent is None else parent, env if gpus is None else {**env, "CUDA_VISIBLE_DEVICES": gpus}
    )


def candidate_gpus(
    candidates: Sequence[str], gpus_per_node: int, parent: Mapping[str, str] | None = None
) -> dict[str, str]:
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
    def __init__(self, node: str, args: list[str], log: Path, env: Mapping[str, str]):
        self.node, self.log = node, log
        with open_append(log) as out:  # never through a link planted in the run folder
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "trainyard.burnin.node", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=dict(env),
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


class LocalProbes:
    """Candidates are slices of this host: they share its cores, and reach the store on the loopback."""

    bind = "127.0.0.1"
    shared = True

    def __init__(self, gpus_per_node: int = 0) -> None:
        self.gpus_per_node = gpus_per_node

    def reach(self) -> str:
        return self.bind

    def scratch(self, hot_root: Path) -> str:
        return str(hot_root)

    def startup_s(self, default_s: float, timeout_s: float) -> float:
        return default_s

    def start(self, probes: Sequence[Probe], run: ProbeRun) -> dict[str, Candidate]:
        gpus = candidate_gpus([p.node for p in probes], self.gpus_per_node)  # SpecError before any process starts
        for p in probes:
            p.log.parent.mkdir(parents=True, exist_ok=True)
        return {
            p.node: LocalCandidate(p.node, p.args, p.log, candidate_env(p.node, p.env, gpus=gpus.get(p.node)))
            for p in probes
        }
