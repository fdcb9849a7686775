"""The report of a real run, rendered by a real headless Chromium: a screenshot kept as an artifact, and the
DOM it built read back for every section a new user looks for.

The run is the committed fixture ``tests/fixtures/runs/report_fixture`` (made by ``tools/report_fixture.py``
from one real run of the stages: 2 nodes, node-1 killed at step 10 and relaunched without it, a final
checkpoint damaged before the gate, so ``check_checkpoint`` fails and ``publish`` never runs).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from test_ui_view import Tables, chromium

from trainyard.events.fold import fold
from trainyard.events.ledger import Ledger
from trainyard.report.details import STAGES
from trainyard.report.summary import write_report

pytestmark = pytest.mark.integration

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "runs" / "report_fixture"
AIRFLOW = "https://airflow.example/"
CHARTS = ("loss", "throughput (tokens/s)", "step time (ms)", "learning rate", "world size (ranks)")


def browse(browser: str, profile: Path, *args: str) -> str:
    return subprocess.run(
        [
            browser,
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout


def test_the_report_of_a_failed_run_shows_every_section_in_a_browser(tmp_path: Path) -> None:
    browser = chromium()
    run = tmp_path / "run"
    shutil.copytree(next(FIXTURE.iterdir()), run, symlinks=True)  # the report is written into the run folder
    summary = write_report(run, fold(Ledger.in_dir(run).events()), airflow_base=AIRFLOW)
    page = Path(summary["report"]).as_uri()

    shot = tmp_path / "report.png"
    browse(browser, tmp_path / "chromium", "--window-size=1400,4800", f"--screenshot={shot}", page)
    assert shot.stat().st_size > 10_000
    if artifacts := os.environ.get("TRAINYARD_ARTIFACTS"):
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(artifacts) / "report.png")

    dom = browse(browser, tmp_path / "chromium", "--dump-dom", page)
    tables = Tables(dom)
    for chart in CHARTS:
        assert f'aria-label="{chart} versus step"' in dom, chart
    assert 'class="fault"' in dom  # node-1's loss, on the metrics' step axis

    stages = tables.tables["stages"][1:]
    assert [r[0] for r in stages] == list(STAGES)
    assert tables.row("stages", "publish")[4] == "did not run"
    error = tables.row("stages", "check_checkpoint")[4]
    assert error.startswith("failedCheckpointInvalid:") and error.endswith("changed after the save)")  # whole

    assert tables.row("overrides", "max_steps") == ["max_steps", "30", "24"]
    assert '"max_steps": 24' in dom  # the pinned spec, as the run used it
    checks = tables.tables["data-checks"][1:]
    assert len(checks) == 5 and all(r[2] == "ok" for r in checks)
    assert tables.row("gate", "verdict")[1] == "invalid" and tables.row("gate", "step checked")[1] == "24"
    assert "sha256 mismatch" in dom and tables.tables["gate-checks"][1:]

    run_link = f"{AIRFLOW}dags/report_fixture/runs/manual__2026-12-01T02%3A00%3A00%2B00%3A00"
    assert f'href="{run_link}"' in dom and f'href="{run_link}/tasks/check_checkpoint"' in dom
    assert 'href="attempt-1/node-0.log"' in dom and (run / "attempt-1" / "node-0.log").is_file()
