"""Staging throughput, side by side with its baselines on the same data in one run.

    python bench/staging.py [--mb 256]

Data: half as 64 small shards, half as 4 large objects (256 MB by default).
- local -> local: ``stage`` (verified: hashed on read and after write) vs ``cp -r``;
  ``ratio_vs_cp`` = cp's time / ours (goal >= 0.8).
- S3 -> local: ``stage`` vs a sequential ``fget_object`` loop with the same client,
  against an S3 server in its own process (moto's; MinIO has no installable binary
  here); ``speedup_vs_sequential_fget`` (goal >= 1.5).
- re-staging the unchanged dataset: ``restage_fraction`` of the full S3 stage (goal <= 0.03).
Each timing is the best of ``--repeats``. Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from trainyard.storage import LocalTier, S3Settings, S3Tier
from trainyard.storage.staging import stage


def make_data(root: Path, total_mb: int) -> None:
    root.mkdir(parents=True)
    half = total_mb << 19  # bytes in half the data
    block = os.urandom(1 << 20)
    for i in range(64):
        (root / f"shard_{i:03d}.tok").write_bytes((block * (half // 64 // len(block) + 1))[: half // 64 - i])
    for i in range(4):
        (root / f"large_{i}.bin").write_bytes(os.urandom(half // 4))


def best(repeats: int, run: Callable[[], None], reset: Callable[[], None]) -> float:
    times = []
    for _ in range(repeats):
        reset()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def s3_server() -> tuple[subprocess.Popen, int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, port
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("moto server did not start")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-staging-"))
    proc, port = s3_server()
    try:
        cold, hot, copy = tmp / "cold", tmp / "hot", tmp / "copy"
        make_data(cold, args.mb)
        size = sum(p.stat().st_size for p in cold.iterdir())

        def clear(*paths: Path) -> Callable[[], None]:
            return lambda: [shutil.rmtree(p, ignore_errors=True) for p in paths]

        t_cp = best(args.repeats, lambda: subprocess.run(["cp", "-r", str(cold), str(copy)], check=True), clear(copy))
        t_local = best(args.repeats, lambda: stage(LocalTier(cold), hot), clear(hot))

        settings = S3Settings.from_endpoint_url(f"http://127.0.0.1:{port}", "bench", "bench-secret", "us-east-1")
        tier = S3Tier("s3://bench/data", settings)
        tier.client.make_bucket("bench")
        for path in sorted(cold.iterdir()):
            tier.upload(path, path.name)  # sha256 travels as metadata
        names = [o.key for o in tier.list()]
        fetch = tmp / "fetch"

        def sequential() -> None:
            for name in names:
                tier.client.fget_object("bench", f"data/{name}", str(fetch / name))

        t_seq = best(args.repeats, sequential, clear(fetch))
        t_s3 = best(args.repeats, lambda: stage(tier, hot), clear(hot))
        stage(tier, hot)
        t_restage = best(args.repeats, lambda: stage(tier, hot), lambda: None)
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)

    mb = size / 1e6
    print(f"{mb:.0f} MB in {len(names)} objects")
    print(f"local->local: cp -r {t_cp:.2f} s, stage {t_local:.2f} s ({mb / t_local:.0f} MB/s, verified)")
    print(f"S3->local:    sequential fget {t_seq:.2f} s, stage {t_s3:.2f} s ({mb / t_s3:.0f} MB/s)")
    print(f"re-stage unchanged: {t_restage * 1000:.0f} ms")
    print(
        json.dumps(
            {
                "bench": "staging",
                "ratio_vs_cp": round(t_cp / t_local, 3),
                "speedup_vs_sequential_fget": round(t_seq / t_s3, 3),
                "restage_fraction": round(t_restage / t_s3, 4),
                "mb_per_s": round(mb / t_s3, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
