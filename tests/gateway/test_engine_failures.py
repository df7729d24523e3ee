"""Clients that go away, a gateway that shuts down mid-stream, and engines that die: the engine stops
generating (its own ``sglang:num_aborted_requests_total`` says so, no timing needed), the gateway
keeps serving.

The SIGKILL test breaks an engine, so it starts its own (``victim``, module-scoped); the shared
``tiny_engine`` is never touched.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from launch.config import EngineConfig
from launch.process import EngineProcess
from tests.gateway.helpers import KEY, GatewayServer, assert_openai_error, auth, prometheus_value, serve
from tests.leaks import leaves_nothing

HELLO = [{"role": "user", "content": "Tell me a long story."}]
LONG = {"max_tokens": 1900, "temperature": 0, "extra_body": {"ignore_eos": True}}


def engine_metric(engine: EngineProcess, name: str) -> float:
    """One sample of the engine's own Prometheus metrics (``sglang:...``, enabled by default)."""
    value = prometheus_value(httpx.get(engine.url + "/metrics", timeout=5).text, name)
    assert value is not None, f"the engine exports no {name} (started without --enable-metrics?)"
    return value


def wait_for(predicate, timeout_s: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.1)


def gateway_metric(gateway: GatewayServer, name: str, labels: dict[str, str]) -> float:
    return prometheus_value(httpx.get(gateway.url + "/metrics", headers=auth(KEY), timeout=10).text, name, labels) or 0.0


def test_client_disconnect_mid_stream_aborts_engine_request(gateway: GatewayServer, client: openai.OpenAI, tiny_engine: EngineProcess) -> None:
    aborted = engine_metric(tiny_engine, "sglang:num_aborted_requests_total")
    requests = {"model": "tiny", "route": "/v1/chat/completions", "status": "200"}
    answered = gateway_metric(gateway, "gateway_requests_total", requests)
    stream = client.chat.completions.create(model="tiny", messages=HELLO, stream=True, **LONG)
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    wait_for(lambda: engine_metric(tiny_engine, "sglang:num_running_reqs") >= 1, 60, "the engine to report the running request")
    stream.close()  # the client goes away mid-answer
    # The engine aborts the request (it would otherwise run to its 1900th token and count no abort).
    wait_for(lambda: engine_metric(tiny_engine, "sglang:num_aborted_requests_total") == aborted + 1, 60, "the engine to abort it")
    assert engine_metric(tiny_engine, "sglang:num_running_reqs") == 0
    wait_for(lambda: gateway_metric(gateway, "gateway_in_flight_requests", {"model": "tiny"}) == 0, 30, "gateway in-flight 0")
    assert gateway_metric(gateway, "gateway_requests_total", requests) == answered + 1  # recorded once, as a 200


def test_client_giving_up_on_plain_request_aborts_engine_request(gateway: GatewayServer, tiny_engine: EngineProcess) -> None:
    """SGLang sends a plain answer's headers only at the end: the gateway must notice the client leaving."""
    aborted = engine_metric(tiny_engine, "sglang:num_aborted_requests_total")
    body = json.dumps({"model": "tiny", "messages": HELLO, "max_tokens": 1900, "temperature": 0, "ignore_eos": True}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", gateway.port)) as sock:
        sock.sendall(head.encode() + body)
        # The engine has the request before the client leaves...
        wait_for(lambda: engine_metric(tiny_engine, "sglang:num_running_reqs") >= 1, 60, "the engine to start the request")
    # ...and aborts it once the client has gone.
    wait_for(lambda: engine_metric(tiny_engine, "sglang:num_aborted_requests_total") == aborted + 1, 60, "the engine to abort it")
    assert engine_metric(tiny_engine, "sglang:num_running_reqs") == 0


def test_shutdown_grace_cuts_off_streams_that_outlast_it(tiny_engine: EngineProcess) -> None:
    """On SIGTERM / Ctrl-C a stream may finish for ``shutdown_grace_s``; one that would outlast it is cut
    (the client sees the stream end early) and the engine stops generating for nobody."""
    aborted = engine_metric(tiny_engine, "sglang:num_aborted_requests_total")
    events: list[str] = []
    failures: list[str] = []
    started = threading.Event()
    with serve({"tiny": {"url": tiny_engine.url}}, {"shutdown_grace_s": 1}) as gw:
        body = {"model": "tiny", "messages": HELLO, "stream": True, "max_tokens": 1900, "temperature": 0, "ignore_eos": True}

        def read() -> None:
            try:
                with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=120) as response:
                    for line in response.iter_lines():
                        started.set()
                        if line:
                            events.append(line)
            except httpx.HTTPError as error:  # the connection closed mid-body
                failures.append(type(error).__name__)

        reader = threading.Thread(target=read)
        reader.start()
        assert started.wait(60)
        gw.stop()  # what SIGTERM does: stop accepting, wait up to shutdown_grace_s, then cut
        reader.join(120)
    assert "data: [DONE]" not in events and len(events) < 1900 // 2, (len(events), events[-2:])
    wait_for(lambda: engine_metric(tiny_engine, "sglang:num_aborted_requests_total") == aborted + 1, 60, "the engine to abort it")


@pytest.fixture(scope="module")
def victim(starts_engine: None, tiny_engine_config: EngineConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """A second real engine that the test kills (its process group and /dev/shm files must go anyway)."""
    engine = EngineProcess("victim", tiny_engine_config, log_dir=tmp_path_factory.mktemp("victim-logs"))
    with leaves_nothing() as check:
        try:
            engine.start()
            check.watch(engine.pid)
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
            os.kill(victim.pid, signal.SIGKILL)
            with pytest.raises(openai.APIError) as caught:
                for _ in chunks:
                    pass
            assert "victim" in caught.value.message and "engine" in caught.value.message
            assert caught.value.body["type"] == "service_unavailable"

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
            assert prometheus_value(metrics, "gateway_stream_errors_total", {"model": "victim"}) == 1
            assert prometheus_value(metrics, "gateway_in_flight_requests", {"model": "victim"}) == 0
