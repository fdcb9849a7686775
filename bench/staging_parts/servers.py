"""The staging bench's servers and its peer: SeaweedFS (the real S3 server), moto's mock, and rclone's copy.

Apart from ``bench/staging.py`` to keep that module under the house's 400 lines; a folder, since every
``bench/*.py`` is a bench. Every wait here has a bound: a server that does not start or stop, or an rclone
that does not end, fails the bench instead of hanging it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bounds import wait_until

from tools import seaweed

KEY, SECRET, REGION = "bench", "bench-secret", "us-east-1"
START_BOUND_S, STOP_BOUND_S, COPY_BOUND_S = 10.0, 30.0, 1800.0


@dataclass
class Server:
    """An S3 server the bench measures: its name, endpoint and keys, and how to stop it."""

    name: str
    url: str
    key: str
    secret: str
    stop: Callable[[], None]


def real_server() -> Server:
    """SeaweedFS in a folder of its own (deleted at ``stop``)."""
    server = seaweed.start()
    version = subprocess.run(
        [str(seaweed.binary()), "version"], capture_output=True, text=True, timeout=STOP_BOUND_S
    ).stdout.split()
    name = "seaweedfs " + (version[2] if len(version) > 2 else "?")
    return Server(name, server.endpoint, server.access_key, server.secret_key, server.discard)


def moto_server() -> Server:
    proc, port = _moto()

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(timeout=STOP_BOUND_S)
        except subprocess.TimeoutExpired:  # a mock that ignores SIGTERM must not hang the bench
            proc.kill()
            proc.wait(timeout=STOP_BOUND_S)

    return Server("moto (a mock: one Python process)", f"http://127.0.0.1:{port}", KEY, SECRET, stop)


def _moto() -> tuple[subprocess.Popen[bytes], int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def listening() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return True
        except OSError:
            return False

    wait_until(listening, START_BOUND_S, f"moto's server listening on 127.0.0.1:{port}", every_s=0.1)
    return proc, port


def rclone_env(server: Server, tmp: Path) -> dict[str, str]:
    """An rclone remote ``s3:`` from the environment only (no config file is read or written; no key on a
    command line)."""
    env = {k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"}  # plain HTTP: a CA bundle breaks it
    env.update(
        RCLONE_CONFIG=str(tmp / "rclone.conf"),
        RCLONE_CONFIG_S3_TYPE="s3",
        RCLONE_CONFIG_S3_PROVIDER="Other",
        RCLONE_CONFIG_S3_ENDPOINT=server.url,
        RCLONE_CONFIG_S3_ACCESS_KEY_ID=server.key,
        RCLONE_CONFIG_S3_SECRET_ACCESS_KEY=server.secret,
        RCLONE_CONFIG_S3_REGION=REGION,
        RCLONE_CONFIG_S3_FORCE_PATH_STYLE="true",
    )
    return env


def rclone(env: dict[str, str], src: str, dst: Path, flags: list[str]) -> Callable[[], None]:
    def run() -> None:
        done = subprocess.run(
            ["rclone", "copy", src, str(dst), *flags],
            env=env,
            capture_output=True,
            text=True,
            check=False,
            timeout=COPY_BOUND_S,
        )
        if done.returncode != 0:
            raise RuntimeError(f"rclone copy {src} failed ({done.returncode}): {done.stderr[-2000:]}")

    return run
