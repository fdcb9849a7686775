"""Checkpoint verification speed, and its share of training time in a demo-sized run.

    python bench/ckpt_verify.py [--gb 1.0] [--smoke]

(a) A DCP checkpoint of about ``--gb`` GB written as 4 files: ``validate``
    (parallel sha256 of every file, DCP load on CPU, finiteness of every
    tensor) versus ``sha256sum`` over the same files, best of 2 each, page
    cache warm for both. ``speedup_vs_sha256sum`` (goal >= 1.5).
(b) The demo pipeline's stages run without Airflow, the checkpoint gate in a
    fresh process as an Airflow task would: the seconds the ledger records for
    validation (the background validator and the gate) over the train stage's
    seconds: ``validation_fraction`` (goal <= 0.05), and the same without the
    gate's one-off great-expectations import (``validation_fraction_warm``).
Prints one JSON line last. ``--smoke``: (a) at 10 MB, and no (b) (a whole demo pipeline is minutes; its
fractions are null).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from bounds import add_smoke, emit
from torch.distributed.checkpoint import FileSystemWriter

from trainyard.checkpoint.format import write_manifest
from trainyard.checkpoint.validate import validate
from trainyard.pipeline import stages
from trainyard.pipeline.run import open_run
from trainyard.protocol.shards import write_synthetic_corpus

ROOT = Path(__file__).resolve().parents[1]
SMOKE_GB = 0.01
SMOKE_HELP = "(a) at 10 MB, without (b): the demo pipeline's train stage alone is minutes"
GATE_BOUND_S = 600.0
"""Seconds the checkpoint gate's fresh process may take (a bench that waits forever is a failed one)."""


def best(runs: int, fn) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def check_valid(path: Path) -> None:
    result = validate(path)
    if not result.valid:
        raise AssertionError(result.problems)


def verify_speed(gb: float, tmp: Path) -> tuple[float, float, float]:
    path = tmp / "step_000100"
    tensors = {f"layer{i}": torch.randn(int(gb * 1e9 / 16)) for i in range(4)}
    dcp.save(tensors, storage_writer=FileSystemWriter(path, thread_count=4), no_dist=True)  # 4 files, as 4 ranks write
    write_manifest(path, step=100, world_size=1, global_batch=8, micro_batch=8, metrics={"loss": 1.0}, run_id="bench")
    files = [str(p) for p in sorted(path.iterdir()) if p.is_file()]
    size = sum(os.path.getsize(f) for f in files)
    subprocess.run(["sha256sum", *files], check=True, capture_output=True)  # warm the page cache for both
    t_sum = best(2, lambda: subprocess.run(["sha256sum", *files], check=True, capture_output=True))
    t_ours = best(2, lambda: check_valid(path))
    return size / 1e9, t_sum, t_ours


def demo_fraction(tmp: Path) -> tuple[float, float]:
    os.environ["TRAINYARD_HOME"] = str(tmp / "home")
    write_synthetic_corpus(tmp / "home" / "cold" / "tokens" / "2026-11-28", shards=4)
    run = open_run(ROOT / "dags" / "pipelines" / "nightly_pretrain.yaml", "nightly_pretrain", "bench", "2026-11-28")
    stages.stage_dataset(run)
    stages.check_dataset(run)
    chosen = stages.burn_in(run)
    trained = stages.train(run, chosen.healthy)
    gate = (
        "import sys, time; t = time.monotonic(); import great_expectations; print(time.monotonic() - t);"
        "from trainyard.pipeline import stages; from trainyard.pipeline.run import open_run;"
        "run = open_run(sys.argv[1], 'nightly_pretrain', 'bench', '2026-11-28');"
        "stages.check_checkpoint(run, sys.argv[2], int(sys.argv[3]))"
    )
    # Time the import separately in the same fresh process, then the gate (which finds GX imported).
    done = subprocess.run(
        [sys.executable, "-c", gate, str(run.spec_path), trained.checkpoint, str(trained.target_step)],
        check=True,
        capture_output=True,
        text=True,
        timeout=GATE_BOUND_S,
    )
    gx_import = float(done.stdout.strip().splitlines()[-1])
    train_s = next(e["seconds"] for e in run.ledger.events("train", "stage_end"))
    background = sum(e["seconds"] for e in run.ledger.events("train", "checkpoint_validated"))
    gate_s = next(e["seconds"] for e in run.ledger.events("check_checkpoint", "stage_end"))
    return background + gate_s, gx_import, train_s


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=1.0)
    add_smoke(parser, SMOKE_HELP)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    try:
        gb, t_sum, t_ours = verify_speed(SMOKE_GB if args.smoke else args.gb, tmp)
        demo = None if args.smoke else demo_fraction(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{gb:.2f} GB: sha256sum {t_sum:.2f} s, trainyard validate {t_ours:.2f} s (hashes + load + finiteness)")
    fractions: dict[str, float | None] = {"validation_fraction": None, "validation_fraction_warm": None}
    if demo is not None:
        validation_s, gx_import_s, train_s = demo
        print(
            f"demo run: validation {validation_s:.2f} s + great-expectations import {gx_import_s:.2f} s"
            f" against train {train_s:.2f} s"
        )
        fractions = {
            "validation_fraction": round((validation_s + gx_import_s) / train_s, 4),
            "validation_fraction_warm": round(validation_s / train_s, 4),
        }
    emit(
        {
            "bench": "ckpt_verify",
            "speedup_vs_sha256sum": round(t_sum / t_ours, 3),
            "gb_per_s": round(gb / t_ours, 3),
            **fractions,
        }
    )


if __name__ == "__main__":
    main()
