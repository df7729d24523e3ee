"""An asyncio event loop that counts its own passes and says which code schedules its timers: what a gateway served
on it (``uvicorn``'s ``loop`` setting: :data:`COUNTING_LOOP`) wakes for, counted rather than timed.

A pass is one call of the selector (``epoll_wait``): the loop wakes for a socket, a thread's call, or a timer. A
timer is charged to the innermost frame of the project's code (``gateway/``) on the stack where it was scheduled:
``asyncio.sleep`` and ``wait_for`` in a coroutine of the batch runner show as that coroutine.
"""

from __future__ import annotations

import asyncio
import selectors
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

COUNTING_LOOP = "tests.loop_count:counting_loop"  # uvicorn.Config(loop=...): a custom loop factory, by import string
_GATEWAY = str(Path(__file__).resolve().parents[1] / "gateway")


class Tally:
    """What the loop did while :attr:`on`: its passes, and its timers by the gateway code that scheduled them."""

    def __init__(self) -> None:
        self.on = False
        self.passes = 0
        self.timers: Counter[str] = Counter()

    def start(self) -> None:
        self.passes = 0
        self.timers.clear()
        self.on = True

    def stop(self) -> None:
        self.on = False


TALLY = Tally()  # the last counting loop's (one gateway served on it at a time)


class _CountingSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if TALLY.on:
            TALLY.passes += 1
        return super().select(timeout)


class CountingLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        super().__init__(_CountingSelector())

    def call_at(self, when: float, callback: Any, *args: Any, context: Any = None) -> asyncio.TimerHandle:
        if TALLY.on:
            TALLY.timers[_scheduler()] += 1
        return super().call_at(when, callback, *args, context=context)


def _scheduler() -> str:
    """``module.py:function`` of the innermost gateway frame on the stack (``other`` when none)."""
    for frame in reversed(traceback.extract_stack(limit=40)[:-2]):
        if frame.filename.startswith(_GATEWAY):
            return f"{Path(frame.filename).relative_to(_GATEWAY).as_posix()}:{frame.name}"
    return "other"


def counting_loop() -> asyncio.AbstractEventLoop:
    return CountingLoop()
