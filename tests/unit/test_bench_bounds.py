"""``bench/bounds``: a wait in a bench ends at its bound with a message naming what never came, never hangs."""

from __future__ import annotations

import argparse
import json
import time

import pytest
from bounds import BenchTimeout, add_smoke, emit, main, wait_until


def test_wait_until_returns_the_first_value_that_is_not_none_nor_false() -> None:
    answers = iter([None, False, 0, 7])
    assert wait_until(lambda: next(answers), timeout_s=60, what="a value", every_s=0) == 0


def test_a_wait_that_never_ends_fails_naming_what_it_waited_for() -> None:
    calls: list[float] = []
    with pytest.raises(BenchTimeout, match=r"a first step on rank-2: not seen within 0\.05 s"):
        wait_until(lambda: calls.append(time.monotonic()), timeout_s=0.05, what="a first step on rank-2")
    assert len(calls) >= 2  # it polled again before giving up


def test_main_turns_a_bound_that_ran_out_into_status_1_and_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    def bench() -> None:
        wait_until(lambda: None, timeout_s=0, what="node.json")

    with pytest.raises(SystemExit) as ended:
        main(bench)
    assert ended.value.code == 1
    out, err = capsys.readouterr()
    assert out == "" and err == "bench failed: node.json: not seen within 0 s\n"


def test_smoke_flag_and_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_smoke(parser)
    assert parser.parse_args(["--smoke"]).smoke and not parser.parse_args([]).smoke
    emit({"bench": "x", "n": 1})
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == {"bench": "x", "n": 1}
