"""Retention of run folders: what a run's report task removes of its pipeline's older runs, and what it never does."""

from __future__ import annotations

import os
import time
from pathlib import Path

from trainyard.events.ledger import Ledger
from trainyard.pipeline.retention import DAY_S, drop_expired_runs, expired_runs

NOW = time.time()


def run_folder(runs: Path, name: str, quiet_days: float, shard_days: float | None = None) -> Path:
    run = runs / name
    Ledger.in_dir(run).append("stage_dataset", "stage_end", seconds=1.0, result={})
    (run / "report.html").write_text("report")
    os.utime(run / "events.jsonl", (NOW - quiet_days * DAY_S,) * 2)
    if shard_days is not None:
        (run / "events.d").mkdir()
        shard = run / "events.d" / "node-0.jsonl"
        shard.write_text("{}\n")
        os.utime(shard, (NOW - shard_days * DAY_S,) * 2)
    return run


def test_runs_quiet_for_longer_than_the_retention_go_and_the_rest_stay(tmp_path: Path) -> None:
    runs = tmp_path / "runs" / "nightly"
    old = run_folder(runs, "scheduled__2026-10-01", quiet_days=40)
    recent = run_folder(runs, "scheduled__2026-11-20", quiet_days=10)
    training = run_folder(runs, "manual__long", quiet_days=45, shard_days=0.01)  # weeks old, still writing
    current = run_folder(runs, "scheduled__2026-12-04", quiet_days=0)
    assert drop_expired_runs(current, keep_days=30, now=NOW) == ["scheduled__2026-10-01"]
    assert not old.exists() and recent.exists() and training.exists() and current.exists()


def test_never_the_current_run_a_link_or_a_folder_that_is_not_a_run(tmp_path: Path) -> None:
    runs = tmp_path / "runs" / "nightly"
    current = run_folder(runs, "now", quiet_days=90)  # even a current run with an old ledger
    elsewhere = run_folder(tmp_path / "elsewhere", "precious", quiet_days=90)
    (runs / "linked").symlink_to(elsewhere)
    mine = runs / "notes"
    mine.mkdir()
    (mine / "events.jsonl").mkdir()  # not a regular file: not a ledger
    os.utime(mine, (NOW - 90 * DAY_S,) * 2)
    person = runs / "someones-folder"
    person.mkdir()
    os.utime(person, (NOW - 90 * DAY_S,) * 2)
    assert expired_runs(runs, 30, NOW, current) == []
    assert drop_expired_runs(current, 30, NOW) == []
    assert current.exists() and elsewhere.exists() and (runs / "linked").is_symlink() and person.exists()


def test_zero_keeps_every_run(tmp_path: Path) -> None:
    runs = tmp_path / "runs" / "nightly"
    old = run_folder(runs, "ancient", quiet_days=400)
    assert drop_expired_runs(run_folder(runs, "now", quiet_days=0), keep_days=0, now=NOW) == [] and old.exists()


def test_the_deployment_sets_the_retention_in_the_providers_config_section(monkeypatch) -> None:
    from airflow.sdk import conf

    from trainyard.airflow.provider import get_provider_info

    option = get_provider_info()["config"]["trainyard"]["options"]["runs_retention_days"]
    assert option["default"] == "30" and option["type"] == "float"
    monkeypatch.setenv("AIRFLOW__TRAINYARD__RUNS_RETENTION_DAYS", "90")
    assert conf.getfloat("trainyard", "runs_retention_days", fallback=30) == 90.0
