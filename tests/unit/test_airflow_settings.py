"""airflow_settings.yaml: a connection the metadata DB would refuse is named before any DB is touched."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainyard.airflow.settings import load_settings, main

ROOT = Path(__file__).resolve().parents[2]


def test_the_project_file_loads() -> None:
    settings = load_settings(ROOT / "airflow_settings.yaml")
    assert [c["conn_id"] for c in settings["connections"]] == ["trainyard_cold"]


@pytest.mark.parametrize(
    "entry", ["{conn_id: cold}", "{conn_id: cold, conn_type: ''}", "{conn_id: cold, conn_type: 3}"]
)
def test_a_connection_without_a_type_is_named_with_the_fix(tmp_path: Path, entry: str) -> None:
    path = tmp_path / "airflow_settings.yaml"
    path.write_text(f"airflow:\n  connections:\n    - {{conn_id: ok, conn_type: aws}}\n    - {entry}\n")
    with pytest.raises(ValueError) as caught:
        load_settings(path)
    assert str(caught.value) == (
        f"{path}: airflow.connections[1] (cold): conn_type is missing; set it (aws, kubernetes, smtp, ...)"
    )


def test_the_command_prints_that_line_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "airflow_settings.yaml"
    path.write_text("airflow:\n  connections:\n    - conn_id: cold\n")
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"{path}: airflow.connections[0] (cold): conn_type is missing; set it (aws, kubernetes, smtp, ...)\n"
