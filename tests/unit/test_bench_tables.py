"""docs/benchmarks.md quotes exactly what the committed bench/results/*.json say (tools/bench_tables.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools import bench_tables
from tools.bench_tables import BENCHES, Bench, Figure, ResultsError, bench_table, render, splice


def test_the_committed_page_is_the_generators_output() -> None:
    doc = bench_tables.DOC.read_text()
    assert splice(doc, render()) == doc, (
        "docs/benchmarks.md differs from bench/results: run python -m tools.bench_tables"
    )


def test_every_bench_script_has_a_table() -> None:
    scripts = {p.stem for p in (bench_tables.ROOT / "bench").glob("*.py")}
    assert scripts == {bench.name for bench in BENCHES}


def _results(tmp_path: Path, *runs: dict[str, object]) -> Path:
    (tmp_path / "demo.json").write_text("".join(json.dumps(run) + "\n" for run in runs))
    return tmp_path


def test_a_table_gives_median_spread_runs_and_whether_the_goal_is_met(tmp_path: Path) -> None:
    bench = Bench("demo", (Figure("x.y", "a figure", "<= 2"), Figure("ok", "a check", "== true")))
    results = _results(
        tmp_path,
        {"x": {"y": 1.5}, "ok": True, "machine": "2-core VM"},
        {"x": {"y": 3.0}, "ok": True, "machine": "2-core VM", "date": "2026-12-04"},
        {"x": {"y": 2.5}, "ok": False},
    )
    table = bench_table(bench, results)
    assert "Runs (JSON lines): 3; date: 2026-12-04; machine: 2-core VM." in table
    assert "| `x.y` | a figure | **2.5** | 1.5 to 3 | 3 | <= 2 | no |" in table
    assert "| `ok` | a check | **false** | 2 of 3 true | 3 | == true | no |" in table


def test_what_runs_do_not_record_is_said_to_be_not_recorded(tmp_path: Path) -> None:
    table = bench_table(Bench("demo", (Figure("x", "a figure"),)), _results(tmp_path, {"x": 0.123456789}))
    assert "date: not recorded; machine: not recorded" in table
    assert "| `x` | a figure | **0.123457** | one run | 1 |  |  |" in table


def test_a_bench_without_results_has_no_figure(tmp_path: Path) -> None:
    assert "No committed result" in bench_table(Bench("absent", ()), tmp_path)


def test_a_figure_no_run_has_names_the_file_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ResultsError, match=r"demo\.json: no run has the field 'gone'.*BENCHES"):
        bench_table(Bench("demo", (Figure("gone", "renamed"),)), _results(tmp_path, {"x": 1}))


def test_a_page_without_markers_is_refused() -> None:
    with pytest.raises(ResultsError, match="markers"):
        splice("no markers here", "tables")
