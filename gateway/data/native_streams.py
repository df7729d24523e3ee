"""Streams relayed off the event loop once their head has passed, by a native thread (``_relay_loop.c``).

A Python relay costs every event a trip through the interpreter: the loop's read callback, the chunk parser's
callback, the cut, the scan, the write. Once a stream's first events have gone out, none of that needs Python
until something happens: a usage object, an error or a new Responses id to read, a client that does not keep up,
the end. So the stream is handed to a thread of its own (duplicates of both sockets, the engine's paused in the
loop), which reads, cuts, scans and writes each read in C, and reports only those moments back through an eventfd
the loop watches. Python keeps the head, the errors, the accounting, the end, and every decision about them.

Where the extension is not built (no compiler when the package was installed), or ``gateway.relay_native`` is
off, streams are relayed in Python, as before; the gateway says which at startup.
"""

from __future__ import annotations

import asyncio
import os
from typing import Protocol

from loguru import logger

try:
    from gateway.data import _relay_loop
except ImportError:  # not built: the pure-Python relay serves (said once, at startup)
    _relay_loop = None  # type: ignore[assignment]

BUILT = _relay_loop is not None


class NativeOwner(Protocol):
    """What a stream's relay hears from the thread (it tells the exchange what concerns the engine's side)."""

    def native_inspect(self, events: bytes) -> None: ...  # events to parse and relay; then resume()
    def native_blocked(self, unsent: bytes) -> None: ...  # the client took part of a write: the rest; then resume()
    def native_gone(self, errno: int) -> None: ...  # the client's socket failed
    def native_ended(self, outcome: str, detail: str, reusable: bool, totals: NativeTotals) -> None: ...  # "end", "lost", "malformed"
    def native_totals(self, totals: NativeTotals) -> None: ...  # taken back before the end (cut, timed out)


class NativeTotals:
    """What the thread relayed of a stream: events counted, its last events, and a partial event at the end."""

    __slots__ = ("events", "last", "pending")

    def __init__(self, events: int, last: bytes, pending: bytes) -> None:
        self.events = events
        self.last = last
        self.pending = pending


# The relay thread runs this much below the event loop's scheduling priority (its nice value, +5: about a third of the
# loop's share of a contended core). Where cores are to spare it changes nothing; where the process's cores are
# saturated, new streams (the loop: their requests, their first token) go first, and a thread behind catches up by
# reading several events per read, which costs less per event. Paced, 2,048 streams on 2 shared cores, two runs
# each: TTFT p50 40.0 / 40.7 ms against 41.6 / 56.1 ms at the same priority, events/s 68.4k / 70.2k against 67.1k /
# 66.7k, CPU per event 9.8 / 9.9 µs against 10.1 / 10.2; the added gap p99 27-36 ms against 21-24 (the router's: 57-107).
RELAY_THREAD_NICE = 5


class NativeStreams:
    """One relay thread for one event loop: streams attach, reports go to their owners in the loop."""

    def __init__(self, needles: list[list[bytes]]) -> None:
        assert _relay_loop is not None
        self._engine = _relay_loop.Engine(needles, nice=RELAY_THREAD_NICE)
        self._owners: dict[int, NativeOwner] = {}
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._engine.fileno(), self._on_reports)
        self._closed = False

    def attach(
        self, upstream_fd: int, client_fd: int, body_so_far: bytes, pending: bytes, kind: int, chunked: bool, owner: NativeOwner
    ) -> int | None:
        """Relay a stream from here on; None (the descriptors then still the caller's): its body so far cannot be
        taken over (its framing is not chunked, or is broken, or it has ended)."""
        if self._closed:
            return None
        try:
            stream = self._engine.attach(upstream_fd, client_fd, body_so_far, pending, kind, chunked)
        except (ValueError, OSError) as error:
            logger.debug("native relay: a stream stays in Python: {}", error)
            return None
        self._owners[stream] = owner
        return stream

    def resume(self, stream: int) -> None:
        self._engine.resume(stream)

    def detach(self, stream: int) -> None:
        """Stop relaying a stream (cut or failed in the loop): its owner is told what was relayed (``native_totals``).
        One that had ended in the thread, its end reported but not yet read here (a client that leaves at once when it
        has the end: the loop notices before it reads the report), gets that report now: its end and its last events."""
        totals = self._engine.detach(stream)
        if totals is None and stream in self._owners:
            self._on_reports()
        owner = self._owners.pop(stream, None)
        if totals is not None and owner is not None:
            owner.native_totals(NativeTotals(*totals))

    @property
    def live(self) -> int:
        """Streams attached and not yet ended or detached."""
        return len(self._owners)

    def last_read(self, stream: int) -> float | None:
        return self._engine.last_read(stream)

    def stats(self) -> dict[str, int]:
        return self._engine.stats()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self._engine.fileno())
        self._engine.close()  # (every stream still attached is detached: its owners end it as their exchanges close)

    def _on_reports(self) -> None:
        engine = _relay_loop
        for stream, report, errno, extra, events, first, second in self._engine.take():
            owner = self._owners.get(stream)
            if owner is None:  # detached meanwhile
                continue
            try:
                if report == engine.INSPECT:
                    owner.native_inspect(first)
                elif report == engine.BLOCKED:
                    owner.native_blocked(first)
                elif report == engine.GONE:
                    owner.native_gone(errno)
                else:
                    del self._owners[stream]
                    totals = NativeTotals(events, first, second)
                    if report == engine.END:
                        owner.native_ended("end", "", not extra, totals)
                    elif report == engine.LOST:
                        owner.native_ended("lost", _errno_text(errno), False, totals)
                    else:
                        owner.native_ended("malformed", "broken chunk framing", False, totals)
            except Exception:  # an owner's bug must not stop the reports of every other stream
                logger.exception("native relay: handling a report of stream {} failed", stream)


def _errno_text(errno: int) -> str:
    return os.strerror(errno) if errno else ""
