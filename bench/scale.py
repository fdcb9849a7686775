"""How the checkpoint's costs grow with its size, beside the disk's own speed measured in the same run.

    python bench/scale.py [--sizes 0.1,1,10] [--ranks 64,256,1024] [--k8s 16,128,512] [--repeats 3] [--dir DIR] [--smoke]

For each size, a synthetic DCP checkpoint of that many GB (real bytes on disk, random, in tensors of
at most 64 MB as a model's layers are, written as 4 files as 4 ranks write them):

- ``raw_write_s``: DCP's own ``FileSystemWriter`` writing it (fsynced), no manifest: the floor.
- ``save_to_valid_s``: what a save costs now until the checkpoint is valid: the hashing writer
  (``runtime.dcpwriter``), the manifest from its digests, the rename (``checkpoint.format.commit``).
  ``commit_overhead``: ``save_to_valid_s / raw_write_s - 1`` (goal <= 0.05).
- ``disk_write_mb_per_s`` / ``disk_read_mb_per_s``: ``dd`` of a file of the same size from ``/dev/zero``
  (``conv=fdatasync``; read after the page cache is dropped).
- ``verify_s``: the gate's integrity check (``checkpoint.format.verify``: every file hashed, in parallel)
  from a cold page cache; ``verify_fraction_of_disk``: its MB/s over ``dd``'s read (goal >= 0.8).
- ``inspector_peak_mb``: the largest resident memory of the sandboxed inspector (``python -m
  trainyard.checkpoint.tensors``: every tensor loaded and checked for finite values) (goal <= 1,024 flat).

Cold reads need root (``/proc/sys/vm/drop_caches``); without it both the disk and the verification read from
the page cache, and the output says ``"cold": false``.

For each world size (``--ranks``), ``ranks_N``: the orchestrator beside N simulated ranks at 4 steps/s
(``scale_parts.ranks``: the blocking watch's detection of an exit and of a hang, its CPU share, and the
ledger and run page of one hour; goals: ``detection_s`` <= 2, ``hang_over_timeout_s`` <= 2,
``supervisor_cpu_fraction`` <= 0.10, ``page_s`` < 1).

For each cluster size (``--k8s``), ``k8s_N``: the CPU of one poll of the Kubernetes trigger beside an attempt of
N running pods on the tests' fake API server, and of its start (``scale_parts.k8s``; goal at 512: <= 50 ms), and the
launcher's launch of a relaunched and of an in-place attempt; and the pressure test's whole stage beside N light
candidates (``scale_parts.burnin``: ``burnin_s``, ``burnin_overhead_s`` over the probing time it grants;
goal: each grows at most linearly).

Each figure is the median of ``--repeats``; every run's figures are printed. ``none`` skips a curve. Prints one
JSON line last. ``--smoke``: one run each of 10 MB, 32 ranks (4 nodes: the hung one is node-3) and 4 pods, with 3 s of
steady watch (not 8) and 1 s of granted probing (not 8).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from bounds import add_smoke, emit
from scale_parts.burnin import DURATION_S, stage_time  # bench/ is the script's folder, on the path
from scale_parts.k8s import trigger_poll
from scale_parts.ranks import STEADY_S, one_hour_ledger, one_world
from torch.distributed.checkpoint import FileSystemWriter

from trainyard.checkpoint import format as ckpt_format
from trainyard.runtime.dcpwriter import HashingWriter

TENSOR_MB = 64
FILES = 4
CHILD_BOUND_S = 1800.0
"""Seconds one child process (``dd``, the inspector) may take: 10 GB from a slow disk, not forever."""


def drop_caches() -> bool:
    """Empty the page cache (root only): whether it was."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def state_of(gb: float) -> dict[str, torch.Tensor]:
    """``gb`` GB of float32 in tensors of at most ~``TENSOR_MB`` MB, at least two per file."""
    count = max(2 * FILES, round(gb * 1e9 / (TENSOR_MB << 20)))
    return {f"layers.{i}.weight": torch.randn(int(gb * 1e9 / 4 / count)) for i in range(count)}


def timed(fn: Any) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def dd(path: Path, mb: int) -> tuple[float, float]:
    """``dd``'s sequential write (fdatasync) and cold read of ``mb`` MB, MB/s."""
    write = timed(
        lambda: subprocess.run(
            ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mb}", "conv=fdatasync"],
            check=True,
            capture_output=True,
        )
    )
    drop_caches()
    read = timed(
        lambda: subprocess.run(
            ["dd", f"if={path}", "of=/dev/null", "bs=1M"], check=True, capture_output=True, timeout=CHILD_BOUND_S
        )
    )
    path.unlink()
    return mb / write, mb / read


def inspector_peak_mb(path: Path) -> float:
    """Peak resident memory of one inspection, as the gate's inspector runs it (a process of its own)."""
    done = subprocess.run(
        ["/usr/bin/time", "-f", "%M", sys.executable, "-m", "trainyard.checkpoint.tensors", str(path)],
        check=True,
        capture_output=True,
        text=True,
        timeout=CHILD_BOUND_S,
    )
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    if answer.get("problems"):
        raise AssertionError(f"the synthetic checkpoint failed inspection: {answer['problems']}")
    return int(done.stderr.strip().splitlines()[-1]) / 1024


def one_size(gb: float, root: Path) -> dict[str, Any]:
    state = state_of(gb)
    mb = sum(t.numel() * t.element_size() for t in state.values()) / 1e6
    raw = root / "raw"
    raw_s = timed(lambda: dcp.save(state, storage_writer=FileSystemWriter(raw, thread_count=FILES), no_dist=True))
    shutil.rmtree(raw)

    staging = ckpt_format.prepare_staging(root / "ckpt", 100)

    def save() -> None:
        writer = HashingWriter(staging, thread_count=FILES)
        dcp.save(state, storage_writer=writer, no_dist=True)
        ckpt_format.write_manifest(
            staging, step=100, world_size=FILES, global_batch=8, micro_batch=2, metrics={}, run_id="scale",
            hashed=writer.digests,
        )  # fmt: skip
        ckpt_format.commit(staging, root / "ckpt", 100)

    save_s = timed(save)
    state.clear()  # the tensors are freed before the disk and the verification are measured
    final = ckpt_format.step_dir(root / "ckpt", 100)
    disk_write, disk_read = dd(root / "dd.bin", int(mb))
    cold = drop_caches()
    problems: list[str] = []
    verify_s = timed(lambda: problems.extend(ckpt_format.verify(final)))
    assert not problems, problems
    peak = inspector_peak_mb(final)
    shutil.rmtree(root / "ckpt")
    return {
        "mb": round(mb),
        "raw_write_s": round(raw_s, 3),
        "save_to_valid_s": round(save_s, 3),
        "commit_overhead": round(save_s / raw_s - 1, 3),
        "disk_write_mb_per_s": round(disk_write),
        "disk_read_mb_per_s": round(disk_read),
        "verify_s": round(verify_s, 3),
        "verify_fraction_of_disk": round(mb / verify_s / disk_read, 3),
        "inspector_peak_mb": round(peak),
        "cold": cold,
    }


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, first in runs[0].items():
        if isinstance(first, bool):
            out[key] = all(r[key] for r in runs)
        else:
            out[key] = statistics.median(r[key] for r in runs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="0.1,1,10", help="checkpoint sizes in GB, comma-separated")
    parser.add_argument("--ranks", default="64,256,1024", help="simulated world sizes, comma-separated")
    parser.add_argument("--k8s", default="16,128,512", help="simulated cluster sizes (pods), comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp folder)")
    add_smoke(parser, "one run each of 10 MB, 32 ranks (4 nodes: the hung one is node-3) and 4 pods, shorter waits")
    args = parser.parse_args()
    # The smoke's waits shrink too (its numbers are not judged): 3 s of steady watch, 1 s of granted probing.
    steady_s, probe_s = (3.0, 1.0) if args.smoke else (STEADY_S, DURATION_S)
    if args.smoke:
        args.sizes, args.ranks, args.k8s, args.repeats = "0.01", "32", "4", 1
    root = Path(tempfile.mkdtemp(prefix="trainyard-scale-", dir=args.dir))
    result: dict[str, Any] = {"bench": "scale"}
    try:
        for text in [] if args.sizes == "none" else args.sizes.split(","):
            gb = float(text)
            runs = []
            for _ in range(args.repeats):
                runs.append(one_size(gb, root))
                print(f"ckpt {text} GB: {json.dumps(runs[-1])}", flush=True)
            result[f"ckpt_{text}gb"] = {**median_of(runs), "runs": runs}
        for text in [] if args.ranks == "none" else args.ranks.split(","):
            runs = []
            for i in range(args.repeats):
                runs.append(
                    {**one_world(int(text), root / f"w{i}", steady_s), **one_hour_ledger(root / f"l-{text}-{i}")}
                )
                print(f"ranks {text}: {json.dumps(runs[-1])}", flush=True)
            result[f"ranks_{text}"] = {**median_of(runs), "runs": runs}
        for text in [] if args.k8s == "none" else args.k8s.split(","):
            runs = []
            for i in range(args.repeats):
                runs.append(
                    {**trigger_poll(int(text), root / f"k{i}"), **stage_time(int(text), root / f"k{i}", probe_s)}
                )
                print(f"k8s {text}: {json.dumps(runs[-1])}", flush=True)
            result[f"k8s_{text}"] = {**median_of(runs), "runs": runs}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    emit(result)


if __name__ == "__main__":
    main()
