"""How far behind its own work the event loop runs: the lateness of a timer, smoothed.

A process that keeps up runs a timer within a millisecond of when it is due; one that has more to do than its
core allows (a burst of engine events, a wave of new requests, a machine shared with other work) runs it late
by about as long as everything else that became ready waits. The stream relay reads that figure to decide
whether putting a stream's next read off pays (:meth:`gateway.data.stream_pool.StreamPool.rest_for`).

The probe runs only while someone needs the figure (``active()``): an idle gateway has no timer ticking, and
neither has one whose streams are all relayed by the native thread (no rest is ever taken there): a timer every 5 ms
is ~200 wake-ups of the loop a second, ten per event of a stream whose events come 50 ms apart.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

PROBE_S = 0.005  # a probe every 5 ms: ~200 callbacks a second while streams run
_SMOOTHING = 0.25  # weight of the newest lateness: the figure follows a change within ~4 probes (~20 ms plus the lag)


class LagGauge(Protocol):
    """What the relay reads: the lag now, and a way to have it measured (a test may stand in a fixed one)."""

    lag_s: float

    def start(self) -> None: ...


class LoopLag:
    """The loop's mean lag in seconds (:attr:`lag_s`), measured while ``active()`` says it is wanted."""

    __slots__ = ("lag_s", "_active", "_due", "_running")

    def __init__(self, active: Callable[[], bool]) -> None:
        self.lag_s = 0.0
        self._active = active
        self._due = 0.0
        self._running = False

    def start(self) -> None:
        """Probe from now on, until ``active()`` says no more (the figure is then 0 again: nothing is behind); nothing
        when it says no already."""
        if not self._running and self._active():
            self._running = True
            self._schedule(asyncio.get_running_loop())

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        self._due = loop.time() + PROBE_S
        loop.call_at(self._due, self._probe)

    def _probe(self) -> None:
        loop = asyncio.get_running_loop()
        self.lag_s += _SMOOTHING * (max(0.0, loop.time() - self._due) - self.lag_s)
        if self._active():
            self._schedule(loop)
        else:
            self._running = False
            self.lag_s = 0.0
