"""The tests' one bounded wait (``tests/waiting.py``): what it returns, and how it fails when the bound runs out."""

from __future__ import annotations

import pytest
from waiting import WaitedTooLong, wait_for


def test_it_returns_the_first_truthy_answer_and_asks_no_more() -> None:
    answers = iter([None, [], {"node-0": 3}, {"node-1": 4}])
    asked: list[int] = []

    def predicate() -> object:
        asked.append(1)
        return next(answers)

    assert wait_for(predicate, 10, "a fault report", every_s=0) == {"node-0": 3}
    assert len(asked) == 3


def test_a_wait_that_runs_out_names_what_it_waited_for_and_its_context() -> None:
    asked: list[int] = []
    with pytest.raises(WaitedTooLong, match=r"waited 0 s for node-3's report; it never came\nnode-3.log: empty"):
        wait_for(lambda: asked.append(1), 0, "node-3's report", context=lambda: "node-3.log: empty")
    assert asked == [1]  # asked once even with no time to wait: an answer already there counts


def test_it_is_an_assertion_error_so_a_test_fails_rather_than_errors() -> None:
    assert issubclass(WaitedTooLong, AssertionError)
