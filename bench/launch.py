"""Launch overhead: ``launch()`` to the first completed training step, versus bare torchrun.

    python bench/launch.py [--repeats 3] [--smoke]

For 1, 2 and 3 local nodes, the same workload is started (a) through
``LocalLauncher.launch`` and (b) by hand: the torchrun command lines typed out
here and started with ``subprocess``. The clock stops when every rank's
heartbeat shows step 1. ``ratio_vs_torchrun`` is the worst node count's
best-of-N ratio (goal <= 1.1). Prints one JSON line last.

Each node's processes write their node's beat (``node.json``, one writer per node) in their own node folder
of the heartbeat folder, as ``LocalLauncher`` gives it them; the hand-typed torchrun gets the same folders
(a beat written in the heartbeat folder itself is no node's, and no reader takes it). A first step that does
not come within ``FIRST_STEP_BOUND_S`` fails the bench. ``--smoke``: one node, one repeat.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bounds import add_smoke, emit, wait_until
from bounds import main as bounded

from trainyard.backends.base import LaunchPlan
from trainyard.backends.local.launcher import LocalLauncher
from trainyard.protocol.env import TrainEnv
from trainyard.protocol.heartbeat import node_folder, read_heartbeats
from trainyard.protocol.shards import write_synthetic_corpus

ARGS = ["--seq-len", "32", "--d-model", "32", "--n-heads", "2"]
FIRST_STEP_BOUND_S = 180.0
"""Seconds a launch may take to its first step on every rank (3 nodes took 6.6 s on 2 busy cores)."""
STOP_BOUND_S = 30.0
"""Seconds a hand-started torchrun gets to end after SIGTERM before its group is killed."""


def contract(root: Path, data: Path) -> dict[str, str]:
    return {
        "TRAINYARD_DATA_DIR": str(data),
        "TRAINYARD_CHECKPOINT_DIR": str(root / "ckpt"),
        "TRAINYARD_HEARTBEAT_DIR": str(root / "hb"),
        "TRAINYARD_MAX_STEPS": "1000000",
        "TRAINYARD_GLOBAL_BATCH": "12",
        "TRAINYARD_MICRO_BATCH": "2",
        "TRAINYARD_CHECKPOINT_EVERY": "0",
    }


def wait_first_step(hb: Path, ranks: int, started: float) -> float:
    def stepped() -> bool:
        beats = read_heartbeats(hb)
        return len(beats) == ranks and all(b.get("step", 0) >= 1 for b in beats.values())

    wait_until(stepped, FIRST_STEP_BOUND_S, f"a first step on all {ranks} rank(s) in {hb}")
    return time.perf_counter() - started


def with_launcher(root: Path, data: Path, nodes: int) -> float:
    plan = LaunchPlan(
        run_id=root.name,
        attempt=1,
        nodes=[f"node-{i}" for i in range(nodes)],
        procs_per_node=1,
        entrypoint="trainyard.workload",
        args=ARGS,
        train_env=TrainEnv.from_env(contract(root, data)),
        log_dir=root / "logs",
    )
    launcher = LocalLauncher()
    started = time.perf_counter()
    handle = launcher.launch(plan)
    try:
        return wait_first_step(root / "hb", nodes, started)
    finally:
        launcher.cancel(handle)


def hb(root: Path, node: int) -> Path:
    """Node ``node``'s own heartbeat folder, made as the launcher makes it (the runtime writes into it)."""
    folder = node_folder(root / "hb", f"node-{node}")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def by_hand(root: Path, data: Path, nodes: int) -> float:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, **contract(root, data), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={nodes}",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                f"--rdzv-id=bench-{root.name}",
                f"--rdzv-conf=is_host={int(i == 0)}",
                "--local-addr=127.0.0.1",
                "-m",
                "trainyard.workload",
                *ARGS,
            ],
            env={**env, "TRAINYARD_NODE": f"node-{i}", "TRAINYARD_HEARTBEAT_DIR": str(hb(root, i))},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        for i in range(nodes)
    ]
    try:
        return wait_first_step(root / "hb", nodes, started)
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=STOP_BOUND_S)
            except subprocess.TimeoutExpired:  # torchrun that ignores SIGTERM: end its whole group
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=STOP_BOUND_S)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    add_smoke(parser)
    args = parser.parse_args()
    repeats, sizes = (1, (1,)) if args.smoke else (args.repeats, (1, 2, 3))
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        write_synthetic_corpus(data, shards=2, tokens_per_shard=16_384)
        first_step: dict[str, float] = {}
        ratios = []
        for nodes in sizes:
            ours, bare = [], []
            for r in range(repeats):  # interleaved, so drift hits both alike
                ours.append(with_launcher(Path(tmp) / f"l{nodes}-{r}", data, nodes))
                bare.append(by_hand(Path(tmp) / f"b{nodes}-{r}", data, nodes))
            first_step[str(nodes)] = round(min(ours), 3)
            ratios.append(min(ours) / min(bare))
            print(f"{nodes} node(s): launch() {min(ours):.2f} s, bare torchrun {min(bare):.2f} s to the first step")
    emit({"bench": "launch", "ratio_vs_torchrun": round(max(ratios), 3), "first_step_s": first_step})


if __name__ == "__main__":
    bounded(main)
