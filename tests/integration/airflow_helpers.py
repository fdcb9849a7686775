"""Run the real Airflow CLI against a throwaway metadata DB (shared by the integration tests).

The DB is SQLite unless the env names another (``AIRFLOW__DATABASE__SQL_ALCHEMY_CONN``): the
tests that run Airflow's services use PostgreSQL (conftest's ``metadata_db``), and every reader
here goes through SQLAlchemy, so it works on both.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from waiting import WaitedTooLong, wait_for

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# Only where PostgreSQL is unavailable (``sqlite_service_settings``). Imported by every Airflow process
# of a deployment (``sql_alchemy_connect_args``): sqlite's default 5 s busy timeout is too short for a
# CLI write while the scheduler and DAG processor hold the database on two loaded cores ("database is
# locked" from ``airflow backfill create``).
SQLITE_CONNECT_ARGS = {"timeout": 60}
STAGES = ["stage_dataset", "check_dataset", "burn_in", "train", "check_checkpoint", "publish", "report"]
TASKS = ["pin_spec", *STAGES]  # pin_spec pins the run's spec; it is no stage of the ledger


def airflow_env(home: Path, dags: Path = ROOT / "dags", **extra: str) -> dict[str, str]:
    """An environment with its own AIRFLOW_HOME (migrated, settings loaded) and TRAINYARD_HOME."""
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home / "airflow"),
        "TRAINYARD_HOME": str(home / "trainyard"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "PATH": f"{BIN}:{os.environ['PATH']}",
        **extra,
    }
    if "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN" in env:  # a database of its own (PostgreSQL): set it up
        _set_up_db(env)
    else:  # SQLite in AIRFLOW_HOME: a copy of the session's set-up one, the same bytes a migrate would write
        (home / "airflow").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_sqlite_template(), home / "airflow" / "airflow.db")
    return env


def _set_up_db(env: dict[str, str]) -> None:
    """Migrate the env's metadata DB and load the project's connections, pools and variables."""
    for argv in (
        ["airflow", "db", "migrate"],
        [sys.executable, "-m", "trainyard.airflow.settings", str(ROOT / "airflow_settings.yaml")],
    ):
        subprocess.run(argv, env=env, check=True, capture_output=True, timeout=300)


@functools.cache
def _sqlite_template() -> Path:
    """One migrated SQLite metadata DB per test session: migrating takes ~12 s on two cores, a copy none."""
    home = Path(tempfile.mkdtemp(prefix="trainyard-airflow-db-"))
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "PATH": f"{BIN}:{os.environ['PATH']}",
    }
    env.pop("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", None)
    _set_up_db(env)
    return home / "airflow.db"


def airflow(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["airflow", *args], env=env, capture_output=True, text=True, timeout=600)


def task_states(env: dict[str, str], dag_id: str, date: str) -> dict[str, tuple[str, int]]:
    """``task_id -> (state, try_number)`` of the run at logical ``date`` (``dags test`` exits 0 either way)."""
    rows = query(
        env,
        "SELECT ti.task_id, ti.state, ti.try_number, r.logical_date FROM task_instance ti JOIN dag_run r"
        " ON ti.dag_id = r.dag_id AND ti.run_id = r.run_id WHERE r.dag_id = :dag_id",
        dag_id=dag_id,
    )
    return {task: (state, tries) for task, state, tries, logical_date in rows if day(logical_date) == date}


def run_state(env: dict[str, str], dag_id: str, date: str) -> str | None:
    """The DAG run's own state at logical ``date``: what the grid, callbacks and backfills see."""
    rows = query(env, "SELECT state, logical_date FROM dag_run WHERE dag_id = :dag_id", dag_id=dag_id)
    return next((state for state, logical_date in rows if day(logical_date) == date), None)


def run_folder(env: dict[str, str], dag_id: str, date: str) -> Path | None:
    """The trainyard run folder of ``dag_id``'s run for ``date``, found by its pinned ``ds``.

    Run ids of ``dags test`` and unscheduled runs carry the trigger time, not the logical date.
    """
    root = Path(env["TRAINYARD_HOME"]) / "runs" / dag_id
    for folder in sorted(root.iterdir()) if root.exists() else []:
        snapshot = folder / "spec.json"
        if snapshot.exists() and json.loads(snapshot.read_text()).get("ds") == date:
            return folder
    return None


# ------------------------------------------------------------------ live services
# A running scheduler needs Airflow 3's other components: the DAG processor parses the DAG files,
# and task processes talk to the Execution API of an api-server (signed with a shared JWT secret).


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def service_settings(api_port: int) -> dict[str, str]:
    """``AIRFLOW__*`` settings for a LocalExecutor deployment on 127.0.0.1 (pass them to ``airflow_env``,
    with the metadata DB's settings: conftest's ``metadata_db``).

    One task at a time keeps the two shared cores for it. Every listener is on 127.0.0.1, and the
    scheduler starts with ``--skip-serve-logs`` (task logs are read from disk), so nothing else binds a port.
    """
    return {
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__CORE__PARALLELISM": "1",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{api_port}/execution/",
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": str(api_port),
        "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{api_port}",
        "AIRFLOW__API__WORKERS": "1",
        "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),
        # Parse each DAG file once at start, not every 30 s: two shared cores.
        "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "600",
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "600",
    }


def sqlite_service_settings() -> dict[str, str]:
    """The metadata DB settings of a deployment on SQLite (where PostgreSQL is unavailable).

    SQLite is allowed with the LocalExecutor in Airflow 3 (``airflow standalone`` runs that pair),
    given a long busy timeout (``SQLITE_CONNECT_ARGS``, imported by each process from this module).
    """
    return {
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS": "airflow_helpers.SQLITE_CONNECT_ARGS",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")])),
    }


@dataclass
class Service:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path


def start_service(env: dict[str, str], name: str, argv: list[str], log_dir: Path) -> Service:
    """Start ``argv`` in a process group (session) of its own, output to ``log_dir/<name>.log``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    return Service(name, proc, log)


def start_services(env: dict[str, str], log_dir: Path, apps: str = "execution") -> list[Service]:
    """api-server (``apps``: the Execution API only, or ``core,execution`` for the REST API too), DAG
    processor and scheduler, on the env's settings."""
    port = env["AIRFLOW__API__PORT"]
    return [
        start_service(
            env,
            "api-server",
            ["airflow", "api-server", "--apps", apps, "-H", "127.0.0.1", "-p", port, "-w", "1"],
            log_dir,
        ),
        start_service(env, "dag-processor", ["airflow", "dag-processor"], log_dir),
        start_service(env, "scheduler", ["airflow", "scheduler", "--skip-serve-logs"], log_dir),
    ]


def stop_services(services: list[Service], grace_s: float = 15.0) -> None:
    """SIGTERM each service's process group, then SIGKILL what is left of it after ``grace_s``."""
    for s in services:
        _signal_group(s.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for s in services:
        try:
            s.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        _signal_group(s.proc.pid, signal.SIGKILL)  # the group outlives its leader: workers, task processes
        s.proc.wait()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def processes_of(env: dict[str, str]) -> list[int]:
    """Pids of this user's processes started with ``env``'s AIRFLOW_HOME (what a test run left behind)."""
    marker = f"AIRFLOW_HOME={env['AIRFLOW_HOME']}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # another user's process, or one that just ended
            continue
    return found


def reap_leftovers(env: dict[str, str], wait_s: float = 10.0) -> list[str]:
    """Wait up to ``wait_s`` for ``env``'s processes to end, SIGKILL the survivors by pid; describe them."""
    with contextlib.suppress(WaitedTooLong):  # those still there are ended below, and named
        wait_for(lambda: not processes_of(env), wait_s, "the run's processes to end", every_s=0.5)
    described = []
    for pid in processes_of(env):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue
        described.append(f"{pid}: {cmd[:200]}")
    return described


def wait_until(
    predicate: Callable[[], Any],
    timeout_s: float,
    what: str,
    every_s: float = 1.0,
    services: list[Service] | None = None,
) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail naming ``what`` (or a dead service)."""

    def answer() -> Any:
        result = predicate()
        dead = [s.name for s in services or [] if s.proc.poll() is not None]
        if not result and dead:
            raise AssertionError(f"{', '.join(dead)} exited while waiting for {what}")
        return result

    return wait_for(answer, timeout_s, what, every_s=every_s)


def api_healthy(env: dict[str, str]) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{env['AIRFLOW__API__PORT']}/execution/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def metadata_url(env: dict[str, str]) -> str:
    """The SQLAlchemy URL of the env's metadata DB: its own setting, else Airflow's default SQLite file."""
    return env.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN") or f"sqlite:///{Path(env['AIRFLOW_HOME']) / 'airflow.db'}"


def query(env: dict[str, str], sql: str, **params: Any) -> list[tuple[Any, ...]]:
    """Rows of ``sql`` (``:name`` parameters) from the env's metadata DB, SQLite or PostgreSQL.

    A connection per call, closed after: a poll must not hold a lock or a server slot between calls.
    PostgreSQL sessions read timestamps in UTC, as Airflow's processes do, so ``day`` reads the same
    date on both.
    """
    url = metadata_url(env)
    connect_args: dict[str, Any] = {"timeout": 30} if url.startswith("sqlite") else {"options": "-c timezone=UTC"}
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool, connect_args=connect_args)
    try:
        with engine.connect() as conn:
            return [tuple(row) for row in conn.execute(sa.text(sql), params)]
    finally:
        engine.dispose()


def day(timestamp: Any) -> str:
    """``YYYY-MM-DD`` of a timestamp column: a string from SQLite, a UTC datetime from PostgreSQL."""
    return str(timestamp)[:10]


def run_task_states(env: dict[str, str], dag_id: str, run_id: str) -> dict[str, str]:
    """``task_id -> state`` of one DAG run."""
    rows = query(
        env,
        "SELECT task_id, state FROM task_instance WHERE dag_id = :dag_id AND run_id = :run_id",
        dag_id=dag_id,
        run_id=run_id,
    )
    return dict(rows)


def log_tail(path: Path, chars: int = 4000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"({path}: {exc})"
    return text[-chars:]


def task_logs(env: dict[str, str], dag_id: str, chars: int = 2000) -> str:
    """The tail of every task log of ``dag_id``, oldest first, each under its path."""
    root = Path(env["AIRFLOW_HOME"]) / "logs" / f"dag_id={dag_id}"
    logs = sorted(root.rglob("*.log"), key=lambda p: p.stat().st_mtime) if root.exists() else []
    text = "\n".join(f"===== {p.relative_to(root)}\n{log_tail(p, chars)}" for p in logs)
    return text or f"(no task logs under {root})"
