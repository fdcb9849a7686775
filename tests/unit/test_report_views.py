"""The training-runs view's routes, in-process (the real API server: tests/integration/test_ui_view.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient
from test_report_pages import RUN_ID, write_run

from trainyard.airflow import views


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
