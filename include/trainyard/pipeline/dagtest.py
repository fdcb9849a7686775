"""``trainyard run``: one run of a pipeline spec through the real ``airflow dags test``, in the environment the
Makefile's ``airflow-db`` and ``demo`` targets give Airflow, so a user need not retype it.

``airflow dags test`` exits 0 even when the run fails, so the run's state is read back from Airflow's own record,
never from the command's exit code or its log text: the ``dag_run`` row in its metadata DB, read with one query
where that DB is a SQLite file (the default; a second Airflow process, ``airflow dags list-runs``, costs ~7 s of
imports), else with ``airflow dags list-runs -o json``. Airflow runs as a separate process: this module imports
none of it.
"""

from __future__ import annotations

import configparser
import contextlib
import datetime as dt
import json
import os
import re
import sqlite3
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from trainyard.errors import InfrastructureError
from trainyard.events.ledger import safe_name
from trainyard.pipeline.run import Run
from trainyard.spec import load_spec
from trainyard.spec.templating import HOME_VARIABLE, default_home

CONN_SETTING = "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"
"""The metadata DB's URL in the environment (it wins over ``airflow.cfg``'s ``[database] sql_alchemy_conn``)."""

OTHER_CONN_SETTINGS = (CONN_SETTING, "AIRFLOW__CORE__SQL_ALCHEMY_CONN")
"""Settings that name the metadata DB in ways read here by Airflow alone (``..._CMD``, ``..._SECRET``, the old name)."""

SQLITE_URL = "sqlite:///"

SETTINGS_FILE = "airflow_settings.yaml"
"""Connections, pools and variables of a project checkout (the Makefile's ``airflow-db`` loads it too)."""

EXCEPTION_LINE = re.compile(r"^[\w.]+(Error|Exception|Exit): ")
"""A traceback's last line (``sqlalchemy.exc.DatabaseError: ...``)."""

DAG_FILE = '''"""The Airflow DAG of one trainyard pipeline spec, for `trainyard run` (generated; wiring only)."""

from pathlib import Path

from trainyard.airflow.dag_builder import build_dag
from trainyard.spec import load_spec

SPEC = Path({spec!r})
dag = build_dag(SPEC, load_spec(SPEC))
'''


@dataclass(frozen=True)
class DagTestRun:
    dag_id: str
    ds: str
    state: str
    """The DAG run's state as Airflow records it (``success``, ``failed``)."""
    run_id: str
    run_dir: Path | None
    """The run's trainyard folder (its ledger); None where the run stopped before pinning its spec."""
    log: Path
    """Everything ``airflow dags test`` printed."""


def run_pipeline(spec_path: Path, ds: str | None = None) -> DagTestRun:
    """Run ``spec_path`` once at logical date ``ds`` (default: today, UTC) and read back the run's state.

    The working folder plays the project checkout, as ``make demo`` does: without ``AIRFLOW_HOME`` set,
    ``./.airflow`` where it exists (else Airflow's own default, ``~/airflow``); ``./plugins`` and
    ``./airflow_settings.yaml`` where they exist. ``TRAINYARD_HOME`` is found as by every other command."""
    spec_path = spec_path.resolve()
    # This process finds the run's folder from the spec's templates (${TRAINYARD_HOME}) as the run's tasks do.
    os.environ.setdefault(HOME_VARIABLE, default_home())
    spec = load_spec(spec_path)  # an invalid spec is its SpecError here, not an import error in Airflow's log
    dag_id, ds = spec.dag_id(spec_path), ds or dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    env = project_env(spec_path, dag_id, os.environ)
    log = Path(env[HOME_VARIABLE]) / "dags-test" / f"{safe_name(dag_id)}_{ds}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    ready_db(env)
    with log.open("w", errors="replace") as out:
        done = subprocess.run(["airflow", "dags", "test", dag_id, ds], env=env, stdout=out, stderr=subprocess.STDOUT)
    failed = (
        f"airflow dags test {dag_id} {ds} left no DAG run (exit {done.returncode}):"
        f" {_last(log.read_text(errors='replace'))} (all it printed: {log})"
    )
    try:
        run = _run_at(env, dag_id, ds)
    except InfrastructureError:
        if done.returncode != 0:  # Airflow failed before list-runs did: say where it failed first
            raise InfrastructureError(failed) from None
        raise
    if run is None:
        raise InfrastructureError(failed)
    run_id, state = run
    folder = Run(spec=spec, spec_path=spec_path, dag_id=dag_id, run_id=run_id, ds=ds).dir
    return DagTestRun(dag_id, ds, state, run_id, folder if (folder / "events.jsonl").is_file() else None, log)


def project_env(spec_path: Path, dag_id: str, base: Mapping[str, str]) -> dict[str, str]:
    """The Makefile's Airflow environment, with a DAGs folder of one generated file that builds ``spec_path``."""
    cwd = Path.cwd()
    env = dict(base)
    env.setdefault(HOME_VARIABLE, default_home())
    if not env.get("AIRFLOW_HOME"):
        env["AIRFLOW_HOME"] = str(cwd / ".airflow" if (cwd / ".airflow").is_dir() else Path.home() / "airflow")
    env.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
    env.setdefault("AIRFLOW__CORE__UNIT_TEST_MODE", "False")
    if (cwd / "plugins").is_dir():
        env.setdefault("AIRFLOW__CORE__PLUGINS_FOLDER", str(cwd / "plugins"))
    # A folder of its own per pipeline: Airflow parses only this DAG, and another spec's error cannot hide it.
    dags = Path(env["AIRFLOW_HOME"]) / "trainyard-run" / safe_name(dag_id)
    dags.mkdir(parents=True, exist_ok=True)
    (dags / "pipeline.py").write_text(DAG_FILE.format(spec=str(spec_path)))
    env["AIRFLOW__CORE__DAGS_FOLDER"] = str(dags)
    # This interpreter's airflow, as the Makefile puts the venv's bin first.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def ready_db(env: dict[str, str]) -> None:
    """Migrate the metadata DB if it is not (a first run), then load the project's settings, as ``make
    airflow-db`` does; an up-to-date DB is left as it is.

    The SQLite file of ``AIRFLOW_HOME`` is taken as migrated when it exists (asking Airflow costs a start of it,
    seconds; a stale one fails ``dags test``, whose log then says so); any other database is asked."""
    sqlite = "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN" not in env and (Path(env["AIRFLOW_HOME"]) / "airflow.db").exists()
    if sqlite or _airflow(env, "db", "check-migrations", "--migration-wait-timeout", "0").returncode == 0:
        return
    Path(env["AIRFLOW_HOME"]).mkdir(parents=True, exist_ok=True)
    _check(_airflow(env, "db", "migrate"), "airflow db migrate")
    if (settings := Path.cwd() / SETTINGS_FILE).is_file():
        argv = [sys.executable, "-m", "trainyard.airflow.settings", str(settings)]
        _check(subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300), f"loading {settings}")


def sqlite_db(env: Mapping[str, str]) -> Path | None:
    """The SQLite file of the metadata DB Airflow uses in ``env``, found as Airflow finds it: the environment's
    URL, else ``airflow.cfg``'s, else ``AIRFLOW_HOME/airflow.db``. None where it is another database, or where it is
    named in a way only Airflow reads (``_CMD``/``_SECRET`` settings, the ``[core]`` name of before 3.0, templates)."""
    if any(key.startswith(OTHER_CONN_SETTINGS) and key != CONN_SETTING for key in env):
        return None
    url = env.get(CONN_SETTING)
    if url is None:
        parser = configparser.ConfigParser(interpolation=None, strict=False)
        try:
            parser.read(env.get("AIRFLOW_CONFIG") or Path(env["AIRFLOW_HOME"]) / "airflow.cfg", encoding="utf-8")
        except (configparser.Error, UnicodeDecodeError):
            return None
        if parser.has_option("core", "sql_alchemy_conn") or any(
            parser.has_option("database", f"sql_alchemy_conn{tail}") for tail in ("_cmd", "_secret")
        ):
            return None
        url = parser.get("database", "sql_alchemy_conn", fallback=None)
        if url is None:
            return Path(env["AIRFLOW_HOME"]) / "airflow.db"
    path = url.split("?", 1)[0].removeprefix(SQLITE_URL) if url.startswith(SQLITE_URL) else ""
    if not path or path == ":memory:" or "{" in path or "%(" in path:
        return None
    return Path(path)


def _run_at(env: dict[str, str], dag_id: str, ds: str) -> tuple[str, str] | None:
    """(run id, state) of ``dag_id``'s latest run at logical date ``ds``, as Airflow records it."""
    db = sqlite_db(env)
    runs = _runs_in(db, dag_id) if db is not None else _listed_runs(env, dag_id)
    at = [r for r in runs if str(r.get("logical_date") or "")[:10] == ds]
    if not at:
        return None
    latest = max(at, key=lambda r: str(r.get("start_date") or ""))
    return str(latest["run_id"]), str(latest["state"])


def _runs_in(db: Path, dag_id: str) -> list[dict[str, object]]:
    """``dag_id``'s rows of the ``dag_run`` table of the SQLite metadata DB ``db`` (its timestamps are UTC text,
    ``2026-11-27 00:00:00.000000``: the date first, as in list-runs' JSON). A DB not there holds no run."""
    if not db.is_file():
        return []
    try:
        # mode=rw: never create a file where there was none; a connection per read, closed after.
        with contextlib.closing(sqlite3.connect(f"{db.resolve().as_uri()}?mode=rw", uri=True, timeout=30)) as conn:
            rows = conn.execute(
                "SELECT run_id, state, logical_date, start_date FROM dag_run WHERE dag_id = ?", (dag_id,)
            ).fetchall()
    except sqlite3.Error as exc:
        raise InfrastructureError(f"reading {dag_id}'s DAG runs from Airflow's metadata DB {db}: {exc}") from None
    return [dict(zip(("run_id", "state", "logical_date", "start_date"), row, strict=True)) for row in rows]


def _listed_runs(env: dict[str, str], dag_id: str) -> list[dict[str, object]]:
    """``dag_id``'s runs as ``airflow dags list-runs -o json`` prints them (any metadata DB)."""
    done = _airflow(env, "dags", "list-runs", dag_id, "-o", "json")
    _check(done, f"airflow dags list-runs {dag_id}")
    # Its JSON is one line; Airflow may print warnings (also starting with "[") before it.
    runs = next((r for line in reversed(done.stdout.splitlines()) if (r := _json_list(line)) is not None), None)
    if runs is None:
        raise InfrastructureError(f"airflow dags list-runs {dag_id}: no JSON list in its output")
    return runs


def _json_list(line: str) -> list[dict[str, object]] | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, list) else None


def _airflow(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(["airflow", *args], env=env, capture_output=True, text=True, timeout=300)
    except FileNotFoundError:
        raise InfrastructureError(
            "airflow: command not found; install trainyard with Airflow (pip install .)"
        ) from None


def _check(done: subprocess.CompletedProcess[str], what: str) -> None:
    if done.returncode != 0:
        raise InfrastructureError(f"{what} failed (exit {done.returncode}): {_last(done.stdout + done.stderr)}")


def _last(output: str) -> str:
    """The exception a traceback ended with, else the last line Airflow printed (errors stay one line)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    raised = [line for line in lines if EXCEPTION_LINE.match(line)]
    return (raised or lines or ["(it printed nothing)"])[-1][:500]
