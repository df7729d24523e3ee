"""uvicorn's server with its housekeeping tick once a second instead of ten times, and a stop that wakes it at once.

uvicorn's main loop sleeps 0.1 s between ticks so that it notices ``should_exit`` soon; the tick's own work (the
``Date`` header, refreshed once a second) needs one a second. Ten wake-ups a second of an otherwise idle gateway are
most of what it costs doing nothing. Here the loop sleeps until the next second, or until ``should_exit`` is set
(from a signal handler, or another thread: a test's server), which wakes it at once; a subclass that must act at a
moment of its own (a drain's end) says when in :meth:`TickServer.next_tick_s`, or has a tick now (:meth:`TickServer.wake`).
"""

from __future__ import annotations

import asyncio
import contextlib

import uvicorn

TICK_S = 1.0
_UVICORN_TICKS_PER_TICK = 10  # uvicorn's on_tick counts 0.1 s ticks: its once-a-second work runs when counter % 10 == 0


class TickServer(uvicorn.Server):
    """uvicorn's server whose main loop wakes once a second, or as soon as it is told to stop."""

    _exit = False
    _loop: asyncio.AbstractEventLoop | None = None
    _woken: asyncio.Event | None = None

    @property  # type: ignore[override]
    def should_exit(self) -> bool:
        return self._exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._exit = value
        if value:
            self.wake()

    def wake(self) -> None:
        """A tick now (safe from a signal handler and from another thread)."""
        loop, woken = self._loop, self._woken
        if loop is not None and woken is not None and not loop.is_closed():
            loop.call_soon_threadsafe(woken.set)

    def next_tick_s(self) -> float:
        """Seconds until the next tick (at most :data:`TICK_S`)."""
        return TICK_S

    async def main_loop(self) -> None:
        woken = asyncio.Event()
        self._loop, self._woken = asyncio.get_running_loop(), woken
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + _UVICORN_TICKS_PER_TICK) % 864000
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, self.next_tick_s())):
                    await woken.wait()
            woken.clear()
            should_exit = await self.on_tick(counter)
