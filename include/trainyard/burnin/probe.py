"""The probe that runs on one candidate node: ``python -m trainyard.burnin.probe``.

It prints one JSON line with its figures, so the caller needs no shared state
with the node: the same contract serves a local process and a pod's log.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def matmul_gflops(size: int, duration_s: float) -> float:
    """Sustained fp32 matmul throughput over ``duration_s`` (after one warm-up product)."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    torch.mm(a, b)  # warm-up: first call pays for allocation and kernel choice
    iters, start = 0, time.perf_counter()
    deadline = start + duration_s
    while True:
        torch.mm(a, b)
        iters += 1
        now = time.perf_counter()
        if now >= deadline:
            break
    return 2.0 * size**3 * iters / (now - start) / 1e9


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--node", required=True)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    # One thread per local node: candidates share this machine's cores, as ranks will.
    torch.set_num_threads(args.threads)
    gflops = matmul_gflops(args.size, args.duration)
    print(json.dumps({"node": args.node, "matmul_gflops": round(gflops, 3)}), flush=True)


if __name__ == "__main__":
    main()
