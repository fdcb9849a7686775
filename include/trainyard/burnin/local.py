"""Run the pressure test on local candidate nodes: one process each, on this machine.

A candidate gets an allow-listed environment (``trainyard.launch.environ``),
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
from trainyard.burnin.args import Drill, node_args
from trainyard.burnin.protocol import STARTUP_S, BurnInRun, Schedule, host_store, run_protocol
from trainyard.burnin.sealing import KEY_ENV, node_key, run_secret
from trainyard.burnin.verdict import Recheck
from trainyard.launch.environ import child_env
from trainyard.spec import PressureTestSpec


def candidate_env(node: str, key: str, parent: dict[str, str] | None = None) -> dict[str, str]:
    """What a local candidate's process sees: the allowed part of the worker's environment, its name, its key."""
    return child_env(
        os.environ if parent is None else parent, {"TRAINYARD_NODE": node, "OMP_NUM_THREADS": "1", KEY_ENV: key}
    )


class LocalCandidate:
    def __init__(self, node: str, args: list[str], log: Path, key: str):
        self.node, self.log = node, log
        with open_append(log) as out:  # never through a link planted in the run folder
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "trainyard.burnin.node", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=candidate_env(node, key),
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
) -> BurnInRun:
    """Probe every candidate; ``drills`` maps a node to (fault, factor) for rehearsals."""
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
        )
        for node in candidates
    }
    return run_protocol(store, nodes, cfg, STARTUP_S, keys, recheck, shared=True)  # one host's cores
