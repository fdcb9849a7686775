"""Pressure-test benchmark: harness overhead and straggler detection.

    python bench/burnin.py [--trials 20] [--duration 4]

(a) ``probe_ratio``: the compute probe's GFLOP/s over a bare ``torch.mm`` loop
    on the same matrices in the same process (goal >= 0.95: the harness adds
    nothing). On a GPU, also bf16 TFLOP/s as a fraction of the 989 TFLOP/s
    H100/H200 dense peak.
(b) ``trials`` randomized burn-ins of 3 to 4 local candidates, one random node
    throttled by 20%: ``detected_fraction`` (goal 1.0) and ``false_evictions``
    (goal 0).
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from trainyard.burnin.local import run_burn_in
from trainyard.burnin.probes import matmul_gflops
from trainyard.burnin.verdict import Rule, decide
from trainyard.spec import PROBES, PressureTestSpec

H100_BF16_DENSE_TFLOPS = 989.0


def bare_mm_gflops(size: int, seconds: float) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        iters += 1
    return 2.0 * size**3 * iters / (time.perf_counter() - start) / 1e9


def harness_ratio(size: int = 256, seconds: float = 2.0, rounds: int = 3) -> float:
    torch.set_num_threads(1)
    bare = max(bare_mm_gflops(size, seconds) for _ in range(rounds))
    probe = max(matmul_gflops(size, seconds) for _ in range(rounds))
    print(f"matmul {size}: bare torch.mm {bare:.1f} GFLOP/s, probe {probe:.1f} GFLOP/s")
    return probe / bare


def gpu_fraction() -> float | None:
    if not torch.cuda.is_available():
        return None
    tflops = matmul_gflops(8192, 5.0, device="cuda", dtype=torch.bfloat16) / 1e3
    print(f"bf16 matmul: {tflops:.1f} TFLOP/s")
    return tflops / H100_BF16_DENSE_TFLOPS


def trials(count: int, duration: float, seed: int) -> tuple[int, int, list[dict]]:
    rng = random.Random(seed)
    cfg = PressureTestSpec(duration_s=duration, matmul_size=128, membw_mb=16, disk_mb=32, collective_sizes_kb=[64])
    rules = [Rule(p, cfg.floor(p), cfg.ratio(p)) for p in PROBES]
    detected = false = 0
    log = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(count):
            nodes = [f"node-{j}" for j in range(rng.choice([3, 4]))]
            slow = rng.choice(nodes)
            probed = run_burn_in(nodes, cfg, Path(tmp) / "hot", Path(tmp) / f"logs-{i}", {slow: ("throttle", 0.2)})
            verdict = decide({n: probed.local.get(n) for n in nodes}, len(nodes), rules, probed.dead)
            hit = slow in verdict.evicted
            wrong = [n for n in verdict.evicted if n != slow]
            detected += hit
            false += len(wrong)
            log.append({"nodes": len(nodes), "slow": slow, "detected": hit, "false": wrong})
            print(
                f"trial {i + 1:2d}: {len(nodes)} nodes, {slow} throttled 20%: "
                f"{'detected' if hit else 'MISSED'}{', false: ' + ', '.join(wrong) if wrong else ''}"
            )
    return detected, false, log


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    ratio = harness_ratio()
    gpu = gpu_fraction()
    detected, false, _ = trials(args.trials, args.duration, args.seed)
    result = {
        "bench": "burnin",
        "probe_ratio": round(ratio, 3),
        "detected_fraction": detected / args.trials,
        "false_evictions": false,
        "trials": args.trials,
    }
    if gpu is not None:
        result["bf16_fraction_of_peak"] = round(gpu, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
