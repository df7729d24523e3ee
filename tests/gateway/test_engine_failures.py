"""Clients that go away and a gateway that shuts down mid-stream: the engine stops generating (its
own ``sglang:num_aborted_requests_total`` says so, no timing needed) and the gateway keeps count.

All of it on the session's ``tiny_engine``, which nothing here breaks: an upstream lost mid-stream is a
relay in front of it that cuts its connections (``CuttingRelay``); an engine SIGKILLed mid-stream is in
``test_swap.py`` (the module with an engine of its own to break).
"""

from __future__ import annotations

import json
import socket

import httpx
import openai

from launch.process import EngineProcess
from tests.admin_client import prometheus_value
from tests.gateway.helpers import BackgroundStream, CuttingRelay, last_sse_event
from tests.gateway_server import KEY, GatewayServer, auth, serve
from tests.waiting import wait_until

HELLO = [{"role": "user", "content": "Tell me a long story."}]
LONG = {"max_tokens": 1900, "temperature": 0, "extra_body": {"ignore_eos": True}}


def engine_metric(engine: EngineProcess, name: str) -> float:
    """One sample of the engine's own Prometheus metrics (``sglang:...``, enabled by default).

    A counter the engine has not used yet is not exported at all: it counts as 0.
    """
    text = httpx.get(engine.url + "/metrics", timeout=5).text
    assert "sglang:num_running_reqs" in text, "the engine exports no metrics (started without --enable-metrics?)"
    return prometheus_value(text, name) or 0.0


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
    wait_until(lambda: engine_metric(tiny_engine, "sglang:num_running_reqs") >= 1, "the engine to report the running request", 60)
    stream.close()  # the client goes away mid-answer
    # The engine aborts the request (it would otherwise run to its 1900th token and count no abort).
    wait_until(lambda: engine_metric(tiny_engine, "sglang:num_aborted_requests_total") == aborted + 1, "the engine to abort it", 60)
    wait_until(lambda: engine_metric(tiny_engine, "sglang:num_running_reqs") == 0, "the engine to run nothing", 60)
    wait_until(lambda: gateway_metric(gateway, "gateway_in_flight_requests", {"model": "tiny"}) == 0, "gateway in-flight 0", 30)
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
        wait_until(lambda: engine_metric(tiny_engine, "sglang:num_running_reqs") >= 1, "the engine to start the request", 60)
    # ...and aborts it once the client has gone.
    wait_until(lambda: engine_metric(tiny_engine, "sglang:num_aborted_requests_total") == aborted + 1, "the engine to abort it", 60)
    wait_until(lambda: engine_metric(tiny_engine, "sglang:num_running_reqs") == 0, "the engine to run nothing", 60)


def test_shutdown_grace_cuts_off_streams_that_outlast_it(tiny_engine: EngineProcess) -> None:
    """On SIGTERM / Ctrl-C a stream may finish for ``shutdown_grace_s``; one that would outlast it is cut
    (the client sees the stream end early) and the engine stops generating for nobody. A grace under one second
    counts too (it once became "no limit")."""
    aborted = engine_metric(tiny_engine, "sglang:num_aborted_requests_total")
    with serve({"tiny": {"url": tiny_engine.url}}, {"shutdown_grace_s": 0.5}) as gw:
        body = {"model": "tiny", "messages": HELLO, "stream": True, "max_tokens": 1900, "temperature": 0, "ignore_eos": True}
        stream = BackgroundStream(gw.url + "/v1/chat/completions", body).start()
        gw.stop()  # what SIGTERM does: stop accepting, wait up to shutdown_grace_s, then cut
        events = stream.finish()
    assert "data: [DONE]" not in events and len(events) < 1900 // 2, (len(events), events[-2:])
    wait_until(lambda: engine_metric(tiny_engine, "sglang:num_aborted_requests_total") == aborted + 1, "the engine to abort it", 60)


def test_an_upstream_lost_mid_stream_ends_each_dialects_stream_with_its_error_event(tiny_engine: EngineProcess) -> None:
    """Chat, Responses and Anthropic Messages streams whose upstream connection dies after their first bytes
    (a relay in front of the real engine holds the rest, then cuts every connection) each end with an error
    event framed like their own events, and the gateway counts each one."""
    relay = CuttingRelay(tiny_engine.url)
    with relay as relay_url, serve({"tiny": {"url": relay_url}}) as gw:
        # 600 tokens each: all three fit the engine's KV cache at once (4096 tokens; SGLang reserves part of each
        # request's max_tokens to admit it, and three of 1900 left the third queued behind the others for minutes
        # on a loaded machine). Each answer is still far longer than the 1500 bytes the relay lets through.
        raw = {"model": "tiny", "stream": True, "temperature": 0}
        streams = {
            "chat": BackgroundStream(gw.url + "/v1/chat/completions", {**raw, "messages": HELLO, "max_tokens": 600, "ignore_eos": True}),
            "responses": BackgroundStream(gw.url + "/v1/responses", {**raw, "input": "Tell me a story.", "max_output_tokens": 600}),
            "messages": BackgroundStream(gw.url + "/v1/messages", {**raw, "messages": HELLO, "max_tokens": 600}),
        }
        before = gateway_metric(gw, "gateway_stream_errors_total", {"model": "tiny"})
        relay.arm()
        BackgroundStream.start_together(*streams.values())  # each has its 200 and first line; the rest is held
        wait_until(lambda: relay.holding == 3, "the relay to hold all three answers", 120)
        relay.cut()
        lines = {name: stream.finish() for name, stream in streams.items()}
        assert gateway_metric(gw, "gateway_stream_errors_total", {"model": "tiny"}) == before + 3
    chat = json.loads(lines["chat"][-1].removeprefix("data: "))
    assert chat["error"]["code"] == "engine_unavailable" and "tiny" in chat["error"]["message"], lines["chat"][-2:]
    kind, data = last_sse_event(lines["responses"])
    assert kind == "error" and data["type"] == "error" and data["code"] == "engine_unavailable", data
    assert isinstance(data["sequence_number"], int) and data["sequence_number"] > 0
    kind, data = last_sse_event(lines["messages"])
    assert kind == "error" and data == {"type": "error", "error": {"type": "overloaded_error", "message": data["error"]["message"]}}
    assert "tiny" in data["error"]["message"]
