"""The project-local PostgreSQL cluster of ``make airflow`` and the service tests, for real."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from tools import localpg

pytestmark = pytest.mark.integration


@pytest.fixture
def folder() -> Iterator[Path]:
    try:
        localpg.binaries()
    except localpg.PostgresUnavailable as exc:
        pytest.skip(str(exc))
    path = Path(tempfile.mkdtemp(prefix="trainyard-pg-"))  # reachable by the server's user (see conftest)
    try:
        yield path
    finally:
        localpg.stop(path)
        shutil.rmtree(path, ignore_errors=True)


def rows(url: str, sql: str) -> list[tuple]:
    """Run ``sql`` in a transaction of its own; the rows it returns, if any."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn:
            result = conn.execute(sa.text(sql))
            return [tuple(r) for r in result] if result.returns_rows else []
    finally:
        engine.dispose()


def test_a_cluster_listens_on_localhost_with_a_password_and_keeps_its_data_across_restarts(folder: Path) -> None:
    port = localpg.start(folder, fast=True)
    assert localpg.start(folder, fast=True) == port  # already running: kept as it is
    url = localpg.create_database(folder, "pipelines")
    assert localpg.create_database(folder, "pipelines") == url  # safe to repeat
    assert url.startswith("postgresql+psycopg2://airflow:") and url.endswith(f"@127.0.0.1:{port}/pipelines")
    assert (folder / "password").stat().st_mode & 0o077 == 0

    assert rows(url, "SHOW listen_addresses") == [("127.0.0.1",)]
    assert rows(url, "SELECT current_user, current_database()") == [("airflow", "pipelines")]
    rows(url, "CREATE TABLE night (ds text)")
    rows(url, "INSERT INTO night VALUES ('2026-11-28')")
    password = (folder / "password").read_text().strip()
    with pytest.raises(sa.exc.OperationalError, match="password authentication failed"):
        rows(url.replace(password, "not-the-password"), "SELECT 1")

    assert localpg.stop(folder) is True
    assert localpg.running_port(folder) is None and localpg.stop(folder) is False
    with pytest.raises(sa.exc.OperationalError):
        rows(url, "SELECT 1")

    localpg.start(folder, fast=True)
    assert rows(localpg.create_database(folder, "pipelines"), "SELECT ds FROM night") == [("2026-11-28",)]


@pytest.mark.skipif(os.geteuid() != 0, reason="only root hands the cluster to another user")
def test_a_folder_the_servers_user_cannot_reach_is_named_with_the_fix(tmp_path: Path, capsys) -> None:
    try:
        localpg.binaries()
    except localpg.PostgresUnavailable as exc:
        pytest.skip(str(exc))
    tmp_path.chmod(0o700)  # pytest's folders are root's alone
    assert localpg.main(["start", str(tmp_path / "pg")]) == 1
    err = capsys.readouterr().err
    assert f"cannot write {tmp_path / 'pg'}" in err and "chmod o+x" in err and "Traceback" not in err
