"""``trainyard check -o json``: one JSON document, a row per file, the exit code as with text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from check_specs import write

from trainyard.cli import main as cli


def test_json_has_a_row_per_file_with_its_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "cold").mkdir()
    source = f'{{source: "file://{tmp_path}/cold", name: t}}'
    good = write(tmp_path, "good.yaml", dataset=source)
    bad = write(tmp_path, "my pipeline.yaml", dataset=source, nodes="{count: 2, min: 3, cuont: 1}")
    broken = tmp_path / "broken.yaml"
    broken.write_text("schedule: * * * * *\n")
    assert cli(["check", "--output", "json", str(tmp_path)]) == 1
    rows = {Path(row["file"]).name: row for row in json.loads(capsys.readouterr().out)}
    assert rows["good.yaml"] == {"file": str(good), "ok": True, "errors": [], "warnings": []}
    assert rows["my pipeline.yaml"]["ok"] is False
    fields = [e["field"] for e in rows["my pipeline.yaml"]["errors"]]
    assert fields == ["nodes.cuont", "nodes.min", "pipeline"], rows[bad.name]
    [yaml_error] = rows["broken.yaml"]["errors"]
    assert yaml_error["field"] == "" and yaml_error["message"].startswith("line 1, column 12: invalid YAML")


def test_json_of_all_valid_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "cold").mkdir()
    write(tmp_path, "a.yaml", dataset=f'{{source: "file://{tmp_path}/cold", name: t}}')
    assert cli(["check", "-o", "json", str(tmp_path)]) == 0
    assert [row["ok"] for row in json.loads(capsys.readouterr().out)] == [True]


def test_an_unknown_output_is_refused_by_the_parser(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli(["check", "-o", "yaml", str(tmp_path)])
    assert exited.value.code == 2 and "invalid choice: 'yaml'" in capsys.readouterr().err
