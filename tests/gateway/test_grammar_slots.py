"""Heavy grammars take one of a model's grammar slots: one client cannot hold every grammar thread of the engine."""

from __future__ import annotations

import asyncio

import pytest

from engine_guard.bounds import grammar_bytes
from gateway.config import LimitSettings
from gateway.core.errors import GatewayError
from gateway.core.limits import ConcurrencyLimiter


def test_a_grammar_slot_is_waited_for_then_refused_with_429() -> None:
    # Two limiters: a wait long enough that a loaded machine cannot end it early, and a short one that must end.
    patient = ConcurrencyLimiter(LimitSettings(max_concurrent_grammars=1, queue_timeout_s=60))
    hasty = ConcurrencyLimiter(LimitSettings(max_concurrent_grammars=1, queue_timeout_s=0.2, retry_after_s=3))

    async def scenario() -> None:
        assert await patient.acquire_grammar("m") is True
        waiter = asyncio.ensure_future(patient.acquire_grammar("m"))
        await asyncio.sleep(0.05)
        assert not waiter.done() and patient.grammars_in_flight == 1  # the second waits for the first
        patient.release_grammar()
        assert await waiter is True and patient.grammars_in_flight == 1
        assert await hasty.acquire_grammar("m") is True
        with pytest.raises(GatewayError) as refused:  # nobody releases: 429 after queue_timeout_s
            await hasty.acquire_grammar("m")
        assert refused.value.status == 429 and refused.value.code == "grammar_limit_exceeded"
        assert refused.value.headers["Retry-After"] == "3"

    asyncio.run(scenario())


def test_unlimited_grammars_take_no_slot() -> None:
    limiter = ConcurrencyLimiter(LimitSettings(max_concurrent_grammars=None))
    assert asyncio.run(limiter.acquire_grammar("m")) is False and limiter.grammars_in_flight == 0


def test_what_counts_as_a_heavy_grammar() -> None:
    small = {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}}
    large = {"regex": "|".join(f"w{i:05d}" for i in range(400))}
    assert 0 < grammar_bytes(small) < LimitSettings().heavy_grammar_bytes <= grammar_bytes(large)
    assert grammar_bytes({"stop_regex": "x" * 5000}) == 0  # matched by re, not compiled: no grammar thread


class _SlowGrammarEngine:
    """A fake engine (named as one: the real engine cannot be made to hold a grammar compile on demand) whose
    completions take 0.3 s and which counts how many requests with a grammar it holds at once."""

    def __init__(self) -> None:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        self.holding = 0
        self.most = 0
        self.finished: list[str] = []

        async def completions(request: Request) -> JSONResponse:
            body = await request.json()
            heavy = "regex" in body
            self.holding += heavy
            self.most = max(self.most, self.holding)
            await asyncio.sleep(0.3)
            self.holding -= heavy
            self.finished.append("heavy" if heavy else "light")
            return JSONResponse({"id": "cmpl-1", "object": "text_completion", "model": body["model"], "choices": [{"index": 0, "text": "x", "finish_reason": "stop"}]})

        self.app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


def test_heavy_grammars_reach_the_engine_a_few_at_a_time_and_light_requests_pass_them() -> None:
    import threading

    import httpx
    import uvicorn

    from launch.ports import pick_free_port
    from tests.gateway_server import KEY, auth, serve

    engine = _SlowGrammarEngine()
    port = pick_free_port()
    server = uvicorn.Server(uvicorn.Config(engine.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        asyncio.run(asyncio.sleep(0.02))
    heavy = {"model": "m", "prompt": "a", "max_tokens": 1, "regex": "|".join(f"w{i:05d}" for i in range(400))}
    light = {"model": "m", "prompt": "a", "max_tokens": 1}
    try:
        with serve({"m": {"url": f"http://127.0.0.1:{port}"}}, {"api_keys": [KEY], "limits": {"max_concurrent_grammars": 2}}) as gateway:

            async def burst() -> list[int]:
                async with httpx.AsyncClient(base_url=gateway.url, headers=auth(), timeout=30) as http:
                    heavies = [asyncio.ensure_future(http.post("/v1/completions", json=heavy)) for _ in range(6)]
                    await asyncio.sleep(0.05)
                    answers = [await http.post("/v1/completions", json=light)]
                    return [answer.status_code for answer in answers + list(await asyncio.gather(*heavies))]

            statuses = asyncio.run(burst())
    finally:
        server.should_exit = True
        thread.join(10)
    assert statuses == [200] * 7
    assert engine.most == 2, engine.most  # never more than the limit, and the limit was reached
    assert engine.finished.index("light") < 3, engine.finished  # not queued behind the heavy ones
