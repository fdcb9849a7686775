"""YAML mistakes and field typos are explained, not quoted raw from PyYAML (issue 52)."""

from __future__ import annotations

from pathlib import Path

from check_specs import GOOD, text

from trainyard.spec import check_files


def lines(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "p.yaml"
    path.write_text(body)
    return check_files([path])


def test_an_unquoted_cron_is_told_that_star_starts_an_alias(tmp_path: Path) -> None:
    [line] = lines(tmp_path, text(schedule="*/5 * * * *"))
    assert "line 4, column" in line and "invalid YAML" in line
    assert "a value starting with '*' is read as a YAML alias" in line
    assert "quote it: schedule: '*/5 * * * *'" in line


def test_a_tab_is_told_to_use_spaces(tmp_path: Path) -> None:
    [line] = lines(tmp_path, text() + "recovery:\n\tmax_restarts: 3\n")
    assert "YAML indents with spaces, never tabs: replace the tab with spaces" in line, line


def test_an_unknown_field_gets_the_closest_name(tmp_path: Path) -> None:
    found = lines(tmp_path, text(nodes="{cuont: 2}"))
    assert any("nodes.cuont: unknown field (did you mean 'count'?); allowed here: backend, count" in f for f in found)


def test_no_guess_when_nothing_is_close(tmp_path: Path) -> None:
    found = lines(tmp_path, text(nodes="{count: 2, zzzz: 1}"))
    assert any("nodes.zzzz: unknown field; allowed here:" in f for f in found), found


def test_a_top_level_typo_is_guessed_too(tmp_path: Path) -> None:
    body = text().replace("training:", "trainig:")
    assert "training" in GOOD
    assert any("trainig: unknown field (did you mean 'training'?)" in f for f in lines(tmp_path, body))
