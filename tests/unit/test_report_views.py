"""The training-runs view's routes, in-process (the real API server: tests/integration/test_ui_view.py)."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient
from test_ledger_bounded_reads import bytes_read
from test_report_pages import RUN_ID, write_run

from trainyard.airflow import views
from trainyard.events import tail
from trainyard.events.fold import fold
from trainyard.events.ledger import Ledger, run_dir
from trainyard.protocol.steps import CURVE_POINTS
from trainyard.report.summary import write_report


@pytest.fixture
def client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    """The app over a runs folder with two DAGs; the caller may read ``nightly`` only."""
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path))
    write_run(tmp_path / "runs", dag_id="nightly")
    write_run(tmp_path / "runs", dag_id="secret")

    async def only_nightly() -> views.MayRead:
        async def may_read(dag_id: str) -> bool:
            return dag_id == "nightly"

        return may_read

    views.app.dependency_overrides[views.access] = only_nightly
    yield TestClient(views.app)
    views.app.dependency_overrides.clear()


def test_index_and_run_page(client: TestClient) -> None:
    index = client.get("/")
    assert index.status_code == 200 and RUN_ID in index.text
    assert "secret" not in index.text  # a DAG the caller may not read is not listed
    page = client.get(f"/runs/nightly/{quote(RUN_ID, safe='')}")
    assert page.status_code == 200 and "scale_down" in page.text
    data = client.get(f"/runs/nightly/{quote(RUN_ID, safe='')}/summary.json").json()
    assert data["run_id"] == RUN_ID and data["attempts"] == 2
    assert [r["dag_id"] for r in json.loads(client.get("/api/runs").text)] == ["nightly"]


def test_bad_ids_unknown_runs_and_forbidden_dags(client: TestClient) -> None:
    dots = client.get("/runs/nightly/%2E%2E")  # arrives as '..': clients only collapse literal dot segments
    assert dots.status_code == 404 and "not a valid run id" in dots.text
    assert client.get("/runs/%2E%2E/x/summary.json").json()["detail"].startswith("'..' is not a valid DAG id")
    assert client.get("/runs/nightly/..%2F..%2Fetc/summary.json").status_code == 404
    assert client.get("/runs/nightly/nope").status_code == 404
    assert client.get(f"/runs/secret/{quote(RUN_ID, safe='')}").status_code == 403
    assert client.get(f"/runs/nightly/{quote(RUN_ID, safe='')}/report.html").status_code == 404  # not written yet


def test_without_credentials_the_view_answers_401(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path))
    response = TestClient(views.app).get("/")
    assert response.status_code == 401


# ---------------------------------------------------------------- issue 13: what a run folder links to


RUN = f"/runs/nightly/{quote(RUN_ID, safe='')}"


def _folder(tmp_path: Path, dag_id: str = "nightly") -> Path:
    return run_dir(tmp_path / "runs", dag_id, RUN_ID)


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "airflow.cfg"
    path.write_text("[api_auth]\njwt_secret = hunter2\n")
    return path


def test_the_report_is_sent_sandboxed_and_unsniffed(client: TestClient, tmp_path: Path) -> None:
    write_report(_folder(tmp_path), fold(Ledger.in_dir(_folder(tmp_path)).events()))
    report = client.get(f"{RUN}/report.html")
    assert report.status_code == 200 and "<html" in report.text
    assert report.headers["content-type"].startswith("text/html")
    assert report.headers["content-security-policy"].split(";")[0] == "sandbox"
    assert report.headers["x-content-type-options"] == "nosniff"
    for path in ("/", RUN, f"{RUN}/summary.json", "/api/runs", "/runs/nightly/nope"):
        headers = client.get(path).headers  # pages holding ledger strings run no script either
        assert (
            headers["x-content-type-options"] == "nosniff"
            and "default-src 'none'" in headers["content-security-policy"]
        )


@pytest.mark.parametrize("link", [os.symlink, os.link], ids=["symlink", "hard link"])
def test_a_report_linked_to_a_secret_is_not_served(client: TestClient, tmp_path: Path, secret: Path, link) -> None:
    link(secret, _folder(tmp_path) / "report.html")
    report = client.get(f"{RUN}/report.html")
    assert report.status_code == 404 and "hunter2" not in report.text
    assert "report file" not in client.get(RUN).text  # the run page does not offer it either


def test_a_node_log_is_served_as_text_and_never_through_a_link_or_a_path(
    client: TestClient, tmp_path: Path, secret: Path
) -> None:
    folder = _folder(tmp_path)
    (folder / "attempt-1").mkdir()
    (folder / "attempt-1" / "node-0.log").write_text("step 10 loss 4.1\nRuntimeError: <b>boom</b>\n")
    os.symlink(secret, folder / "attempt-1" / "node-1.log")
    (_folder(tmp_path, "secret") / "attempt-1").mkdir()
    (_folder(tmp_path, "secret") / "attempt-1" / "node-0.log").write_text("hunter2")
    page = client.get(RUN)
    assert f'href="../../runs/nightly/{quote(RUN_ID, safe="")}/attempt-1/node-0.log"' in page.text
    assert 'href="../../../dags/nightly/runs/' in page.text  # the DAG run in Airflow, under any base URL
    log = client.get(f"{RUN}/attempt-1/node-0.log")
    assert log.status_code == 200 and log.headers["content-type"].startswith("text/plain")
    assert "RuntimeError: <b>boom</b>" in log.text
    assert log.headers["content-security-policy"].split(";")[0] == "sandbox"
    for path in (f"{RUN}/attempt-1/node-1.log", f"{RUN}/attempt-1/..%2F..%2Fsecret.log", f"{RUN}/x/spec.json",
                 f"{RUN}/attempt-1/%2E%2E"):  # fmt: skip
        response = client.get(path)
        assert response.status_code == 404 and "hunter2" not in response.text, path
    assert client.get(f"/runs/secret/{quote(RUN_ID, safe='')}/attempt-1/node-0.log").status_code == 403


def test_a_ledger_linked_to_another_dags_ledger_is_not_served(client: TestClient, tmp_path: Path) -> None:
    ledger = _folder(tmp_path) / "events.jsonl"
    ledger.unlink()
    ledger.symlink_to(_folder(tmp_path, "secret") / "events.jsonl")
    for path in (RUN, f"{RUN}/summary.json"):
        response = client.get(path)
        assert response.status_code == 404 and "scale_down" not in response.text and "straggler" not in response.text
    index = client.get("/")
    assert index.status_code == 200 and RUN_ID not in index.text  # one planted link costs its row, not the index


def test_a_dag_never_serves_another_dags_run_from_a_shared_folder(client: TestClient, tmp_path: Path) -> None:
    """``nightly_`` (not readable) once wrote into ``nightly``'s folder; the URL's DAG must own the run."""
    shared = tmp_path / "runs" / "nightly" / "r2"  # where the old names put a run of nightly_
    shared.mkdir()
    (shared / "spec.json").write_text(json.dumps({"dag_id": "nightly_", "run_id": "r2"}))
    Ledger.in_dir(shared).append("train", "step", step=1, loss=0.123456)
    assert run_dir(tmp_path / "runs", "nightly_", "r2") != shared  # today's names are distinct
    for path in ("/runs/nightly/r2", "/runs/nightly/r2/summary.json"):
        response = client.get(path)
        assert response.status_code == 404 and "0.123456" not in response.text
    assert "r2" not in client.get("/").text


# ---------------------------------------------------------------- issue 29: a rank's 200,000-step events file


def test_a_ranks_step_events_cost_the_page_at_most_the_writer_budget(
    client: TestClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank that writes an event per step (or a hostile one): the first visit reads its file only to the
    writer budget (scaled down here), and the chart gets a bounded curve of what was read."""
    monkeypatch.setattr(tail, "WORKER_FILE_BYTES", 2**20, raising=False)
    ledger = Ledger.in_dir(_folder(tmp_path))
    ledger.events_dir.mkdir()
    now, steps = time.time(), 100_000
    lines = (
        f'{{"ts": {now + s * 1e-3}, "stage": "train", "event": "step", "step": {s}, "loss": {2 + 8 / math.sqrt(s)}}}\n'
        for s in range(1, steps + 1)
    )
    (ledger.events_dir / "rank-0.jsonl").write_text("".join(lines))  # 8 MB
    before = bytes_read()
    page = client.get(RUN)
    assert page.status_code == 200 and "steps trained" in page.text
    assert bytes_read() - before < 2**20 + ledger.path.stat().st_size + 2**20  # budget, own ledger, the rest
    summary = client.get(f"{RUN}/summary.json").json()
    assert 10 < summary["last_step"] < steps  # the steps past the budget are left out
    assert len(summary["loss_curve"]) <= CURVE_POINTS + 2
