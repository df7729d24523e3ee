"""Per-model admission control (gateway.core.limits): the concurrency cap, its bounded timed queue, the 429s (pure)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from gateway.config import LimitSettings
from gateway.core import limits
from gateway.core.errors import GatewayError
from gateway.core.limits import ConcurrencyLimiter


def _run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 10))


async def _refused(limiter: ConcurrencyLimiter, model: str = "m") -> GatewayError:
    with pytest.raises(GatewayError) as refused:
        await asyncio.wait_for(limiter.acquire(model), 2)  # a refusal is at once (or after queue_timeout_s), never a hang
    return refused.value


def test_without_a_cap_every_request_is_admitted_and_counted() -> None:
    limiter = ConcurrencyLimiter(LimitSettings())
    assert limiter.in_flight == 0 and limiter.waiting == 0

    async def scenario() -> None:
        for _ in range(50):
            await limiter.acquire("m")
        assert limiter.in_flight == 50 and limiter.waiting == 0
        limiter.release()
        assert limiter.in_flight == 49

    _run(scenario)


def test_over_the_cap_without_a_queue_is_refused_at_once() -> None:
    limiter = ConcurrencyLimiter(LimitSettings(max_concurrent=2, retry_after_s=7))

    async def scenario() -> None:
        await limiter.acquire("m")
        await limiter.acquire("m")
        assert limiter.in_flight == 2
        error = await _refused(limiter, "big-model")
        assert error.status == 429 and error.code == "concurrency_limit_exceeded"
        assert error.headers == {"Retry-After": "7"}
        assert error.message == (
            "model 'big-model' is at its concurrency limit (2): too many concurrent requests; retry later"
        )
        assert limiter.in_flight == 2 and limiter.waiting == 0
        limiter.release()  # a released slot admits the next request
        await asyncio.wait_for(limiter.acquire("m"), 2)
        assert limiter.in_flight == 2

    _run(scenario)


def test_a_queued_request_waits_for_a_slot() -> None:
    limiter = ConcurrencyLimiter(LimitSettings(max_concurrent=1, max_queue=1, queue_timeout_s=5))

    async def scenario() -> None:
        await limiter.acquire("m")
        waiter = asyncio.ensure_future(limiter.acquire("m"))
        await asyncio.sleep(0.05)
        assert not waiter.done() and limiter.waiting == 1 and limiter.in_flight == 1
        await _refused(limiter)  # the queue (one place) is full
        assert limiter.waiting == 1
        limiter.release()
        await asyncio.wait_for(waiter, 2)
        assert limiter.in_flight == 1 and limiter.waiting == 0

    _run(scenario)


def test_a_request_arriving_while_others_wait_queues_behind_them() -> None:
    limiter = ConcurrencyLimiter(LimitSettings(max_concurrent=1, max_queue=2, queue_timeout_s=5))

    async def scenario() -> None:
        await limiter.acquire("m")
        queued = asyncio.ensure_future(limiter.acquire("m"))
        await asyncio.sleep(0)
        assert limiter.waiting == 1
        limiter.release()  # the slot goes to the one waiting
        arriving = asyncio.ensure_future(limiter.acquire("m"))
        await asyncio.wait_for(queued, 2)
        await asyncio.sleep(0.01)
        assert not arriving.done() and limiter.in_flight == 1 and limiter.waiting == 1
        arriving.cancel()
        await asyncio.gather(arriving, return_exceptions=True)
        assert limiter.waiting == 0

    _run(scenario)


def test_the_queue_serves_higher_classes_first_and_ages_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    limiter = ConcurrencyLimiter(LimitSettings(max_concurrent=1, max_queue=30, queue_timeout_s=60))
    clock = [1000.0]
    monkeypatch.setattr(limits, "_clock", lambda: clock[0])
    served: list[str] = []

    async def one(name: str, priority: int) -> None:
        await limiter.acquire("m", priority)
        served.append(name)

    async def scenario() -> None:
        await limiter.acquire("m")
        tasks = [asyncio.ensure_future(one(f"low-{i}", 0)) for i in range(20)]
        await asyncio.sleep(0)
        clock[0] += 5  # the high one arrives 5 s after 20 low ones: one class outranks 5 s of waiting
        tasks.append(asyncio.ensure_future(one("high", 1)))
        clock[0] += 0.1
        tasks.append(asyncio.ensure_future(one("late-low", 0)))
        await asyncio.sleep(0)
        limiter.release()
        await asyncio.sleep(0.01)
        assert served == ["high"]
        clock[0] = 1000.0 + 2 * limits.AGING_S
        tasks.append(asyncio.ensure_future(one("new-high", 1)))  # 20 s after the low ones: they aged past it
        await asyncio.sleep(0)
        for _ in range(22):
            limiter.release()
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        assert served[1:] == [*(f"low-{i}" for i in range(20)), "late-low", "new-high"]

    _run(scenario)


def test_a_queued_request_is_refused_after_queue_timeout_s() -> None:
    limiter = ConcurrencyLimiter(LimitSettings(max_concurrent=1, max_queue=4, queue_timeout_s=0.1, retry_after_s=2))

    async def scenario() -> None:
        await limiter.acquire("m")
        started = asyncio.get_running_loop().time()
        error = await _refused(limiter)
        assert asyncio.get_running_loop().time() - started >= 0.09
        assert error.status == 429 and error.code == "concurrency_limit_exceeded"
        assert error.message == "model 'm' is at its concurrency limit (1): no free slot within 0.1s; retry later"
        assert error.headers == {"Retry-After": "2"}
        assert limiter.waiting == 0 and limiter.in_flight == 1  # the one that gave up left the queue
        limiter.release()
        await asyncio.wait_for(limiter.acquire("m"), 2)  # and took no slot

    _run(scenario)


def test_unlimited_grammars_are_counted_nowhere() -> None:
    limiter = ConcurrencyLimiter(LimitSettings(max_concurrent_grammars=None))

    async def scenario() -> None:
        assert await limiter.acquire_grammar("m") is False
        assert limiter.grammars_in_flight == 0

    _run(scenario)


def test_grammar_slots_are_counted_and_given_back() -> None:
    limiter = ConcurrencyLimiter(LimitSettings(max_concurrent_grammars=2, queue_timeout_s=0.1, retry_after_s=4))
    assert limiter.grammars_in_flight == 0

    async def scenario() -> None:
        assert await limiter.acquire_grammar("m") is True
        assert await limiter.acquire_grammar("m") is True
        assert limiter.grammars_in_flight == 2
        with pytest.raises(GatewayError) as refused:
            await limiter.acquire_grammar("m")
        error = refused.value
        assert error.status == 429 and error.code == "grammar_limit_exceeded" and error.headers == {"Retry-After": "4"}
        assert error.message == (
            "model 'm' is compiling 2 large grammars already, and none finished within 0.1s; retry later"
        )
        assert limiter.grammars_in_flight == 2
        limiter.release_grammar()
        assert limiter.grammars_in_flight == 1
        assert await asyncio.wait_for(limiter.acquire_grammar("m"), 1) is True

    _run(scenario)


def test_grammar_slots_and_request_slots_are_apart() -> None:
    limiter = ConcurrencyLimiter(LimitSettings(max_concurrent=1, max_concurrent_grammars=1, queue_timeout_s=0.1))

    async def scenario() -> None:
        await limiter.acquire("m")
        assert await asyncio.wait_for(limiter.acquire_grammar("m"), 1) is True  # a full model still has its grammar slot
        limiter.release_grammar()
        assert limiter.in_flight == 1 and limiter.grammars_in_flight == 0

    _run(scenario)


def test_the_queue_counts_every_waiting_request() -> None:
    limiter = ConcurrencyLimiter(LimitSettings(max_concurrent=1, max_queue=2, queue_timeout_s=5))

    async def scenario() -> None:
        await limiter.acquire("m")
        waiters = [asyncio.ensure_future(limiter.acquire("m")) for _ in range(2)]
        await asyncio.sleep(0.05)
        assert limiter.waiting == 2
        await _refused(limiter)  # two places, both taken
        for _ in waiters:
            limiter.release()
            await asyncio.sleep(0.01)
        await asyncio.wait_for(asyncio.gather(*waiters), 2)
        assert limiter.waiting == 0 and limiter.in_flight == 1

    _run(scenario)
