"""``trainyard`` follows Airflow's and kubectl's CLI conventions: ``--version``, ``-o json``, help on every argument,
``file://`` URIs for local folders, and exit codes that say whose move it is (0 ok, 1 what was checked failed,
2 usage, 3 infrastructure), with one line and never a traceback for any input."""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import trainyard
from trainyard import cli
from trainyard.checkpoint.format import step_dir, write_manifest
from trainyard.cli import main
from trainyard.clikit import Exit
from trainyard.errors import InfrastructureError
from trainyard.events.ledger import Ledger
from trainyard.pipeline import dagtest
from trainyard.pipeline.dagtest import DagTestRun, _last, _run_at, project_env, sqlite_db
from trainyard.pipeline.drill import DrillReport, Expected


def a_run(runs: Path, failed: bool = False, run_id: str = "manual__1") -> Path:
    run = runs / "nightly_pretrain" / run_id
    run.mkdir(parents=True)
    ledger = Ledger.in_dir(run)
    ledger.append("stage_dataset", "stage_start")
    if failed:
        ledger.append("stage_dataset", "stage_failed", error="DataError", message="shard_0000.tok: truncated header",
                      seconds=1.5)  # fmt: skip
    else:
        ledger.append("stage_dataset", "stage_end", seconds=1.5, result={})
    return run


def one_line(err: str) -> str:
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.strip() == f"trainyard {trainyard.__version__}"


def parsers(p: argparse.ArgumentParser, path: str = "trainyard") -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(path, p)]
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += parsers(sub, f"{path} {name}")
    return found


def test_every_command_and_argument_has_help() -> None:
    missing = []
    for path, p in parsers(cli.parser()):
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                helped = {c.dest for c in action._choices_actions if c.help}
                missing += [f"{path} {name}" for name in action.choices if name not in helped]
            elif not action.help or action.help == argparse.SUPPRESS:
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
    assert missing == []


# ------------------------------------------------------------------ summary


def test_summary_of_a_path_that_is_not_there_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["summary", "/nonexistent/run"]) == Exit.USAGE
    captured = capsys.readouterr()
    assert captured.out == "" and "/nonexistent/run: no such run folder" in one_line(captured.err)


def test_summary_of_a_file_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "base.yaml").write_text("nodes: {count: 1}\n")
    assert main(["summary", str(tmp_path / "base.yaml")]) == Exit.USAGE
    assert "base.yaml: not a run folder" in one_line(capsys.readouterr().err)


def test_no_run_found_is_a_usage_error_and_a_failed_run_exits_1_with_its_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = tmp_path / "runs"
    assert main(["summary", "--dag-id", "nightly_pretrain", "--runs-root", str(runs)]) == Exit.USAGE
    assert "no runs of nightly_pretrain under" in one_line(capsys.readouterr().err)
    a_run(runs, failed=True)
    assert main(["summary", "--dag-id", "nightly_pretrain", "--runs-root", str(runs)]) == Exit.FAILED
    out = capsys.readouterr().out
    assert "stage_dataset" in out and "FAILED" in out
    assert "DataError: shard_0000.tok: truncated header" in out  # the reason the ledger holds, not only FAILED


def test_summary_takes_the_specs_file_uri_form_of_the_runs_root(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path))
    run = a_run(tmp_path / "runs")
    for root in (f"file://{tmp_path}/runs", "file://${TRAINYARD_HOME}/runs"):
        assert main(["summary", "--dag-id", "nightly_pretrain", "--runs-root", root]) == Exit.OK
        assert f"run folder:         {run}" in capsys.readouterr().out
    assert main(["summary", f"file://{run}"]) == Exit.OK
    assert main(["summary", "--dag-id", "nightly_pretrain", "--runs-root", "s3://bucket/runs"]) == Exit.USAGE
    assert "not a local path" in one_line(capsys.readouterr().err)


@pytest.mark.parametrize("flag", [["-o", "json"], ["--output", "json"], ["--json"]])
def test_summary_as_json(tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: list[str]) -> None:
    run = a_run(tmp_path / "runs", failed=True)
    assert main(["summary", str(run), *flag]) == Exit.FAILED
    summary = json.loads(capsys.readouterr().out)  # stdout is the one JSON document, nothing else
    assert summary["run_dir"] == str(run) and summary["state"] == "failed"
    assert summary["stages"]["stage_dataset"]["error"] == "DataError: shard_0000.tok: truncated header"


# ------------------------------------------------------------------ checkpoints


def checkpoint(root: Path, step: int, loss: float) -> Path:
    path = step_dir(root, step)
    dcp.save({"model": {"w": torch.ones(4, 4)}}, checkpoint_id=path, no_dist=True)
    write_manifest(path, step=step, world_size=1, global_batch=4, micro_batch=2, metrics={"loss": loss}, run_id="t")
    return path


def test_ckpt_verify_blames_the_flag_it_was_given_and_reports_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = checkpoint(tmp_path, 30, loss=2.5)
    assert main(["ckpt", "verify", str(path), "--max-loss", "2.0"]) == Exit.FAILED
    out = capsys.readouterr().out
    assert "above --max-loss 2.0" in out and "checkpoint.expectations" not in out
    assert main(["ckpt", "verify", f"file://{path}", "-o", "json"]) == Exit.OK
    result = json.loads(capsys.readouterr().out)
    assert result["valid"] is True and result["step"] == 30 and result["problems"] == []
    assert main(["ckpt", "verify", str(tmp_path / "step_000099")]) == Exit.USAGE
    assert "no such checkpoint folder" in one_line(capsys.readouterr().err)


def test_drill_reports_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = Expected("restart", "success", "the policy's reason")
    report = DrillReport("kill", ["restart"], "success", expected, {"detection_s": 1.0}, tmp_path)
    monkeypatch.setattr("trainyard.pipeline.drill.run_drill", lambda spec, drill, ds: report)
    (tmp_path / "spec.yaml").write_text("")
    assert main(["drill", str(tmp_path / "spec.yaml"), "--fault", "kill", "--step", "5", "--json"]) == Exit.OK
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is True and data["actions"] == ["restart"] and data["figures"] == {"detection_s": 1.0}
    assert data["expected"] == {"action": "restart", "end": "success", "because": "the policy's reason"}


def test_demo_data_reports_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo-data", "--date", "2026-11-28", "--cold", f"file://{tmp_path}/cold", "--shards", "1", "-o", "json"]
    assert main(argv) == Exit.OK
    written = json.loads(capsys.readouterr().out)["written"]
    assert [w["folder"] for w in written] == [f"{tmp_path}/cold/tokens/2026-11-28", f"{tmp_path}/cold/finetune"]
    assert all(list(Path(w["folder"]).iterdir()) for w in written)


def test_lineage_release_reports_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "ckpt").mkdir()
    assert main(["lineage", "release", str(tmp_path / "ckpt"), "-o", "json"]) == Exit.OK
    assert json.loads(capsys.readouterr().out) == {"root": str(tmp_path / "ckpt"), "released": False, "held_by": None}


# ------------------------------------------------------------------ S3: credentials are infrastructure


def test_s3_connection_is_resolved_and_its_faults_are_not_usage_errors(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["ls", "s3://bucket", "--connection", "no_such_conn"]) == Exit.USAGE
    assert "connection 'no_such_conn' is not defined" in one_line(capsys.readouterr().err)
    # The connection is read as a task reads the spec's: a login without its password is a credentials fault.
    monkeypatch.setenv("AIRFLOW_CONN_HALF_KEYS", json.dumps({"conn_type": "aws", "login": "AKIAEXAMPLE1"}))
    assert main(["ls", "s3://bucket", "--connection", "half_keys"]) == Exit.INFRASTRUCTURE
    assert "connection 'half_keys': has a login but no password" in one_line(capsys.readouterr().err)
    assert main(["upload", "/no/such/src", "s3://bucket/x"]) == Exit.USAGE
    assert main(["ls", "s3://bucket", "--jobs", "0"]) == Exit.USAGE


# ------------------------------------------------------------------ no traceback, whatever happens


def test_a_reader_that_leaves_ends_the_command_quietly_with_141(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    read, write = os.pipe()
    os.close(read)  # `trainyard schema | head -0`: nobody reads stdout any more
    with os.fdopen(write, "w") as stdout:
        monkeypatch.setattr("sys.stdout", stdout)
        assert main(["schema"]) == Exit.BROKEN_PIPE
        print("later writes go nowhere, and raise nothing")
        stdout.flush()
    assert capsys.readouterr().err == ""


def test_interrupt_exits_130_and_a_bug_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(args: argparse.Namespace) -> int:
        raise KeyboardInterrupt

    def broken(args: argparse.Namespace) -> int:
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(cli, "cmd_schema", interrupted)
    assert main(["schema"]) == Exit.INTERRUPTED
    assert "interrupted" in one_line(capsys.readouterr().err)
    monkeypatch.setattr(cli, "cmd_schema", broken)
    assert main(["schema"]) == Exit.BUG
    err = one_line(capsys.readouterr().err)
    assert "ZeroDivisionError: division by zero" in err and "TRAINYARD_DEBUG=1" in err
    monkeypatch.setenv("TRAINYARD_DEBUG", "1")
    assert main(["schema"]) == Exit.BUG
    assert "Traceback" in capsys.readouterr().err


def test_usage_errors_are_argparses_code(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["summary"])
    assert exited.value.code == Exit.USAGE


# ------------------------------------------------------------------ trainyard run's environment (its run: integration)


def test_run_gives_airflow_the_makefiles_environment_and_a_dags_folder_of_the_spec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    (tmp_path / ".airflow").mkdir()
    (tmp_path / "plugins").mkdir()
    spec = tmp_path / "specs" / "tiny.yaml"
    env = project_env(spec, "tiny", {"PATH": "/usr/bin", "TRAINYARD_HOME": str(tmp_path / "home")})
    assert env["AIRFLOW_HOME"] == str(tmp_path / ".airflow") and env["TRAINYARD_HOME"] == str(tmp_path / "home")
    assert env["AIRFLOW__CORE__PLUGINS_FOLDER"] == str(tmp_path / "plugins")
    assert env["AIRFLOW__CORE__LOAD_EXAMPLES"] == "False"
    [dag_file] = Path(env["AIRFLOW__CORE__DAGS_FOLDER"]).iterdir()  # this pipeline alone
    assert repr(str(spec)) in dag_file.read_text() and "build_dag" in dag_file.read_text()
    mine = project_env(spec, "tiny", {"AIRFLOW_HOME": str(tmp_path / "mine"), "AIRFLOW__CORE__LOAD_EXAMPLES": "True"})
    assert mine["AIRFLOW_HOME"] == str(tmp_path / "mine") and mine["AIRFLOW__CORE__LOAD_EXAMPLES"] == "True"
    assert mine["TRAINYARD_HOME"] == str(tmp_path / "user" / ".trainyard")  # as every other command finds it


def test_an_airflow_failure_is_named_by_the_exception_it_ended_with() -> None:
    log = "INFO starting\nTraceback (most recent call last):\n  File x\nsqlalchemy.exc.DatabaseError: not a db\n(Background)\n"
    assert _last(log) == "sqlalchemy.exc.DatabaseError: not a db"
    assert _last("just this\n\n") == "just this" and _last("") == "(it printed nothing)"


# ------------------------------------------------------------------ trainyard run's reading of the run's state


def a_metadata_db(path: Path, *runs: tuple[str, str, str, str, str | None]) -> Path:
    """A SQLite file with Airflow's ``dag_run`` columns that ``trainyard run`` reads, holding ``runs`` (dag_id,
    run_id, state, logical_date, start_date) as Airflow stores them: UTC timestamps as text."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(path) as conn:
        conn.execute(
            "CREATE TABLE dag_run (id INTEGER PRIMARY KEY, dag_id VARCHAR(250) NOT NULL, run_id VARCHAR(250) NOT NULL,"
            " state VARCHAR(50), logical_date TIMESTAMP, start_date TIMESTAMP)"
        )
        conn.executemany(
            "INSERT INTO dag_run (dag_id, run_id, state, logical_date, start_date) VALUES (?,?,?,?,?)", runs
        )
    conn.close()
    return path


def test_run_reads_the_runs_state_from_the_sqlite_metadata_db_without_starting_airflow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_airflow(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"started Airflow: {args}")

    monkeypatch.setattr(dagtest, "_airflow", no_airflow)
    env = {"AIRFLOW_HOME": str(tmp_path / "airflow")}
    a_metadata_db(
        tmp_path / "airflow" / "airflow.db",
        ("tiny", "manual__2026-11-27T08:00:00+00:00", "failed", "2026-11-27 00:00:00.000000", "2026-11-27 08:00:01.5"),
        ("tiny", "manual__2026-11-27T09:00:00+00:00", "success", "2026-11-27 00:00:00.000000", "2026-11-27 09:00:02.1"),
        ("tiny", "manual__2026-11-28T09:00:00+00:00", "running", "2026-11-28 00:00:00.000000", None),
        ("other", "manual__2026-11-26T09:00:00+00:00", "success", "2026-11-26 00:00:00.000000", "2026-11-26 09:00:00"),
    )
    # The latest run at that logical date (a rerun of the same night), the day of the date alone compared.
    assert _run_at(env, "tiny", "2026-11-27") == ("manual__2026-11-27T09:00:00+00:00", "success")
    assert _run_at(env, "tiny", "2026-11-28") == ("manual__2026-11-28T09:00:00+00:00", "running")
    assert _run_at(env, "tiny", "2026-11-26") is None  # another DAG's run is not this one's
    assert _run_at({"AIRFLOW_HOME": str(tmp_path / "none")}, "tiny", "2026-11-27") is None  # no DB: no run
    assert not (tmp_path / "none" / "airflow.db").exists()  # and none made by looking
    (tmp_path / "airflow" / "airflow.db").write_text("not a database")
    with pytest.raises(InfrastructureError, match=r"tiny's DAG runs from Airflow's metadata DB .*airflow\.db: "):
        _run_at(env, "tiny", "2026-11-27")


def test_run_finds_the_metadata_db_as_airflow_does_and_asks_airflow_for_any_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "airflow"
    home.mkdir()
    assert sqlite_db({"AIRFLOW_HOME": str(home)}) == home / "airflow.db"  # Airflow's default, no airflow.cfg yet
    (home / "airflow.cfg").write_text(
        f"[core]\ndags_folder = x\n[database]\nsql_alchemy_conn = sqlite:///{tmp_path}/a.db\n"
    )
    assert sqlite_db({"AIRFLOW_HOME": str(home)}) == tmp_path / "a.db"
    own = {"AIRFLOW_HOME": str(home), "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{tmp_path}/b.db?timeout=9"}
    assert sqlite_db(own) == tmp_path / "b.db"  # the environment wins over the file
    cfg = tmp_path / "elsewhere.cfg"
    cfg.write_text("[database]\nsql_alchemy_conn = sqlite:///relative.db\n")
    assert sqlite_db({"AIRFLOW_HOME": str(home), "AIRFLOW_CONFIG": str(cfg)}) == Path("relative.db")
    postgres = "postgresql+psycopg2://u:p@127.0.0.1/airflow"
    for other in (
        {"AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": postgres},
        {"AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_CMD": "cat /run/secrets/db"},
        {"AIRFLOW__CORE__SQL_ALCHEMY_CONN": postgres},
        {"AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": "sqlite://"},  # in memory
    ):
        assert sqlite_db({"AIRFLOW_HOME": str(home), **other}) is None, other
    (home / "airflow.cfg").write_text("[database]\nsql_alchemy_conn_secret = db_url\n")
    assert sqlite_db({"AIRFLOW_HOME": str(home)}) is None

    # Another database: Airflow's own list-runs, whose JSON line may follow warnings.
    asked: list[tuple[str, ...]] = []
    listed = [
        {"run_id": "manual__1", "state": "failed", "logical_date": "2026-11-27T00:00:00+00:00", "start_date": "1"},
        {"run_id": "manual__2", "state": "success", "logical_date": "2026-11-27T00:00:00+00:00", "start_date": "2"},
    ]

    def airflow(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
        asked.append(args)
        return subprocess.CompletedProcess(args, 0, f"[warning] deprecated\n{json.dumps(listed)}\n", "")

    monkeypatch.setattr(dagtest, "_airflow", airflow)
    env = {"AIRFLOW_HOME": str(home), "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": postgres}
    assert _run_at(env, "tiny", "2026-11-27") == ("manual__2", "success")
    assert asked == [("dags", "list-runs", "tiny", "-o", "json")]


@pytest.mark.parametrize(
    ("state", "failed_stage", "code"),
    [("success", False, Exit.OK), ("failed", True, Exit.FAILED), ("failed", False, Exit.FAILED)],
)
def test_run_exits_by_the_dag_runs_state_and_prints_its_summary(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    state: str,
    failed_stage: bool,
    code: int,
) -> None:
    spec = tmp_path / "tiny.yaml"
    spec.write_text("unread: the run is faked\n")
    run_dir = a_run(tmp_path / "runs", failed=failed_stage)
    log = tmp_path / "dags-test.log"

    def run_pipeline(path: Path, ds: str | None) -> DagTestRun:
        assert path == spec and ds == "2026-11-27"
        return DagTestRun("tiny", "2026-11-27", state, "manual__1", run_dir, log)

    monkeypatch.setattr(dagtest, "run_pipeline", run_pipeline)
    assert main(["run", str(spec), "--date", "2026-11-27", "-o", "json"]) == code
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert summary["run_dir"] == str(run_dir) and summary["stages"]["stage_dataset"]["ok"] is not failed_stage
    assert one_line(err) == f"airflow dags test tiny 2026-11-27: run {state}; its log: {log}\n"

    # A run that stopped before pinning its spec left no folder: its state alone, and the same exit.
    monkeypatch.setattr(
        dagtest, "run_pipeline", lambda path, ds: DagTestRun("tiny", "2026-11-27", state, "m", None, log)
    )
    assert main(["run", str(spec), "--date", "2026-11-27", "-o", "json"]) == code
    assert json.loads(capsys.readouterr().out) == {"state": state, "run_dir": None}
