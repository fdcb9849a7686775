"""What Airflow shows is what happened: real ``airflow dags test`` runs that fail, recover, or see their spec edited.

Each failing run must end as a *failed* DAG run (the grid, failure callbacks,
``max_consecutive_failed_dag_runs`` and ``backfill --reprocess-behavior failed``
all read that state), its report must still be written, and the spec's
``notify`` list gets one email naming the stage, the failure class and the
run's page from a real SMTP server (aiosmtpd on 127.0.0.1), through the
Airflow connection ``smtp_default`` in the environment. A run that recovered
emails what failed, what was done and the steps lost. The happy path and a
failed data check are in test_demo_pipeline.py.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from airflow_helpers import ROOT, TASKS, airflow, airflow_env, day, query, run_folder, run_state, task_states
from waiting import wait_for

from trainyard.events.ledger import Ledger
from trainyard.report.pages import run_url

pytestmark = pytest.mark.integration

BASE = yaml.safe_load((ROOT / "dags" / "pipelines" / "nightly_pretrain.yaml").read_text())
BASE_URL = "http://airflow.example.com:8080"
RECIPIENTS = ["ml-oncall@example.com", "lead@example.com"]


def small(**changes: object) -> str:
    """The shipped nightly spec cut down to seconds: one node, no pressure test, four steps."""
    spec = copy.deepcopy(BASE)
    spec.pop("schedule")
    spec["nodes"] = {"count": 1, "min": 1, "procs_per_node": 1, "backend": "local"}
    spec["pressure_test"] = {"enabled": False}
    spec["training"].update(max_steps=4, checkpoint_every=2, global_batch=4, micro_batch=4, checkpoint_async=False)
    spec["recovery"]["backoff_s"] = 0.5
    spec["notify"] = {"email": RECIPIENTS, "on": ["failure", "recovery"]}
    for dotted, value in changes.items():
        *parents, key = dotted.split("__")
        node = spec
        for part in parents:
            node = node[part]
        node[key] = value
    return yaml.safe_dump(spec, sort_keys=False)


# Two nodes, one lost at step 3: recovery regroups in place and the run succeeds. Its edit (below) drops the drill.
RECOVERS = {"nodes": {"count": 2, "min": 1, "procs_per_node": 1, "backend": "local"}, "training__micro_batch": 2}
SPECS = {
    "pinned_night": small(**RECOVERS, drills=[{"fault": "kill", "step": 3, "node": "node-1"}]),
    # Two nodes, both needed; the pressure test's drill crashes one: too few healthy nodes.
    "few_nodes": small(
        nodes={"count": 2, "min": 2, "procs_per_node": 1, "backend": "local"},
        training__micro_batch=2,
        pressure_test={
            "duration_s": 2,
            "matmul_size": 64,
            "membw_mb": 8,
            "disk_mb": 8,
            "drills": [{"node": "node-1", "fault": "crash"}],
        },
    ),
    # One attempt only, and it loses its node: the recovery budget is spent at once.
    "no_budget": small(recovery__max_attempts=1, drills=[{"fault": "kill", "step": 2, "node": "node-0"}]),
}
DATES = {"pinned_night": ["2026-11-20", "2026-11-21"], "few_nodes": ["2026-11-22"], "no_budget": ["2026-11-23"]}


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("run-state")
    dags = home / "dags"
    (dags / "pipelines").mkdir(parents=True)
    shutil.copy(ROOT / "dags" / "pipelines.py", dags / "pipelines.py")
    for dag_id, text in SPECS.items():
        (dags / "pipelines" / f"{dag_id}.yaml").write_text(text)
    env = airflow_env(home, dags, AIRFLOW__API__BASE_URL=BASE_URL)
    for date in sorted(d for dates in DATES.values() for d in dates):
        subprocess.run(
            ["trainyard", "demo-data", "--date", date], env=env, check=True, capture_output=True, timeout=120
        )
    return env


def failed_stage(env: dict[str, str], dag_id: str, date: str) -> dict:
    [failed] = Ledger.in_dir(run_folder(env, dag_id, date)).events(event="stage_failed")
    return failed


def dags_test(env: dict[str, str], smtp_server, dag_id: str, date: str) -> str:
    """Run the DAG for ``date`` with the SMTP connection in the environment; the command's output."""
    done = airflow(smtp_env(env, smtp_server), "dags", "test", dag_id, date)
    out = done.stdout + done.stderr
    assert smtp_server.password not in out  # the connection's password is never logged
    return out


def trainyard_run(env: dict[str, str], smtp_server, dag_id: str, date: str) -> tuple[int, dict, str, str]:
    """``trainyard run`` of the DAG's spec for ``date`` with the SMTP connection in the environment, the DAGs folder
    made by the command itself: its exit code, the summary it printed (``-o json``), its stderr, and what Airflow
    printed (its log)."""
    spec = Path(env["AIRFLOW__CORE__DAGS_FOLDER"]) / "pipelines" / f"{dag_id}.yaml"
    run_env = smtp_env(env, smtp_server)
    del run_env["AIRFLOW__CORE__DAGS_FOLDER"]
    done = subprocess.run(
        ["trainyard", "run", f"file://{spec}", "--date", date, "-o", "json"],
        env=run_env, cwd=Path(env["AIRFLOW_HOME"]).parent, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    log = Path(env["TRAINYARD_HOME"]) / "dags-test" / f"{dag_id}_{date}.log"
    out = log.read_text(errors="replace") if log.exists() else f"(no {log})"
    assert smtp_server.password not in out + done.stdout + done.stderr  # the connection's password is never logged
    try:
        summary = json.loads(done.stdout)
    except ValueError:
        raise AssertionError(f"exit {done.returncode}, no JSON: {done.stdout[-2000:]}{done.stderr[-2000:]}") from None
    return done.returncode, summary, done.stderr, out


def smtp_env(env: dict[str, str], smtp_server) -> dict[str, str]:
    return {**env, "AIRFLOW_CONN_SMTP_DEFAULT": smtp_server.connection(from_email="trainyard@example.com")}


def the_one_mail(env: dict[str, str], smtp_server, dag_id: str, date: str, out: str) -> tuple[str, str]:
    """The subject and text of the one message the run sent; its body links the run's page."""
    assert "NOT sent" not in out and "Callback failed" not in out, out[-4000:]
    assert len(smtp_server.mails) == 1, out[-4000:]
    [mail] = smtp_server.mails
    assert mail["to"] == RECIPIENTS and mail["from"] == "trainyard@example.com"  # the connection's from_email
    assert smtp_server.logins == ["trainyard"]  # logged in with the connection's credentials
    [run_id] = [
        r
        for r, logical in query(env, "SELECT run_id, logical_date FROM dag_run WHERE dag_id = :dag_id", dag_id=dag_id)
        if day(logical) == date
    ]
    body = smtp_server.text(mail)
    assert f"Run page: {run_url(BASE_URL, dag_id, run_id)}" in body
    return mail["message"]["Subject"], body


def assert_failed_with_a_report(env: dict[str, str], dag_id: str, date: str, out: str) -> dict[str, str]:
    states = {t: s for t, (s, _) in task_states(env, dag_id, date).items()}
    assert run_state(env, dag_id, date) == "failed", (states, out[-3000:])
    assert states["report"] == "success" and (run_folder(env, dag_id, date) / "report.html").exists(), states
    return states


def test_too_few_healthy_nodes_fails_the_run(env: dict[str, str], smtp_server) -> None:
    [date] = DATES["few_nodes"]
    out = dags_test(env, smtp_server, "few_nodes", date)
    states = assert_failed_with_a_report(env, "few_nodes", date, out)
    assert states["burn_in"] == "failed" and states["train"] == "upstream_failed"
    assert failed_stage(env, "few_nodes", date)["error"] == "NodeUnhealthy"
    subject, body = the_one_mail(env, smtp_server, "few_nodes", date, out)
    assert subject == "[trainyard] few_nodes failed at burn_in: NodeUnhealthy"
    assert "Failed stage: burn_in" in body and "Failure class: NodeUnhealthy" in body


def test_an_exhausted_recovery_budget_fails_the_run(env: dict[str, str], smtp_server) -> None:
    [date] = DATES["no_budget"]
    # Through `trainyard run`: it exits 1 by the DAG run's state as Airflow records it (`dags test` itself exits 0
    # either way) and prints the failed run's summary, the stage's reason in it.
    code, summary, err, out = trainyard_run(env, smtp_server, "no_budget", date)
    states = assert_failed_with_a_report(env, "no_budget", date, out)
    assert code == 1, (summary, err[-2000:])
    assert f"airflow dags test no_budget {date}: run failed" in err and "Traceback" not in err
    assert summary["state"] == "failed" and not summary["stages"]["train"]["ok"]
    assert summary["stages"]["train"]["error"].startswith("TrainingFailed: "), summary["stages"]["train"]
    assert Path(summary["run_dir"]) == run_folder(env, "no_budget", date)
    assert Path(summary["run_dir"]).parent == Path(env["TRAINYARD_HOME"]) / "runs" / "no_budget"
    assert states["train"] == "failed" and states["check_checkpoint"] == "upstream_failed"
    assert failed_stage(env, "no_budget", date)["error"] == "TrainingFailed"
    subject, body = the_one_mail(env, smtp_server, "no_budget", date, out)
    assert subject == "[trainyard] no_budget failed at train: TrainingFailed (node_lost)"
    assert "Failed stage: train" in body and "attempt 1: node_lost on node-0" in body


def test_a_spec_edited_mid_run_changes_only_the_next_run(env: dict[str, str], smtp_server) -> None:
    first, second = DATES["pinned_night"]
    spec_file = Path(env["AIRFLOW__CORE__DAGS_FOLDER"]) / "pipelines" / "pinned_night.yaml"
    log = Path(env["AIRFLOW_HOME"]) / "pinned-night.log"
    with log.open("w") as out:
        running = subprocess.Popen(
            ["airflow", "dags", "test", "pinned_night", first],
            env=smtp_env(env, smtp_server),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        # Once training has started, tighten the gate so that no checkpoint of this model could pass it.
        def training() -> bool:
            assert running.poll() is None, log.read_text()[-3000:]
            return any(True for _ in ledger_of(env, "pinned_night", first).events("train", "stage_start"))

        wait_for(training, 300, "the train stage's start", every_s=0.2, context=lambda: log.read_text()[-3000:])
        spec_file.write_text(small(**RECOVERS, checkpoint__expectations={"max_loss": 1e-6}))
        running.wait(timeout=600)
    finally:
        running.kill()
    # The running run finished with the spec it started with: its gate still had max_loss 10.
    text = log.read_text()
    assert run_state(env, "pinned_night", first) == "success", text[-3000:]
    assert {t: s for t, (s, _) in task_states(env, "pinned_night", first).items()} == dict.fromkeys(TASKS, "success")
    pinned = json.loads((run_folder(env, "pinned_night", first) / "spec.json").read_text())
    assert pinned["spec"]["checkpoint"]["expectations"]["max_loss"] == 10.0
    # It lost a node on the way: the recovery is mailed with what failed, what was done and the steps lost.
    subject, body = the_one_mail(env, smtp_server, "pinned_night", first, text)
    # In place (the default): the survivor regroups without node-1, no relaunch.
    assert subject.startswith("[trainyard] pinned_night succeeded after recovery: node_lost -> regroup, ")
    assert "attempt 1: node_lost on node-1 -> regroup in place, generation 2" in body and "Steps lost in all: " in body
    smtp_server.mails.clear()
    smtp_server.logins.clear()

    # The next run uses the edit, and its gate fails: a gate failure fails the run.
    out = dags_test(env, smtp_server, "pinned_night", second)
    states = assert_failed_with_a_report(env, "pinned_night", second, out)
    assert states["train"] == "success" and states["check_checkpoint"] == "failed"
    assert states["publish"] == "upstream_failed"
    failed = failed_stage(env, "pinned_night", second)
    assert failed["stage"] == "check_checkpoint" and failed["error"] == "CheckpointInvalid"
    subject, body = the_one_mail(env, smtp_server, "pinned_night", second, out)
    assert subject == "[trainyard] pinned_night failed at check_checkpoint: CheckpointInvalid"


def ledger_of(env: dict[str, str], dag_id: str, date: str) -> Ledger:
    folder = run_folder(env, dag_id, date)
    return Ledger.in_dir(folder) if folder else Ledger("/nonexistent/events.jsonl")
