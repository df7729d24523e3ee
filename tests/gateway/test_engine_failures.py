"""Clients that go away and engines that die: the engine stops generating, the gateway keeps serving.

The SIGKILL test breaks an engine, so it starts its own (``victim``, module-scoped); the shared
``tiny_engine`` is never touched.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from launch.config import EngineConfig
from launch.process import EngineProcess
from tests.gateway.helpers import KEY, GatewayServer, assert_openai_error, auth, prometheus_value, serve

pytestmark = pytest.mark.engine
HELLO = [{"role": "user", "content": "Tell me a long story."}]
LONG = {"max_tokens": 1900, "temperature": 0, "extra_body": {"ignore_eos": True}}


def engine_running_requests(engine: EngineProcess) -> float:
    text = httpx.get(engine.url + "/metrics", timeout=5).text
    match = re.search(r"^sglang:num_running_reqs\{[^}]*\} (\S+)$", text, re.M)
    assert match, "engine started without --enable-metrics?"
    return float(match.group(1))


def wait_for(predicate, timeout_s: float, what: str) -> float:  # noqa: ANN001
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.1)
    return time.monotonic() - started


def test_client_disconnect_mid_stream_aborts_engine_request(gateway: GatewayServer, client: openai.OpenAI, tiny_engine: EngineProcess) -> None:
    stream = client.chat.completions.create(model="tiny", messages=HELLO, stream=True, **LONG)
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    wait_for(lambda: engine_running_requests(tiny_engine) >= 1, 10, "the engine to report the running request")
    stream.close()  # the client goes away mid-answer
    # 1900 tokens would take far longer than this to finish on their own.
    took = wait_for(lambda: engine_running_requests(tiny_engine) == 0, 5, "the engine's running count to return to 0")
    assert took < 5
    text = httpx.get(gateway.url + "/metrics", headers=auth(KEY)).text
    wait_for(lambda: prometheus_value(httpx.get(gateway.url + "/metrics", headers=auth(KEY)).text,
                                      "gateway_in_flight_requests", {"model": "tiny"}) == 0, 5, "gateway in-flight 0")
    assert "gateway_requests_total" in text


def test_client_giving_up_on_plain_request_aborts_engine_request(gateway: GatewayServer, tiny_engine: EngineProcess) -> None:
    """SGLang sends a plain answer's headers only at the end: the gateway must notice the client leaving."""
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 1900, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gateway.url + "/v1/chat/completions", json=body, headers=auth(KEY), timeout=1.5)
    took = wait_for(lambda: engine_running_requests(tiny_engine) == 0, 8, "the engine's running count to return to 0")
    assert took < 8


def _open_sse(http: httpx.Client, path: str, body: dict[str, Any]) -> Iterator[str]:
    """Start a stream and read until its first event has arrived; the rest is read by :func:`_last_event`."""
    response = http.send(http.build_request("POST", path, json=body), stream=True)
    assert response.status_code == 200, response.read()
    lines = response.iter_lines()
    while next(lines) != "":  # through the end of the first event
        pass
    return lines


def _last_event(lines: Iterator[str]) -> tuple[str | None, dict[str, Any]]:
    """(event name, data) of the last event of an SSE stream read to its end."""
    kind, data, last = None, None, (None, {})
    for line in lines:
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: ") and line != "data: [DONE]":
            data = json.loads(line[6:])
        elif line == "" and data is not None:
            last, kind, data = (kind, data), None, None
    return last


@pytest.fixture(scope="module")
def victim(tiny_engine_config: EngineConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """A second real engine that the test kills."""
    engine = EngineProcess("victim", tiny_engine_config, log_dir=tmp_path_factory.mktemp("victim-logs"))
    try:
        engine.start()
        engine.wait_ready()
        yield engine
    finally:
        engine.stop()


def test_engine_sigkill_mid_stream(victim: EngineProcess, tiny_engine: EngineProcess) -> None:
    models = {
        "tiny": {"url": tiny_engine.url},
        "victim": {"engine": {"model_path": victim.config.model_path, "device": "cpu"}},
    }
    with serve(models, {"api_keys": [KEY]}, engines={"victim": victim}) as gw:
        sdk = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        with httpx.Client(base_url=gw.url, headers=auth(KEY), timeout=30) as http:
            assert http.get("/ready").status_code == 200
            stream = sdk.chat.completions.create(model="victim", messages=HELLO, stream=True, **LONG)
            chunks = iter(stream)
            for _ in range(3):
                assert next(chunks).object == "chat.completion.chunk"
            # The Responses and Anthropic Messages streams of the same engine, read as raw SSE.
            long_body = {"model": "victim", "stream": True, "temperature": 0, "ignore_eos": True}
            messages = _open_sse(http, "/v1/messages", {**long_body, "messages": HELLO, "max_tokens": 1900})
            # (the Responses API has no ignore_eos: the kill follows its first event at once)
            responses = _open_sse(http, "/v1/responses", {**long_body, "input": "Tell me a story.", "max_output_tokens": 1900})
            os.kill(victim.pid, signal.SIGKILL)
            with pytest.raises(openai.APIError) as caught:
                for _ in chunks:
                    pass
            assert "victim" in caught.value.message and "engine" in caught.value.message
            assert caught.value.body["type"] == "service_unavailable"
            # each cut stream ends with an error event framed like its own events
            kind, data = _last_event(responses)
            assert kind == "error" and data["type"] == "error" and data["code"] == "engine_unavailable", data
            assert isinstance(data["sequence_number"], int) and data["sequence_number"] > 0
            kind, data = _last_event(messages)
            assert kind == "error" and data == {"type": "error", "error": {"type": "overloaded_error", "message": data["error"]["message"]}}
            assert "victim" in data["error"]["message"]

            wait_for(lambda: not victim.running, 10, "the victim process to be reaped")
            ready = http.get("/ready")
            body = assert_openai_error(ready, 503, "not_ready")
            assert body["models"]["victim"]["ready"] is False and body["models"]["tiny"]["ready"] is True
            assert "victim" in body["error"]["message"]

            refused = http.post("/v1/chat/completions", json={"model": "victim", "messages": HELLO, "max_tokens": 2})
            assert_openai_error(refused, 503, "engine_unavailable")
            assert refused.headers["retry-after"]

            reply = sdk.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4, temperature=0)
            assert reply.choices[0].message.role == "assistant"

            metrics = http.get("/metrics").text
            assert prometheus_value(metrics, "gateway_engine_up", {"model": "victim"}) == 0
            assert prometheus_value(metrics, "gateway_stream_errors_total", {"model": "victim"}) == 3
            assert prometheus_value(metrics, "gateway_in_flight_requests", {"model": "victim"}) == 0
