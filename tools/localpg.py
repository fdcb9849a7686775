"""A PostgreSQL cluster in one folder, on 127.0.0.1, for Airflow's metadata DB.

Airflow documents SQLite as for development only, so ``make airflow`` and the
tests that run Airflow's services use PostgreSQL, as the compose stack does in
production. This module owns such a cluster, built with the binaries of
Debian's ``postgresql`` package::

    FOLDER/data        the cluster (initdb), made once
    FOLDER/run         its unix socket: only the server's user (and root) reach it
    FOLDER/password    the ``airflow`` role's password (0600), made once
    FOLDER/server.log  the server's log

The server listens on 127.0.0.1 only, at a free port chosen when it starts;
TCP logins need the password, the unix socket trusts whoever can reach it.
PostgreSQL refuses to run as root, so as root every server command runs as
the ``postgres`` user (Debian's package makes it; else ``nobody``), which then
owns the folder.

``python -m tools.localpg start FOLDER`` starts the cluster (making it if
needed) and the database, and prints the SQLAlchemy URL (it holds the password:
capture it, never log it); ``stop FOLDER`` stops it; ``check`` prints where the
binaries are, or why they are not usable, and exits 1.
"""

from __future__ import annotations

import argparse
import os
import pwd
import re
import secrets
import shlex
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

ROLE = "airflow"
SUPERUSER = "postgres"
START_TIMEOUT_S = 60
# A throwaway test cluster trades crash safety for speed on a loaded machine: nothing in it
# must survive a crash of the machine, so nothing needs to reach the disk before it goes on.
FAST_SETTINGS = ("fsync=off", "synchronous_commit=off", "full_page_writes=off")
_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_PASSWORD_FIX = (
    "if you made it and trust it, `chown $(id -un) {path} && chmod 600 {path}`; else start over in a new"
    " folder (or delete {folder})"
)


class PostgresUnavailable(RuntimeError):
    """PostgreSQL cannot run here; the message says why and what to do (callers may fall back to SQLite)."""


def binaries() -> Path:
    """The folder of ``initdb`` and ``pg_ctl``: on PATH, else the newest Debian ``/usr/lib/postgresql/N/bin``."""
    found = shutil.which("initdb")
    candidates = [Path(found).resolve().parent] if found else []
    # Debian keeps them off PATH, one folder per major version.
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: _major(p.parent.name), reverse=True)
    for folder in [*candidates, *versions]:
        if (folder / "initdb").is_file() and (folder / "pg_ctl").is_file():
            return folder
    raise PostgresUnavailable(
        "PostgreSQL's initdb and pg_ctl are not installed: on Debian, "
        "`apt-get install postgresql` (as root; `make postgres` does it)"
    )


def _major(name: str) -> int:
    return int(name) if name.isdigit() else -1


def server_user() -> str | None:
    """Who runs the server: ``None`` for the current user, a user name when that is root."""
    if os.geteuid() != 0:
        return None
    for name in (SUPERUSER, "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    raise PostgresUnavailable(
        "running as root, and neither a `postgres` nor a `nobody` user exists "
        "to run PostgreSQL as (it refuses root): create one with `useradd postgres`"
    )


def _as_server_user(argv: list[str]) -> list[str]:
    user = server_user()
    return ["runuser", "-u", user, "--", *argv] if user else argv


def _run(argv: list[str], what: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(_as_server_user(argv), capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PostgresUnavailable(f"{what}: {exc}") from exc
    if done.returncode != 0:
        raise PostgresUnavailable(
            f"{what} failed (exit {done.returncode}): {(done.stderr or done.stdout).strip()[-1500:]}"
        )
    return done


def _give_to_server_user(path: Path) -> None:
    user = server_user()
    if user:
        entry = pwd.getpwnam(user)
        os.chown(path, entry.pw_uid, entry.pw_gid)


def init(folder: Path, *, fast: bool = False) -> None:
    """Make the cluster and the role's password in ``folder`` unless they exist (safe to repeat)."""
    bins = binaries()
    folder = folder.resolve()
    data = folder / "data"
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)  # the password and the socket's folder are inside
    password = folder / "password"
    if not os.path.lexists(password):
        fd = os.open(password, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(24))
    read_password(folder)  # one found there is used only if it is this user's own, private file
    if (data / "PG_VERSION").exists():
        return
    _give_to_server_user(folder)
    (folder / "run").mkdir(mode=0o700, exist_ok=True)
    _give_to_server_user(folder / "run")
    if server_user():
        try:
            _run(["test", "-w", str(folder)], "checking the folder")
        except PostgresUnavailable as exc:
            raise PostgresUnavailable(
                f"user {server_user()!r} cannot write {folder} (a folder above it is closed "
                f"to it): use a folder it can reach (a new one right under /tmp), or chmod o+x the folders above"
            ) from exc
    # initdb into a temporary name, renamed when complete: a half-made cluster never looks made.
    partial = folder / "data.partial"
    if partial.exists():
        shutil.rmtree(partial)
    argv = [
        str(bins / "initdb"),
        "-D",
        str(partial),
        "-U",
        SUPERUSER,
        "--auth-local=trust",
        "--auth-host=scram-sha-256",
        "-E",
        "UTF8",
        "--locale=C",
        "--no-instructions",
    ]
    _run(argv + (["--no-sync"] if fast else []), f"initdb of {data}")
    partial.rename(data)


def read_password(folder: Path) -> str:
    """The role's password, from a file that is this user's own, private and not a link; else refused.

    Someone else's file (or one others may read) would give its writer the
    database's login, or show it to every user of the machine.
    """
    path = folder.resolve() / "password"
    fix = _PASSWORD_FIX.format(path=path, folder=folder.resolve())
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO would block a plain open
    except OSError as exc:
        why = "is a link" if os.path.islink(path) else f"cannot be read ({exc.strerror})"
        raise PostgresUnavailable(f"the password file {path} {why}: {fix}") from None
    with os.fdopen(fd) as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise PostgresUnavailable(
                f"the password file {path} is not a private file of this user (owner uid {st.st_uid}, mode"
                f" {stat.filemode(st.st_mode)}; wanted uid {os.geteuid()}, -rw-------):"
                f" {fix}"
            )
        return fh.read(4096).strip()


def running_port(folder: Path) -> int | None:
    """The port of the cluster's running server, or ``None`` when it is not running (or not made)."""
    data = folder.resolve() / "data"
    if not (data / "PG_VERSION").exists():
        return None
    status = subprocess.run(
        _as_server_user([str(binaries() / "pg_ctl"), "status", "-D", str(data)]),
        capture_output=True,
        text=True,
        timeout=30,
    )
    if status.returncode != 0:
        return None
    # postmaster.pid: pid, data folder, start time, port, ... (one per line)
    lines = (data / "postmaster.pid").read_text().splitlines()
    return int(lines[3])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(folder: Path, *, fast: bool = False) -> int:
    """Start the cluster in ``folder`` (made if missing) on 127.0.0.1; its port. A running one is kept."""
    folder = folder.resolve()
    init(folder, fast=fast)
    port = running_port(folder)
    if port is not None:
        return port
    log = folder / "server.log"
    # The free port may be taken between the check and the bind: try a few.
    for _ in range(3):
        port = _free_port()
        settings = ["listen_addresses=127.0.0.1", *(FAST_SETTINGS if fast else ())]
        # pg_ctl hands -o to a shell: quote the one path in it.
        options = " ".join([f"-p {port}", "-k", shlex.quote(str(folder / "run")), *(f"-c {s}" for s in settings)])
        argv = [
            str(binaries() / "pg_ctl"),
            "start",
            "-D",
            str(folder / "data"),
            "-l",
            str(log),
            "-w",
            "-t",
            str(START_TIMEOUT_S),
            "-s",
            "-o",
            options,
        ]
        before = log.stat().st_size if log.exists() else 0
        try:
            _run(argv, f"starting PostgreSQL in {folder}", timeout_s=START_TIMEOUT_S + 30)
            return port
        except PostgresUnavailable as exc:
            told = log.read_text(errors="replace")[before:] if log.exists() else ""
            if "could not bind" not in told and "already in use" not in told:
                raise PostgresUnavailable(f"{exc}\n{told.strip()[-1500:]}") from exc
    raise PostgresUnavailable(f"PostgreSQL in {folder} found no free port in 3 tries; see {log}")


def create_database(folder: Path, name: str = ROLE) -> str:
    """Make the ``airflow`` role and database ``name`` unless they exist; the SQLAlchemy URL to reach it.

    The cluster must be running (``start``).
    """
    if not _NAME.fullmatch(name):
        raise ValueError(f"database name {name!r}: use lower-case letters, digits and '_' (at most 63)")
    folder = folder.resolve()
    port = running_port(folder)
    if port is None:
        raise PostgresUnavailable(
            f"no PostgreSQL is running in {folder}: start it first (python -m tools.localpg start {folder})"
        )
    try:
        import psycopg2
        from psycopg2 import sql
    except ImportError as exc:
        raise PostgresUnavailable("the psycopg2 driver is missing: pip install -r requirements.txt") from exc
    password = read_password(folder)
    conn = psycopg2.connect(host=str(folder / "run"), port=port, user=SUPERUSER, dbname="postgres")
    conn.autocommit = True  # CREATE DATABASE cannot run inside a transaction
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (ROLE,))
            if not cur.fetchone():
                cur.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD %s").format(sql.Identifier(ROLE)), (password,))
            cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
            if not cur.fetchone():
                cur.execute(
                    sql.SQL("CREATE DATABASE {} OWNER {} ENCODING 'UTF8'").format(
                        sql.Identifier(name), sql.Identifier(ROLE)
                    )
                )
    finally:
        conn.close()
    return url(folder, name, port)


def url(folder: Path, database: str = ROLE, port: int | None = None) -> str:
    """``postgresql+psycopg2://airflow:PASSWORD@127.0.0.1:PORT/database`` (it holds the password: never log it)."""
    folder = folder.resolve()
    port = port if port is not None else running_port(folder)
    if port is None:
        raise PostgresUnavailable(f"no PostgreSQL is running in {folder}")
    password = read_password(folder)
    return f"postgresql+psycopg2://{ROLE}:{password}@127.0.0.1:{port}/{database}"


def stop(folder: Path) -> bool:
    """Stop the cluster's server if it runs (fast shutdown: sessions are ended); whether it was running."""
    folder = folder.resolve()
    if running_port(folder) is None:
        return False
    _run(
        [
            str(binaries() / "pg_ctl"),
            "stop",
            "-D",
            str(folder / "data"),
            "-m",
            "fast",
            "-w",
            "-s",
            "-t",
            str(START_TIMEOUT_S),
        ],
        f"stopping PostgreSQL in {folder}",
        timeout_s=START_TIMEOUT_S + 30,
    )
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.localpg", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="print where PostgreSQL's binaries are, or why it cannot run here")
    up = sub.add_parser("start", help="start the cluster in FOLDER (made if missing); print the database's URL")
    up.add_argument("folder", type=Path)
    up.add_argument("--database", default=ROLE)
    up.add_argument("--fast", action="store_true", help="no fsync: for throwaway clusters only")
    down = sub.add_parser("stop", help="stop the cluster in FOLDER if it runs")
    down.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "check":
            bins = binaries()
            server_user()
            print(bins)
        elif args.command == "start":
            start(args.folder, fast=args.fast)
            print(create_database(args.folder, args.database))
        else:
            stop(args.folder)
    except (PostgresUnavailable, ValueError) as exc:
        print(f"tools.localpg {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
