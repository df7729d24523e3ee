"""Per-model admission control: a concurrency cap with an optional bounded, timed queue.

Over the cap (and with the queue full, or after waiting ``queue_timeout_s``) a request is refused
with 429 and ``Retry-After``. Requests with a heavy grammar also take one of ``max_concurrent_grammars``
grammar slots: the engine compiles grammars on a few threads (SGLang: min(32, cores + 4)), and a client
sending many large ones at once would leave none for anyone else's small JSON schema. They wait for a slot
up to ``queue_timeout_s`` whatever ``max_queue`` says (a grammar wait is short: a compile, not a generation). A limiter is replaced, not mutated, when limits change: requests
already admitted release the limiter they acquired.

The queue is ordered by priority class (a named key's ``priority``; 0 otherwise): a freed slot goes to the
waiting request whose class plus the time it waited (one class per :data:`AGING_S`) is highest, the earliest
first among equals. So a higher class goes ahead, and a lower one is never starved: after waiting
``AGING_S`` seconds per class of difference it goes first.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

from gateway.config import LimitSettings
from gateway.core.errors import GatewayError

AGING_S = 10.0  # a waiting request gains one priority class per this many seconds
_clock = time.monotonic  # when a request started waiting (tests move it)


@dataclass(order=True)
class _Waiter:
    rank: tuple[float, int]  # (-(class - enqueued / AGING_S), arrival): the smallest is served next
    ready: asyncio.Future[None] = field(compare=False)


class ConcurrencyLimiter:
    """Counts requests in flight for one model and enforces its :class:`LimitSettings`."""

    def __init__(self, settings: LimitSettings) -> None:
        self.settings = settings
        self.in_flight = 0
        self._free = settings.max_concurrent  # slots nobody holds (None: no limit)
        self._queue: list[_Waiter] = []
        self._arrivals = itertools.count()
        grammars = settings.max_concurrent_grammars
        self._grammar_slots = asyncio.Semaphore(grammars) if grammars else None
        self.grammars_in_flight = 0

    @property
    def waiting(self) -> int:
        return len(self._queue)

    async def acquire(self, model: str, priority: int = 0) -> None:
        """Admit one request, wait in the queue (by ``priority`` class), or raise GatewayError(429)."""
        if self._free is not None:
            if self._free > 0 and not self._queue:
                self._free -= 1
            else:
                if len(self._queue) >= self.settings.max_queue:
                    raise self._overloaded(model, "too many concurrent requests")
                waiter = _Waiter((-(priority - _clock() / AGING_S), next(self._arrivals)), asyncio.get_running_loop().create_future())
                self._queue.append(waiter)
                try:
                    await asyncio.wait_for(asyncio.shield(waiter.ready), self.settings.queue_timeout_s)
                except BaseException as error:
                    if waiter in self._queue:
                        self._queue.remove(waiter)
                    elif waiter.ready.done():  # handed a slot just as it gave up: pass it on
                        self._hand_over()
                    if isinstance(error, TimeoutError):
                        raise self._overloaded(model, f"no free slot within {self.settings.queue_timeout_s:g}s") from None
                    raise
        self.in_flight += 1

    async def acquire_grammar(self, model: str) -> bool:
        """Take a grammar slot (waiting up to ``queue_timeout_s``, else GatewayError(429)); False when unlimited."""
        if self._grammar_slots is None:
            return False
        try:
            await asyncio.wait_for(self._grammar_slots.acquire(), self.settings.queue_timeout_s)
        except TimeoutError:
            raise GatewayError(
                429,
                f"model {model!r} is compiling {self.settings.max_concurrent_grammars} large grammars already, and none "
                f"finished within {self.settings.queue_timeout_s:g}s; retry later",
                code="grammar_limit_exceeded",
                headers={"Retry-After": str(self.settings.retry_after_s)},
            ) from None
        self.grammars_in_flight += 1
        return True

    def release_grammar(self) -> None:
        self.grammars_in_flight -= 1
        if self._grammar_slots is not None:
            self._grammar_slots.release()

    def release(self) -> None:
        self.in_flight -= 1
        if self._free is not None:
            self._hand_over()

    def _hand_over(self) -> None:
        """A slot came free: to the best-ranked waiter, else back to the pool."""
        assert self._free is not None
        if self._queue:
            waiter = min(self._queue)
            self._queue.remove(waiter)
            waiter.ready.set_result(None)
        else:
            self._free += 1

    def _overloaded(self, model: str, why: str) -> GatewayError:
        return GatewayError(
            429,
            f"model {model!r} is at its concurrency limit ({self.settings.max_concurrent}): {why}; retry later",
            code="concurrency_limit_exceeded",
            headers={"Retry-After": str(self.settings.retry_after_s)},
        )
