"""Per-model admission control: a concurrency cap with an optional bounded, timed queue.

Over the cap (and with the queue full, or after waiting ``queue_timeout_s``) a request is refused
with 429 and ``Retry-After``. A limiter is replaced, not mutated, when limits change: requests
already admitted release the limiter they acquired.
"""

from __future__ import annotations

import asyncio

from gateway.config import LimitSettings
from gateway.errors import GatewayError


class ConcurrencyLimiter:
    """Counts requests in flight for one model and enforces its :class:`LimitSettings`."""

    def __init__(self, settings: LimitSettings) -> None:
        self.settings = settings
        self.in_flight = 0
        self.waiting = 0
        self._slots = asyncio.Semaphore(settings.max_concurrent) if settings.max_concurrent else None

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
