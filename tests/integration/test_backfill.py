"""`airflow backfill create` over two nights of the nightly pipeline, under a running scheduler.

Real Airflow 3 components (api-server for the Execution API, DAG processor,
scheduler with the LocalExecutor) on a throwaway PostgreSQL metadata DB (as in
production; SQLite where PostgreSQL is unavailable, with a warning), every
listener on 127.0.0.1. The DAG comes from a copy of
``dags/pipelines/nightly_pretrain.yaml`` cut down to a few seconds per run.
The test asserts what continual pretraining promises: each night stages its
own partition, resumes from the checkpoint the night before ended with, and
the nights run one at a time, in date order, never sharing a file. The last
night's partition is missing at first: that run fails (the DAG run, not only a
task) with its report written, and once the data is there, a backfill with
``--reprocess-behavior failed`` runs that night alone again, to success. Its
train task's log file (what the UI shows) has progress lines and its "Training
run" link. (A run without a logical date, a REST trigger's ``logical_date: null``, takes the day of its
run_after for ``{{ ds }}``: tests/airflow/test_operators.py; a whole run of it here cost a minute of CI.)
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import shutil
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import yaml
from airflow_helpers import (
    ROOT,
    STAGES,
    Service,
    airflow,
    airflow_env,
    api_healthy,
    day,
    free_port,
    log_tail,
    query,
    reap_leftovers,
    run_task_states,
    service_settings,
    start_services,
    stop_services,
    task_logs,
    wait_until,
)

from trainyard.checkpoint.format import read_manifest, step_dir, verify
from trainyard.events.ledger import Ledger, run_dir
from trainyard.report.pages import run_url

pytestmark = pytest.mark.integration
DAG_ID = "nightly_pretrain"
MAX_STEPS = 4
SHARDS = [2, 3]  # a different shard count per night: each run's staged copy shows which partition it got
DEADLINE_S = 240  # the two nights
RERUN_DEADLINE_S = 240  # the failed night again


def nights() -> list[str]:
    """The two nights up to the latest past 02:00 UTC trigger of the spec's cron.

    Ending on that one means the scheduler, once the DAG is unpaused, finds the
    backfill's run already at its next logical date and creates no scheduled run
    (it would run beside the backfill: Airflow counts backfill runs apart).
    """
    now = dt.datetime.now(dt.UTC)
    last = (now - dt.timedelta(hours=2)).date()
    next_trigger = dt.datetime.combine(last + dt.timedelta(days=1), dt.time(2), tzinfo=dt.UTC)
    if next_trigger - now < dt.timedelta(seconds=DEADLINE_S + RERUN_DEADLINE_S + 120):
        pytest.skip("02:00 UTC falls within the test: the scheduler would start that night's run beside the backfill")
    return [str(last - dt.timedelta(days=n)) for n in (1, 0)]


def small_spec(first_night: str) -> str:
    """The nightly spec as shipped, cut down: one node, no pressure test, a few steps per run."""
    spec = yaml.safe_load((ROOT / "dags" / "pipelines" / f"{DAG_ID}.yaml").read_text())
    assert spec["dataset"]["source"].endswith("/{{ ds }}") and spec["dataset"]["name"].endswith("/{{ ds }}")
    assert spec["max_active_runs"] == 1 and spec["training"].get("resume_from", "latest") == "latest"
    spec["start_date"] = first_night
    spec["nodes"] = {"count": 1, "min": 1, "procs_per_node": 1, "backend": "local"}
    spec["pressure_test"] = {"enabled": False}
    spec["training"].update(max_steps=MAX_STEPS, checkpoint_every=MAX_STEPS, global_batch=4, micro_batch=4)
    spec["recovery"]["backoff_s"] = 1
    spec["training"]["progress_every_s"] = 0.5  # progress lines in the train task's log file, even in a short run
    return yaml.safe_dump(spec, sort_keys=False)


def demo_data(env: dict[str, str], date: str, shards: int) -> None:
    subprocess.run(
        ["trainyard", "demo-data", "--date", date, "--shards", str(shards)],
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )


@pytest.fixture
def deployment(
    tmp_path: Path, metadata_db: dict[str, str]
) -> Iterator[tuple[dict[str, str], list[Service], list[str]]]:
    dates = nights()
    dags = tmp_path / "dags"
    (dags / "pipelines").mkdir(parents=True)
    for name in ("pipelines.py", "pipeline_spec_errors.py"):  # pipelines.py reads the specs next to itself
        shutil.copy(ROOT / "dags" / name, dags / name)
    (dags / "pipelines" / f"{DAG_ID}.yaml").write_text(small_spec(dates[0]))

    # Every caller is admin: the REST API answers without a login (every listener is on 127.0.0.1).
    env = airflow_env(
        tmp_path,
        dags,
        **service_settings(free_port()),
        **metadata_db,
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS="True",
    )
    for date, shards in list(zip(dates, SHARDS))[:-1]:  # the last night's partition comes late
        demo_data(env, date, shards)
    services = start_services(env, tmp_path / "services", apps="core,execution")  # the REST API too
    try:
        yield env, services, dates
    finally:
        stop_services(services)
        leftovers = reap_leftovers(env)
        assert not leftovers, "processes outlived their service's process group:\n" + "\n".join(leftovers)


def diagnostics(env: dict[str, str], services: list[Service]) -> str:
    parts = [f"===== {s.name} (exit {s.proc.poll()})\n{log_tail(s.log, 6000)}" for s in services]
    runs = query(
        env, "SELECT run_id, state, run_type, backfill_id, start_date, end_date FROM dag_run ORDER BY logical_date"
    )
    parts.append("===== dag runs\n" + "\n".join(map(str, runs)))
    parts.append(task_logs(env, DAG_ID))
    return "\n".join(parts)


def test_backfill_runs_nights_in_order_each_resuming_the_last_and_reruns_the_failed_one(deployment) -> None:
    env, services, dates = deployment
    try:
        check_backfill(env, services, dates)
    except AssertionError:
        print(diagnostics(env, services))
        raise


def backfill(env: dict[str, str], dates: list[str], *extra: str) -> int:
    """Create a backfill of ``dates``, one night at a time; its id.

    The DAG's max_active_runs does not bound a backfill (Airflow counts backfill runs apart and
    defaults a backfill to 10 at once): one night at a time must be asked for. --to-date is an
    instant, and a bare date means its 00:00, before that night's 02:00 run; hence the time.
    """
    created = airflow(
        env,
        "backfill",
        "create",
        "--dag-id",
        DAG_ID,
        "--from-date",
        dates[0],
        "--to-date",
        f"{dates[-1]}T02:00:00+00:00",
        "--max-active-runs",
        "1",
        *extra,
    )
    assert created.returncode == 0, created.stdout[-3000:] + created.stderr[-3000:]
    [(backfill_id, max_active)] = query(
        env, "SELECT id, max_active_runs FROM backfill WHERE dag_id = :dag_id ORDER BY id DESC LIMIT 1", dag_id=DAG_ID
    )
    assert max_active == 1
    return backfill_id


def backfill_runs(env: dict[str, str], backfill_id: int) -> list[tuple[Any, ...]]:
    """``(run_id, state, logical_date, start_date, end_date)`` of the backfill's runs, by logical date."""
    return query(
        env,
        "SELECT run_id, state, logical_date, start_date, end_date FROM dag_run"
        " WHERE dag_id = :dag_id AND backfill_id = :backfill_id ORDER BY logical_date",
        dag_id=DAG_ID,
        backfill_id=backfill_id,
    )


def assert_succeeded(env: dict[str, str], run_id: str) -> None:
    """Every task of the run succeeded, the pipeline's stages among them (other tasks may come and go)."""
    states = run_task_states(env, DAG_ID, run_id)
    assert set(STAGES) <= set(states) and set(states.values()) == {"success"}, (run_id, states)


def check_backfill(env: dict[str, str], services: list[Service], dates: list[str]) -> None:
    wait_until(lambda: api_healthy(env), 120, "the api-server's /execution/health", services=services)
    wait_until(
        lambda: query(env, "SELECT 1 FROM serialized_dag WHERE dag_id = :dag_id", dag_id=DAG_ID),
        180,
        f"the DAG processor to serialize {DAG_ID}",
        services=services,
    )

    first = backfill(env, dates)
    # New DAGs start paused, and the runs of a paused DAG stay queued, backfill runs included.
    # Through the REST API the api-server already serves: no CLI process to start (seconds on two cores).
    unpaused = api(env, "PATCH", f"/api/v2/dags/{DAG_ID}", {"is_paused": False})
    assert unpaused["is_paused"] is False, unpaused

    def finished() -> list[tuple[Any, ...]] | None:
        rows = backfill_runs(env, first)
        done = len(rows) == len(dates) and all(r[1] in ("success", "failed") for r in rows)
        failed_early = any(r[1] == "failed" and day(r[2]) != dates[-1] for r in rows)  # only the last lacks data
        return rows if done or failed_early else None

    runs = wait_until(finished, DEADLINE_S, "the backfill's runs to finish", every_s=1, services=services)
    assert [day(r[2]) for r in runs] == dates  # one run per night, logical dates D1 < D2
    # What Airflow shows is true: a night whose stage failed is a failed DAG run, with its report written.
    assert [r[1] for r in runs] == ["success", "failed"], runs
    for run_id, *_ in runs[:-1]:
        assert_succeeded(env, run_id)
    missing = run_task_states(env, DAG_ID, runs[-1][0])
    assert missing["stage_dataset"] == "failed" and missing["report"] == "success", missing
    assert all(missing[t] != "success" for t in STAGES[1:-1]), missing  # nothing ran on data that is not there
    # One at a time, in date order: each night starts after the night before ended.
    for before, after in itertools.pairwise(runs):
        assert before[4] <= after[3], f"{after[0]} started before {before[0]} ended"

    # The partition arrives; the same range again, reprocessing failed runs only: the last night alone.
    # A DAG has one backfill at a time, and the scheduler marks a finished one complete on a 30 s timer:
    # as an operator would, the finished backfill is closed through the REST API rather than waited for
    # (409 if the timer came first).
    demo_data(env, dates[-1], SHARDS[-1])
    try:
        api(env, "PUT", f"/api/v2/backfills/{first}/cancel")
    except urllib.error.HTTPError as exc:
        assert exc.code == 409, exc.read()
    assert query(env, "SELECT 1 FROM backfill WHERE id = :id AND completed_at IS NOT NULL", id=first)
    second = backfill(env, dates, "--reprocess-behavior", "failed")
    created = query(
        env,
        "SELECT logical_date, dag_run_id, exception_reason FROM backfill_dag_run"
        " WHERE backfill_id = :id ORDER BY logical_date",
        id=second,
    )
    assert [(day(d), run is not None) for d, run, _ in created] == [(d, d == dates[-1]) for d in dates], created
    assert [reason for *_, reason in created[:-1]] == ["already exists"] * (len(dates) - 1), created

    def rerun_finished() -> list[tuple[Any, ...]] | None:
        rows = backfill_runs(env, second)
        return rows if rows and rows[0][1] in ("success", "failed") else None

    [rerun] = wait_until(rerun_finished, RERUN_DEADLINE_S, "the failed night's run again", every_s=1, services=services)
    assert rerun[0] == runs[-1][0] and rerun[1] == "success", rerun  # the same run, cleared and run again
    assert_succeeded(env, rerun[0])
    tries = dict(
        query(
            env,
            "SELECT run_id, MAX(try_number) FROM task_instance WHERE dag_id = :dag_id"
            " AND task_id = 'stage_dataset' GROUP BY run_id",
            dag_id=DAG_ID,
        )
    )
    assert [tries[r[0]] for r in runs] == [1, 2], tries
    unchanged = backfill_runs(env, first)
    assert unchanged == runs[:-1], "the night that had succeeded ran again"
    assert runs[-2][4] <= rerun[3]
    # No scheduled run beside the backfills.
    assert query(env, "SELECT COUNT(*) FROM dag_run WHERE dag_id = :dag_id", dag_id=DAG_ID) == [(len(dates),)]

    check_runs(Path(env["TRAINYARD_HOME"]), [r[0] for r in runs], dates)
    check_train_log(env, rerun[0])


def check_train_log(env: dict[str, str], run_id: str) -> None:
    """The train task's log file (what the UI shows) has progress lines, and the task links its run page."""
    folder = Path(env["AIRFLOW_HOME"]) / "logs" / f"dag_id={DAG_ID}" / f"run_id={run_id}" / "task_id=train"
    logs = sorted(folder.glob("attempt=*.log"))
    assert logs, f"no train task log under {folder}"
    lines = [
        json.loads(line).get("event", "")
        for log in logs
        for line in log.read_text().splitlines()
        if line.startswith("{")
    ]
    progress = [line for line in lines if line.startswith("progress: attempt 1, world size 1, step ")]
    assert progress and all(f"/{len(SHARDS) * MAX_STEPS}" in line for line in progress), lines[-40:]
    links = api(env, "GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{quote(run_id, safe='')}/taskInstances/train/links")
    assert links["extra_links"] == {"Training run": run_url(env["AIRFLOW__API__BASE_URL"], DAG_ID, run_id)}, links


def api(env: dict[str, str], method: str, path: str, body: Any = None) -> Any:
    request = urllib.request.Request(
        f"{env['AIRFLOW__API__BASE_URL']}{path}",
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def check_runs(home: Path, run_ids: list[str], dates: list[str]) -> None:
    """Each night's ledger: its own partition, its own folder, resumed from the night before's checkpoint."""
    ckpt_root = home / "checkpoints" / DAG_ID
    folders = [run_dir(home / "runs", DAG_ID, run_id) for run_id in run_ids]
    assert len(set(folders)) == len(folders) and sorted(p.name for p in (home / "runs" / DAG_ID).iterdir()) == sorted(
        p.name for p in folders
    )

    previous_final, previous_ckpt = 0, "none"
    copies: dict[str, Path] = {}
    for run_id, date, shards, folder in zip(run_ids, dates, SHARDS, folders):
        ledger = Ledger.in_dir(folder)
        assert json.loads((folder / "spec.json").read_text())["ds"] == date
        ends = {e["stage"]: e["result"] for e in ledger.events(event="stage_end")}
        assert set(STAGES) <= set(ends), f"{run_id}: stages that ended: {sorted(ends)}"
        # The last night failed once, for want of its partition, and was reported both times.
        rerun = date == dates[-1]
        failed = [(e["stage"], e["error"]) for e in ledger.events(event="stage_failed")]
        assert failed == ([("stage_dataset", "DataError")] if rerun else []), (run_id, failed)
        assert len(list(ledger.events("report", "stage_end"))) == (2 if rerun else 1), run_id

        # That night's partition, staged to a folder of its own.
        staged = ends["stage_dataset"]
        assert staged["hot_dir"] == str(home / "hot" / "tokens" / date) and staged["files"] == shards, staged
        assert ends["check_dataset"]["shards"] == shards

        # Resumed from the checkpoint the previous night ended with (decided once), trained MAX_STEPS more.
        [resume] = list(ledger.events("train", "resume_point"))
        assert (resume["start_step"], resume["resume_from"]) == (previous_final, previous_ckpt), run_id
        final = previous_final + MAX_STEPS
        assert (ends["train"]["start_step"], ends["train"]["last_step"]) == (previous_final, final)
        steps = sorted(
            {s for e in ledger.events("train", "step") for s in range(e.get("first_step", e["step"]), e["step"] + 1)}
        )
        assert steps == list(range(previous_final + 1, final + 1)), f"{run_id} trained steps {steps}"
        assert ends["check_checkpoint"]["step"] == final
        ckpt = step_dir(ckpt_root, final)
        assert ends["train"]["checkpoint"] == str(ckpt)
        # Published to a copy of its own (step_NNNNNN.<16 hex>), never over an earlier copy.
        copy = Path(ends["publish"]["uri"].removeprefix("file://"))
        assert copy.parent == home / "cold" / "checkpoints" / DAG_ID and copy.name.startswith(f"{ckpt.name}."), copy
        copies[run_id] = copy
        previous_final, previous_ckpt = final, str(ckpt)

    # Every night's checkpoint is still the one that night wrote: later nights never wrote over it.
    for run_id, step in zip(run_ids, range(MAX_STEPS, previous_final + 1, MAX_STEPS)):
        for ckpt in (step_dir(ckpt_root, step), copies[run_id]):
            assert verify(ckpt) == [] and read_manifest(ckpt)["run_id"] == run_id, ckpt
    last = json.loads((home / "cold" / "checkpoints" / DAG_ID / "PUBLISHED").read_text())
    assert last["path"] == copies[run_ids[-1]].name and last["step"] == previous_final
    assert json.loads((ckpt_root / "LATEST").read_text())["path"] == step_dir(ckpt_root, previous_final).name
    assert not (ckpt_root / "superseded").exists()
