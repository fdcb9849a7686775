"""Run the probe on every local candidate node at once, each in its own process."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

from trainyard.spec import PressureTestSpec

log = logging.getLogger(__name__)


def probe_local(candidates: list[str], cfg: PressureTestSpec) -> dict[str, float | None]:
    """Each candidate's matmul GFLOP/s; ``None`` for one that crashed or overran the timeout."""
    procs = {
        node: subprocess.Popen(
            [sys.executable, "-m", "trainyard.burnin.probe", "--node", node,
             "--size", str(cfg.matmul_size), "--duration", str(cfg.duration_s)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True, env={**os.environ, "TRAINYARD_NODE": node},
        )
        for node in candidates
    }
    deadline = time.monotonic() + cfg.duration_s + cfg.timeout_s
    figures: dict[str, float | None] = {}
    for node, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            log.warning("node %s: probe gave no report within %.0f s", node, cfg.duration_s + cfg.timeout_s)
            figures[node] = None
            continue
        figures[node] = _parse(node, proc.returncode, out, err)
    return figures


def _parse(node: str, code: int, out: str, err: str) -> float | None:
    if code != 0:
        log.warning("node %s: probe exited %d: %s", node, code, err.strip()[-500:])
        return None
    try:
        return float(json.loads(out.strip().splitlines()[-1])["matmul_gflops"])
    except (ValueError, KeyError, IndexError):
        log.warning("node %s: unreadable probe report %r", node, out[-200:])
        return None
