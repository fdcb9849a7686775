"""``make demo-s3``: the S3 example spec (``examples/specs/s3_pretrain.yaml``) end to end on a local SeaweedFS.

What ``make demo`` does with ``file://`` tiers, with the spec's cold tier (the
data and the published checkpoints) in a real S3 server that this module
starts (``tools.seaweed``) and stops: nothing to set up by hand.

1. SeaweedFS on free ports of 127.0.0.1, in a temp folder, with the bucket
   ``trainyard-cold``.
2. The demo corpus's partition for ``--date`` written locally, then put into
   ``s3://trainyard-cold/tokens/<date>`` with ``trainyard upload``.
3. ``airflow dags test s3_pretrain <date>`` on a DAGs folder holding the
   example spec as it is, the connection ``trainyard_cold`` pointing at the
   server (``AIRFLOW_CONN_TRAINYARD_COLD``: its endpoint, no login, so the
   AWS credential chain finds the keys in ``AWS_ACCESS_KEY_ID`` /
   ``AWS_SECRET_ACCESS_KEY``). The keys travel in the environment only, never
   on a command line; training processes never see them (their environment
   is an allow-list).
4. ``trainyard summary`` of the run, and the published copy listed in S3.

The server and its folder are deleted after, whatever happened.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tools import seaweed

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "examples" / "specs" / "s3_pretrain.yaml"
BUCKET = "trainyard-cold"
DAG_ID = "s3_pretrain"


def dags_folder(home: Path) -> Path:
    """A DAGs folder of the project's DAG file and the example spec alone (dags/pipelines/ stays as it is)."""
    folder = home / "demo-s3" / "dags"
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "pipelines").mkdir(parents=True)
    shutil.copy(ROOT / "dags" / "pipelines.py", folder)
    shutil.copy(SPEC, folder / "pipelines" / f"{DAG_ID}.yaml")
    return folder


def environment(server: seaweed.Seaweed, dags: Path) -> dict[str, str]:
    connection = {"conn_type": "aws", "extra": {"endpoint_url": server.endpoint, "region_name": seaweed.REGION}}
    return {
        **os.environ,
        "AWS_ENDPOINT_URL_S3": server.endpoint,
        "AWS_ACCESS_KEY_ID": server.access_key,
        "AWS_SECRET_ACCESS_KEY": server.secret_key,
        "AWS_REGION": seaweed.REGION,
        "AIRFLOW_CONN_TRAINYARD_COLD": json.dumps(connection),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
    }


def run(argv: list[str], env: dict[str, str], log: Path | None = None) -> None:
    print("+", " ".join(argv), flush=True)
    if log is None:
        subprocess.run(argv, env=env, check=True)
        return
    with open(log, "w") as out:
        done = subprocess.run(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        print(log.read_text(errors="replace")[-6000:], file=sys.stderr)
        raise subprocess.CalledProcessError(done.returncode, argv)


def demo(date: str, home: Path) -> None:
    server = seaweed.start()
    try:
        print(f"SeaweedFS S3 on {server.endpoint} (folder {server.folder})", flush=True)
        seaweed.make_buckets(server, [BUCKET])
        env = environment(server, dags_folder(home))
        corpus = home / "demo-s3" / "cold"
        bin_ = Path(sys.executable).parent
        run([str(bin_ / "trainyard"), "demo-data", "--date", date, "--cold", str(corpus)], env)
        tokens = f"s3://{BUCKET}/tokens/{date}"
        run([str(bin_ / "trainyard"), "upload", str(corpus / "tokens" / date), tokens], env)
        run([str(bin_ / "airflow"), "dags", "test", DAG_ID, date], env, home / "demo-s3-dags-test.log")
        run([str(bin_ / "trainyard"), "summary", "--dag-id", DAG_ID, "--latest"], env)
        run([str(bin_ / "trainyard"), "ls", f"s3://{BUCKET}/checkpoints/{DAG_ID}"], env)
    finally:
        server.discard()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.demo_s3", description=__doc__.split("\n\n")[0])
    parser.add_argument("--date", required=True, help="the partition to stage and train on (YYYY-MM-DD)")
    args = parser.parse_args(argv)
    home = Path(os.environ.get("TRAINYARD_HOME", ROOT / ".trainyard")).resolve()
    home.mkdir(parents=True, exist_ok=True)
    try:
        demo(args.date, home)
    except seaweed.SeaweedUnavailable as exc:
        print(f"make demo-s3: {exc}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as exc:
        print(f"make demo-s3: {exc.cmd[0]} {exc.cmd[1]} failed (exit {exc.returncode})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
