"""``trainyard run``: one run of a pipeline spec through the real ``airflow dags test``, in the environment the
Makefile's ``airflow-db`` and ``demo`` targets give Airflow, so a user need not retype it.

``airflow dags test`` exits 0 even when the run fails, so the run's state is read back from Airflow itself
(``airflow dags list-runs -o json``), never from the command's exit code or its log text. Airflow runs as a
separate process: this module imports none of it.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
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


def _run_at(env: dict[str, str], dag_id: str, ds: str) -> tuple[str, str] | None:
    """(run id, state) of ``dag_id``'s latest run at logical date ``ds``, as Airflow records it."""
    done = _airflow(env, "dags", "list-runs", dag_id, "-o", "json")
    _check(done, f"airflow dags list-runs {dag_id}")
    # Its JSON is one line; Airflow may print warnings (also starting with "[") before it.
    runs = next((r for line in reversed(done.stdout.splitlines()) if (r := _json_list(line)) is not None), None)
    if runs is None:
        raise InfrastructureError(f"airflow dags list-runs {dag_id}: no JSON list in its output")
    at = [r for r in runs if str(r.get("logical_date") or "")[:10] == ds]
    if not at:
        return None
    latest = max(at, key=lambda r: str(r.get("start_date") or ""))
    return str(latest["run_id"]), str(latest["state"])


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
