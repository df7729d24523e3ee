"""Waiting for something that happens on another thread, process or machine: one poll loop for every test.

A test that sleeps a fixed time is slow on a fast machine and flaky on a loaded one; a test that polls with its own
deadline loop repeats the loop and words its failure each time differently. ``wait_until`` polls until a condition
holds, returns what the condition returned (the state it waited for), and fails with what it was waiting for.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], what: str | Callable[[], object], timeout_s: float = 30, every_s: float = 0.1) -> T:
    """Call ``predicate`` every ``every_s`` until it returns something truthy, and return that.

    After ``timeout_s`` it fails with ``what``: a description, or a function called then for one that shows the state
    (the last answer, a log tail). ``predicate`` may itself raise to stop waiting at once (a process that died)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() >= deadline:
            text = what() if callable(what) else f"timed out waiting for {what}"
            raise AssertionError(f"{text} (waited {timeout_s:g} s)")
        time.sleep(every_s)
