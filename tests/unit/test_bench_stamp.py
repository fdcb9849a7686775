"""``make bench`` stamps each result with its date and machine, so docs/benchmarks.md says which machine gave a
figure (issue 52: every table said "not recorded")."""

from __future__ import annotations

import datetime
import io
import json
import sys

import pytest

from tools import bench_stamp


def test_a_result_gets_its_date_and_machine_and_keeps_its_own() -> None:
    now = datetime.datetime(2026, 12, 7, 18, 0, tzinfo=datetime.UTC)
    stamped = bench_stamp.stamp('{"bench": "parse", "ms_per_spec": 7.0}', now)
    assert stamped["bench"] == "parse" and stamped["ms_per_spec"] == 7.0
    assert stamped["date"] == "2026-12-07"
    assert " cores, " in stamped["machine"] and "GiB" in stamped["machine"]
    kept = bench_stamp.stamp('{"bench": "gpu", "machine": "1 x H100"}', now)
    assert kept["machine"] == "1 x H100"  # a bench that knows better keeps its word


@pytest.mark.parametrize("line", ["not json", "[1, 2]", ""])
def test_a_bench_that_printed_no_json_object_fails_the_stamp(
    line: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"log line\n{line}\n"))
    assert bench_stamp.main() == 1  # with only the log line, it is the last line, and not JSON
    out = capsys.readouterr()
    assert out.out == "" and "not a JSON object" in out.err


def test_the_stamp_prints_one_json_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO('chatter\n{"bench": "view"}\n'))
    assert bench_stamp.main() == 0
    out = capsys.readouterr().out
    assert json.loads(out)["bench"] == "view" and len(out.splitlines()) == 1
