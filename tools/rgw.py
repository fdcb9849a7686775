"""A throwaway Ceph RADOS Gateway (RGW) in one folder, on 127.0.0.1, for ``make test-rgw``.

A second real S3 implementation beside SeaweedFS (``tools.seaweed``), one that
differs where S3 servers differ: Debian's Ceph Pacific (16.2) keeps no flexible
checksums (``x-amz-checksum-*``) and answers a CompleteMultipartUpload with an
empty ETag (HEAD and LIST give the right one). This module owns a minimal
single-host cluster and its folder::

    FOLDER/ceph.conf   the cluster's settings (fsid generated, cephx, pool size 1)
    FOLDER/keyring     the mon., client.admin and osd.0 keys (0600)
    FOLDER/mon, osd    one monitor's store; one OSD on memstore (in memory: gone when the OSD stops)
    FOLDER/log         each daemon's log; FOLDER/run its pid files and admin sockets

One monitor, one OSD and ``radosgw`` (beast frontend) each run in the
foreground as a child of this process; the monitor and the gateway listen on
free ports of 127.0.0.1 only. One S3 user is made with ``radosgw-admin``.
``stop()`` and ``start()`` stop and start the gateway only (the S3 server goes
away and comes back; the cluster behind it, and so the buckets, stay).

``python -m tools.rgw`` runs one in the foreground until interrupted.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

START_TIMEOUT_S = 60
STOP_TIMEOUT_S = 15
REGION = "us-east-1"
BINARIES = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "ceph", "ceph-authtool", "monmaptool")
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1, never through an http_proxy


class RgwUnavailable(RuntimeError):
    """Ceph RGW cannot run here; the message says why and what to do."""


def check() -> None:
    """Raise ``RgwUnavailable`` naming what is missing unless every Ceph binary is on PATH."""
    missing = [name for name in BINARIES if shutil.which(name) is None]
    if missing:
        raise RgwUnavailable(f"missing {', '.join(missing)}: apt-get install radosgw ceph-mon ceph-osd (needs root)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(folder: Path, fsid: str, mon_port: int) -> str:
    return f"""[global]
fsid = {fsid}
mon host = v2:127.0.0.1:{mon_port}
mon initial members = a
public addr = 127.0.0.1
cluster addr = 127.0.0.1
ms bind ipv6 = false
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
auth allow insecure global id reclaim = false
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
mon max pg per osd = 1000
mon allow pool size one = true
mon warn on pool no redundancy = false
mon data avail warn = 1
mon data avail crit = 0
osd crush chooseleaf type = 0
osd objectstore = memstore
memstore device bytes = 1073741824
client mount timeout = 30
run dir = {folder}/run
admin socket = {folder}/run/$name.asok
log file = {folder}/log/$name.log
pid file = {folder}/run/$name.pid
mon data = {folder}/mon/$cluster-$id
osd data = {folder}/osd/$cluster-$id
keyring = {folder}/keyring
"""


@dataclass
class Rgw:
    """One single-host Ceph cluster and its gateway in ``folder``; ``stop()``/``start()`` act on the gateway."""

    folder: Path
    port: int
    access_key: str = "trainyard-admin"
    secret_key: str = field(default_factory=lambda: secrets.token_hex(20), repr=False)
    daemons: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, repr=False)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self, *argv: str) -> str:
        conf = (
            ["-c", str(self.folder / "ceph.conf")]
            if argv[0] in ("ceph", "ceph-osd", "ceph-mon", "radosgw-admin")
            else []
        )
        try:
            done = subprocess.run(
                [argv[0], *conf, *argv[1:]],
                capture_output=True,
                text=True,
                timeout=START_TIMEOUT_S,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as exc:  # e.g. the monitor never answered
            raise RgwUnavailable(
                f"{' '.join(argv[:3])} did not finish within {START_TIMEOUT_S} s:\n{self.log_tail()}"
            ) from exc
        if done.returncode != 0:
            raise RgwUnavailable(f"{' '.join(argv[:3])} exited with {done.returncode}:\n{done.stderr.strip()[-2000:]}")
        return done.stdout

    def _spawn(self, name: str, *argv: str) -> None:
        with open(self.folder / "log" / f"{name}.out", "ab") as out:
            self.daemons[name] = subprocess.Popen(
                [argv[0], "-f", "-c", str(self.folder / "ceph.conf"), *argv[1:]],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def create(self) -> None:
        """Make the cluster (mon store, keys, one OSD), start it and the gateway, and make the S3 user."""
        check()
        for sub in ("run", "log", "mon/ceph-a", "osd/ceph-0", "rgw"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        fsid, osd_uuid = str(uuid.uuid4()), str(uuid.uuid4())
        (self.folder / "ceph.conf").write_text(_config(self.folder, fsid, free_port()))
        keyring = str(self.folder / "keyring")
        self._run("ceph-authtool", "--create-keyring", keyring, "--gen-key", "-n", "mon.", "--cap", "mon", "allow *")
        caps = ["--cap", "mon", "allow *", "--cap", "osd", "allow *", "--cap", "mgr", "allow *"]
        self._run("ceph-authtool", keyring, "--gen-key", "-n", "client.admin", *caps)
        self._run(
            "ceph-authtool",
            keyring,
            "--gen-key",
            "-n",
            "osd.0",
            "--cap",
            "mon",
            "allow profile osd",
            "--cap",
            "osd",
            "allow *",
        )
        os.chmod(keyring, 0o600)
        mon_addr = (self.folder / "ceph.conf").read_text().split("mon host = ", 1)[1].split("\n", 1)[0]
        monmap = str(self.folder / "monmap")
        self._run("monmaptool", "--create", "--fsid", fsid, "--addv", "a", f"[{mon_addr}]", monmap)
        self._run("ceph-mon", "--mkfs", "-i", "a", "--monmap", monmap)
        self._spawn("mon", "ceph-mon", "-i", "a")
        self._run("ceph", "osd", "new", osd_uuid, "0")  # waits for the monitor (client mount timeout)
        self._run("ceph-osd", "-i", "0", "--mkfs", "--osd-uuid", osd_uuid)
        self._spawn("osd", "ceph-osd", "-i", "0")
        self.start()
        self._run(
            "radosgw-admin",
            "user",
            "create",
            "--uid=trainyard",
            "--display-name=trainyard",
            f"--access-key={self.access_key}",
            f"--secret-key={self.secret_key}",
        )

    def start(self) -> None:
        """Start the gateway (a running one is kept) and wait until its port answers S3."""
        running = self.daemons.get("rgw")
        if running is not None and running.poll() is None:
            return
        self._spawn(
            "rgw",
            "radosgw",
            "-n",
            "client.admin",
            "--rgw-frontends",
            f"beast endpoint=127.0.0.1:{self.port}",
            "--rgw-data",
            str(self.folder / "rgw"),
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._answers():
            exited = [name for name, p in self.daemons.items() if p.poll() is not None]
            if exited or time.monotonic() > deadline:
                what = f"{', '.join(exited)} exited" if exited else f"did not answer within {START_TIMEOUT_S} s"
                raise RgwUnavailable(f"Ceph RGW in {self.folder}: {what}:\n{self.log_tail()}")
            time.sleep(0.1)

    def log_tail(self) -> str:
        tails = []
        for log in sorted((self.folder / "log").glob("*")):
            tails.append(f"--- {log.name}\n" + log.read_text(errors="replace").strip()[-800:])
        return "\n".join(tails)

    def _answers(self) -> bool:
        """The gateway answers an anonymous list of buckets (200, an empty list; or S3's own 403)."""
        try:
            _DIRECT.open(f"{self.endpoint}/", timeout=1).close()
        except urllib.error.HTTPError as exc:
            return exc.code == 403
        except OSError:
            return False
        return True

    def stop(self) -> None:
        """Stop the gateway only (the cluster, and so the buckets, stay)."""
        self._stop("rgw")

    def _stop(self, name: str) -> None:
        process = self.daemons.pop(name, None)
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def discard(self) -> None:
        """Stop every daemon (gateway first) and delete the folder."""
        for name in ("rgw", "osd", "mon"):
            self._stop(name)
        shutil.rmtree(self.folder, ignore_errors=True)


def start(folder: Path | None = None) -> Rgw:
    """A new cluster and gateway on free ports in ``folder`` (a new temp folder if None), started."""
    folder = Path(tempfile.mkdtemp(prefix="trainyard-rgw-")) if folder is None else folder.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)  # the keyring is inside
    server = Rgw(folder, free_port())
    try:
        server.create()
    except BaseException:
        for name in ("rgw", "osd", "mon"):  # the folder and its logs stay, for the error's reader
            server._stop(name)
        raise
    return server


def main() -> int:
    try:
        server = start()
    except RgwUnavailable as exc:
        print(f"tools.rgw: {exc}", file=sys.stderr)
        return 1
    try:
        print(f"Ceph RGW S3 on {server.endpoint} (folder {server.folder})", flush=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        while all(p.poll() is None for p in server.daemons.values()):
            time.sleep(0.5)
        print("tools.rgw: a daemon exited; logs in", server.folder / "log", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.discard()


if __name__ == "__main__":
    sys.exit(main())
