"""Per-model admission control: a concurrency cap with an optional bounded, timed queue.

Over the cap (and with the queue full, or after waiting ``queue_timeout_s``) a request is refused
with 429 and ``Retry-After``. Requests with a heavy grammar also take one of ``max_concurrent_grammars``
grammar slots: the engine compiles grammars on a few threads (SGLang: min(32, cores + 4)), and a client
sending many large ones at once would leave none for anyone else's small JSON schema. They wait for a slot
up to ``queue_timeout_s`` whatever ``max_queue`` says (a grammar wait is short: a compile, not a generation). A limiter is replaced, not mutated, when limits change: requests
already admitted release the limiter they acquired.
"""

from __future__ import annotations

import asyncio

from gateway.config import LimitSettings
from gateway.core.errors import GatewayError


class ConcurrencyLimiter:
    """Counts requests in flight for one model and enforces its :class:`LimitSettings`."""

    def __init__(self, settings: LimitSettings) -> None:
        self.settings = settings
        self.in_flight = 0
        self.waiting = 0
        self._slots = asyncio.Semaphore(settings.max_concurrent) if settings.max_concurrent else None
        grammars = settings.max_concurrent_grammars
        self._grammar_slots = asyncio.Semaphore(grammars) if grammars else None
        self.grammars_in_flight = 0

    async def acquire(self, model: str) -> None:
        """Admit one request, wait in the queue, or raise GatewayError(429)."""
        if self._slots is not None:
            if self._slots.locked() or self.waiting:
                if self.waiting >= self.settings.max_queue:
                    raise self._overloaded(model, "too many concurrent requests")
                self.waiting += 1
                try:
                    await asyncio.wait_for(self._slots.acquire(), self.settings.queue_timeout_s)
                except TimeoutError:
                    raise self._overloaded(model, f"no free slot within {self.settings.queue_timeout_s:g}s") from None
                finally:
                    self.waiting -= 1
            else:
                await self._slots.acquire()
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
        if self._slots is not None:
            self._slots.release()

    def _overloaded(self, model: str, why: str) -> GatewayError:
        return GatewayError(
            429,
            f"model {model!r} is at its concurrency limit ({self.settings.max_concurrent}): {why}; retry later",
            code="concurrency_limit_exceeded",
            headers={"Retry-After": str(self.settings.retry_after_s)},
        )
