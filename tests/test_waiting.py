"""``wait_until``, the one poll loop of the tests: it returns what it waited for, and it can fail."""

from __future__ import annotations

import itertools

import pytest

from tests.waiting import wait_until


def test_returns_the_first_truthy_answer() -> None:
    answers = iter([None, 0, {}, {"state": "ready"}])
    assert wait_until(lambda: next(answers), "the model to be ready", timeout_s=5, every_s=0) == {"state": "ready"}


def test_fails_after_the_timeout_naming_what_it_waited_for() -> None:
    with pytest.raises(AssertionError, match=r"^timed out waiting for the model to be ready \(waited 0.05 s\)$"):
        wait_until(lambda: False, "the model to be ready", timeout_s=0.05, every_s=0.01)


def test_a_function_words_the_failure_with_the_state_at_the_end() -> None:
    polls = itertools.count(1)
    with pytest.raises(AssertionError, match=r"^still starting after \d+ polls \(waited 0.05 s\)$"):
        wait_until(lambda: next(polls) < 0, lambda: f"still starting after {next(polls) - 1} polls", timeout_s=0.05, every_s=0.01)


def test_the_predicate_may_stop_the_wait_at_once() -> None:
    def died() -> bool:
        raise AssertionError("the server exited")

    with pytest.raises(AssertionError, match="the server exited"):
        wait_until(died, "never reached", timeout_s=60)
