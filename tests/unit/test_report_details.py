"""What a run's pages show beside its ledger (``report.details``): GX results, node logs read without
following links, links to the run in Airflow."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainyard.atomic import UnsafePath
from trainyard.report import details
from trainyard.report.details import airflow_links, expectations, node_logs, read_node_log, run_details


def gx(*checks: tuple[str, bool, dict]) -> dict:
    return {
        "success": all(ok for _, ok, _ in checks),
        "results": [
            {
                "expectation_config": {"description": d, "type": "expect_x"},
                "success": ok,
                "result": r,
                "exception_info": {"raised_exception": False},
            }
            for d, ok, r in checks
        ],
    }


def test_expectations_read_each_check_with_what_it_saw() -> None:
    rows = expectations(
        gx(
            ("shard count at least 1", True, {"observed_value": 2}),
            (
                "tokens per shard at least 10",
                False,
                {"element_count": 3, "unexpected_count": 1, "partial_unexpected_list": ["shard_2.tok"]},
            ),
        )
    )
    assert rows == [
        {"suite": None, "check": "shard count at least 1", "passed": True, "observed": "2"},
        {
            "suite": None,
            "check": "tokens per shard at least 10",
            "passed": False,
            "observed": "1 of 3 rows outside (e.g. shard_2.tok)",
        },
    ]
    text = expectations({"success": True, "files": gx(("a", True, {})), "documents": gx(("b", True, {}))})
    assert [(r["suite"], r["check"]) for r in text] == [("files", "a"), ("documents", "b")]
    assert expectations(["not", "a", "result"]) == []


def run_folder(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    for name in ("burn-in/node-0.log", "attempt-1/node-0.log", "attempt-10/node-1.log", "attempt-2/node-0.log"):
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(f"log of {name}\n")
    return run


def test_node_logs_are_listed_in_attempt_order_without_links(tmp_path: Path) -> None:
    run = run_folder(tmp_path)
    secret = tmp_path / "secret.log"
    secret.write_text("secret")
    os.symlink(secret, run / "attempt-1" / "node-9.log")  # planted by a rank
    os.symlink(tmp_path, run / "attempt-3")
    (run / "attempt-1" / "notes.txt").write_text("not a log")
    names = [log["name"] for log in node_logs(run)]
    assert names == ["burn-in/node-0.log", "attempt-1/node-0.log", "attempt-2/node-0.log", "attempt-10/node-1.log"]


def test_read_node_log_refuses_paths_and_links_and_serves_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = run_folder(tmp_path)
    assert read_node_log(run, "attempt-2/node-0.log") == b"log of attempt-2/node-0.log\n"
    (tmp_path / "secret.log").write_text("secret")
    os.symlink(tmp_path / "secret.log", run / "attempt-1" / "node-9.log")
    os.symlink(tmp_path, run / "attempt-3")
    for name in ("../secret.log", "attempt-1/../../secret.log", "spec.json", "/etc/passwd.log", "attempt-1/.log"):
        with pytest.raises(FileNotFoundError):
            read_node_log(run, name)
    with pytest.raises(UnsafePath):
        read_node_log(run, "attempt-1/node-9.log")
    with pytest.raises(UnsafePath):
        read_node_log(run, "attempt-3/secret.log")  # a linked folder is refused, not followed
    monkeypatch.setattr(details, "MAX_LOG", 8)
    assert read_node_log(run, "attempt-2/node-0.log") == b"e-0.log\n"  # the last 8 bytes: where the error is


def test_links_reach_the_dag_run_and_every_tasks_page_under_the_base_url() -> None:
    links = airflow_links("https://air.example/", "nightly", "manual__2026-12-01T02:00:00+00:00")
    run = "https://air.example/dags/nightly/runs/manual__2026-12-01T02%3A00%3A00%2B00%3A00"
    assert links["dag_run"] == run
    assert links["tasks"]["check_checkpoint"] == f"{run}/tasks/check_checkpoint"
    assert list(links["tasks"]) == list(details.STAGES)


def test_run_details_say_why_a_file_is_not_shown(tmp_path: Path) -> None:
    run = run_folder(tmp_path)
    (run / "spec.json").write_text('{"spec": {"training": {"max_steps": 24}}, "dag_id": "d", "run_id": "r"}')
    (run / "data_quality.json").write_text("{not json")
    os.symlink(tmp_path / "elsewhere.json", run / "metric_quality.json")
    got = run_details(run, "d", "r", "/")
    assert got["spec"] == {"training": {"max_steps": 24}}
    assert got["data_checks"] == [] and got["gate_checks"] == []
    assert len(got["problems"]) == 2 and all("cannot be shown" in p for p in got["problems"])
    assert got["links"]["dag_run"] == "/dags/d/runs/r"
