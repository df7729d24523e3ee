"""Every error status the gateway answers, in OpenAI's shape, and the sanitizer behind them."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.core.errors import readable_validation_dump, sanitize_message, upstream_error
from gateway.core.metrics import Metrics
from gateway.core.registry import Registry
from gateway.edge.middleware import RequestContextMiddleware
from launch.process import EngineProcess
from tests.admin_client import prometheus_value
from tests.fake_engine import running_fake_engine
from tests.fake_upstreams import fake_stalled_upstream
from tests.gateway.helpers import assert_openai_error, closed_port_url
from tests.gateway_server import KEY, GatewayServer, auth, serve
from tests.waiting import wait_until

CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hi"}]


def test_sanitize_message_strips_traceback_frames_and_paths() -> None:
    raw = (
        "2 validation errors:\n  {'type': 'list_type'}\n\n"
        '  File "/work/.venv/lib/python3.11/site-packages/sglang/srt/entrypoints/http_server.py", line 1870, in f\n'
        "    POST /v1/chat/completions [{'type': 'list_type'}]"
    )
    assert sanitize_message(raw) == "2 validation errors:\n  {'type': 'list_type'}"
    assert sanitize_message("boom\nTraceback (most recent call last):\n  File \"x\", line 1") == "boom"
    assert sanitize_message("failed in /usr/lib/x/y.py, see /v1/models") == "failed in <path>, see /v1/models"


def test_sanitize_message_strips_urls() -> None:
    # What SGLang's router says when a worker is gone (its 5xx), and the same shape in a 4xx: no address leaks.
    router = "error sending request for url (http://10.1.2.3:30000/v1/chat/completions). URL: http://10.1.2.3:30000/v1/chat/completions"
    assert sanitize_message(router) == "error sending request for url (<url>). URL: <url>"
    bad = upstream_error(400, json.dumps({"error": {"message": f"worker https://sglang-worker-0.llm.svc:30000 said: {router}"}}).encode())
    assert bad.status == 400 and "30000" not in bad.message and "sglang-worker-0" not in bad.message, bad.message
    assert sanitize_message("see http://[fd00::1]:8000/x, then grpc://h:1") == "see <url>, then <url>"


def test_upstream_error_mapping() -> None:
    bad = upstream_error(400, json.dumps({"object": "error", "message": "nope at /srv/app/a.py", "code": 400}).encode())
    assert (bad.status, bad.type, bad.message) == (400, "invalid_request_error", "nope at <path>")
    crash = upstream_error(500, json.dumps({"object": "error", "message": "unhashable type: 'list'", "code": 500}).encode())
    # What a failing engine says about itself stays in the gateway's log: the client learns only that it failed.
    assert crash.status == 502 and crash.message == "the engine failed to process the request (HTTP 500)"
    assert crash.log_detail is not None and "unhashable type" in crash.log_detail
    dump = "[{'type': 'missing', 'loc': ('body', 'messages'), 'msg': 'Field required', 'input': {'model': 'tiny'}}]"
    invalid = upstream_error(400, json.dumps({"object": "error", "message": dump, "code": 400}).encode())
    assert invalid.message == "messages: Field required"


# What SGLang 0.5.23 answered, recorded from the real engine (tests/gateway/test_client_mistakes.py sends the same).
STOP_REGEX_500 = {"object": "error", "message": "Internal server error: missing ), unterminated subpattern at position 0", "type": "InternalServerError", "param": None, "code": 500}
GRAMMAR_500 = {"object": "error", "message": "Grammar accept_token failed: Tokens not accepted: 0\nAccepted tokens: []\nKey string: root ::= root", "type": "500", "param": None, "code": 500}
TEMPLATE_KWARG_500 = {"object": "error", "message": "Internal server error: 'tools'", "type": "InternalServerError", "param": None, "code": 500}
REGEX_400 = {"object": "error", "message": "Failed to compile regex grammar: [10:33:32] /project/cpp/regex_converter.cc:83: Regex parsing error at position 2: The parenthesis is not closed.\n", "type": "BadRequestError", "param": None, "code": 400}  # fmt: skip


def test_engine_500s_caused_by_the_clients_input_are_400s() -> None:
    cases = [
        (STOP_REGEX_500, {"stop_regex": "("}, "stop_regex", "stop_regex: invalid regular expression: missing ), unterminated subpattern at position 0"),
        (GRAMMAR_500, {"ebnf": "root ::= root"}, "ebnf", "ebnf: the grammar accepts no token"),
        (GRAMMAR_500, {"response_format": {"type": "json_schema"}}, "response_format", "response_format: the grammar accepts no token"),
        (TEMPLATE_KWARG_500, {"chat_template_kwargs": {"tools": 5}}, "chat_template_kwargs.tools", "chat_template_kwargs.tools: "),
    ]
    for answer, request, param, message in cases:
        error = upstream_error(500, json.dumps(answer).encode(), {"model": "tiny", "messages": HELLO, **request})
        assert (error.status, error.type, error.param) == (400, "invalid_request_error", param), error.message
        assert error.message.startswith(message) and "\n" not in error.message, error.message
        assert error.log_detail is not None and "engine answered HTTP 500" in error.log_detail  # the log still says what the engine said
        # The same answer to a request without the field it blames is the engine's own failure.
        assert upstream_error(500, json.dumps(answer).encode(), {"model": "tiny", "messages": HELLO}).status == 502
        assert upstream_error(500, json.dumps(answer).encode()).status == 502
    # An engine 400 about a grammar: one line, without xgrammar's time stamp and source location.
    regex = upstream_error(400, json.dumps(REGEX_400).encode(), {"regex": "("})
    assert regex.message == "Failed to compile regex grammar: Regex parsing error at position 2: The parenthesis is not closed."


def test_validation_dump_whose_location_holds_brackets_is_rewritten() -> None:
    """A location part may hold ")" or "]": pydantic's validator tags, or a client's dict key (recorded from SGLang)."""
    client_key = (
        "1 validation error:\n  {'type': 'float_parsing', 'loc': ('body', 'logit_bias', 'a)b]c'), 'msg': 'Input should be a valid "
        "number, unable to parse string as a number', 'input': 'x'}"
    )
    assert readable_validation_dump(client_key) == "logit_bias.a)b]c: Input should be a valid number, unable to parse string as a number"
    tagged = (
        "2 validation errors:\n  {'type': 'value_error', 'loc': ('body', 'messages', 0, 'function-after[validate_thinking_parts_role(), "
        "ChatCompletionMessageGenericParam]', 'role'), 'msg': \"Value error, 'role' must be one of 'system', 'assistant'\", 'input': 'u'}\n"
        "  {'type': 'string_type', 'loc': ('body', 'messages', 0, 'function-after[validate_thinking_parts_role(), "
        "ChatCompletionMessageGenericParam]', 'content', 'str'), 'msg': 'Input should be a valid string', 'input': [{'type': 'te)xt]'}]}"
    )
    assert readable_validation_dump(tagged) == (
        "messages.0.role: Value error, 'role' must be one of 'system', 'assistant'; messages.0.content.str: Input should be a valid string"
    )
    error = upstream_error(400, json.dumps({"object": "error", "message": tagged, "code": 400}).encode())
    assert "'input'" not in error.message and "{'type'" not in error.message, error.message


def test_400_invalid_json_and_types(gateway: GatewayServer) -> None:
    with httpx.Client(base_url=gateway.url, headers=auth(), timeout=30) as http:
        assert_openai_error(http.post(CHAT, content=b"{not json"), 400, "invalid_json")
        assert_openai_error(http.post(CHAT, content=b"[1, 2]"), 400, "invalid_json")
        body = assert_openai_error(http.post(CHAT, json={"model": "tiny", "messages": "hi"}), 400)
        assert body["error"]["param"] == "messages"
        body = assert_openai_error(http.post(CHAT, json={"model": "tiny", "messages": HELLO, "max_tokens": "8"}), 400)
        assert body["error"]["param"] == "max_tokens"
        assert_openai_error(http.post(CHAT, json={"model": 7, "messages": HELLO}), 400)
        assert_openai_error(http.post("/v1/completions", json={"model": "tiny"}), 400)
        assert_openai_error(http.post("/v1/embeddings", json={"model": "tiny", "input": 3}), 400)


def test_upstream_4xx_keeps_status_and_loses_paths(gateway: GatewayServer) -> None:
    """SGLang rejects an unknown role with a message that carries its own source path and line."""
    with httpx.Client(base_url=gateway.url, headers=auth(), timeout=30) as http:
        response = http.post(CHAT, json={"model": "tiny", "messages": [{"role": "bogus", "content": "hi"}], "max_tokens": 2})
    body = assert_openai_error(response, 400)
    assert "role" in body["error"]["message"]
    assert "site-packages" not in response.text and "line 1" not in response.text


def test_404_unknown_model_and_route(gateway: GatewayServer) -> None:
    with httpx.Client(base_url=gateway.url, headers=auth(), timeout=30) as http:
        assert_openai_error(http.post(CHAT, json={"model": "nope", "messages": HELLO}), 404, "model_not_found")
        assert_openai_error(http.get("/v1/models/nope"), 404, "model_not_found")
        assert_openai_error(http.get("/v2/whatever"), 404)
        assert_openai_error(http.get(CHAT), 405)


def test_413_by_content_length_and_by_streamed_size(tiny_engine: EngineProcess) -> None:
    with serve({"tiny": {"url": tiny_engine.url}}, {"max_body_bytes": 2048}) as gw, httpx.Client(base_url=gw.url, timeout=30) as http:
        big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 4096}]}
        assert_openai_error(http.post(CHAT, json=big), 413, "request_too_large")

        def chunks():  # no Content-Length: chunked transfer, counted while read
            for _ in range(8):
                yield b" " * 1024

        assert_openai_error(http.post(CHAT, content=chunks()), 413, "request_too_large")
        # the same chunked body whole, in one write with its head: the app finds it all read, and it is still counted
        chunked = b"".join(b"400\r\n" + b" " * 1024 + b"\r\n" for _ in range(4)) + b"0\r\n\r\n"
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        url = httpx.URL(gw.url)
        with socket.create_connection((url.host, url.port), timeout=30) as sock:
            sock.sendall(head + chunked)
            assert sock.recv(65536).startswith(b"HTTP/1.1 413 ")
        ok = http.post(CHAT, json={"model": "tiny", "messages": HELLO, "max_tokens": 2})
        assert ok.status_code == 200


def test_429_concurrency_limit_with_retry_after(tiny_engine: EngineProcess) -> None:
    limits = {"limits": {"max_concurrent": 1, "retry_after_s": 3}}
    with serve({"tiny": {"url": tiny_engine.url}}, limits) as gw, httpx.Client(base_url=gw.url, timeout=60) as http:
        body = {"model": "tiny", "messages": HELLO, "max_tokens": 2000, "temperature": 0, "stream": True, "ignore_eos": True}
        with http.stream("POST", CHAT, json=body) as holding:
            assert holding.status_code == 200
            chunks = holding.iter_raw()
            next(chunks)  # the slot is taken while this stream is open
            refused = http.post(CHAT, json={"model": "tiny", "messages": HELLO, "max_tokens": 2})
            assert_openai_error(refused, 429, "concurrency_limit_exceeded")
            assert refused.headers["retry-after"] == "3"
        # The slot frees as soon as the gateway sees the holder go away.
        status = wait_until(
            lambda: (code := http.post(CHAT, json={"model": "tiny", "messages": HELLO, "max_tokens": 2}).status_code) != 429 and code,
            "the held slot to be freed", 10,
        )  # fmt: skip
        assert status == 200


def test_429_after_queue_timeout_and_queued_request_proceeds(tmp_path: Path) -> None:
    """Model ``tiny`` queues for 1 s and then refuses; model ``patient`` (same engine, same caps) queues for 30 s,
    so the test can see its request waiting however late this thread wakes on a loaded machine (a 1 s queue
    could time out between two polls). The engine is the FAKE one, whose 3000-token stream takes 30 s: a real
    engine finished its whole stream into the socket buffers in ~3 s, and on CI the waiting request came after."""
    quick = {"max_concurrent": 1, "max_queue": 1, "queue_timeout_s": 1.0}
    gateway_cfg = {"limits": quick, "model_limits": {"patient": {**quick, "queue_timeout_s": 30.0}}}
    with running_fake_engine(tmp_path) as engine_url:
        models = {"tiny": {"url": engine_url}, "patient": {"url": engine_url}}
        with serve(models, gateway_cfg) as gw, httpx.Client(base_url=gw.url, timeout=60) as http:
            queue_and_refuse(gw, http)


def queue_and_refuse(gw: GatewayServer, http: httpx.Client) -> None:
    """A slot held by a stream: a request for ``tiny`` is refused after its 1 s in the queue; one for ``patient``
    waits, and gets the slot once the holder goes away."""
    body = {"messages": HELLO, "max_tokens": 3000, "stream": True}
    results: dict[str, httpx.Response] = {}

    def send(name: str, model: str) -> None:
        results[name] = httpx.post(gw.url + CHAT, json={"model": model, "messages": HELLO, "max_tokens": 2}, timeout=60)

    limiter = gw.state.registry.route("tiny").limiter
    with http.stream("POST", CHAT, json={**body, "model": "tiny"}) as holding:
        held = holding.iter_raw()  # keep the iterator: dropping it closes the stream
        next(held)  # the only slot is taken while this stream is open
        timing_out = threading.Thread(target=send, args=("timed out", "tiny"))
        timing_out.start()
        timing_out.join(30)  # the holder is still streaming: nothing frees the slot
        assert_openai_error(results["timed out"], 429, "concurrency_limit_exceeded")
        assert "no free slot within 1s" in results["timed out"].json()["error"]["message"]
        assert limiter.waiting == 0

    # A queued request gets the slot as soon as the holder goes away.
    limiter = gw.state.registry.route("patient").limiter
    with http.stream("POST", CHAT, json={**body, "model": "patient"}) as holding:
        held = holding.iter_raw()
        next(held)
        queued = threading.Thread(target=send, args=("queued", "patient"))
        queued.start()
        wait_until(lambda: limiter.waiting == 1, "the request to wait in the queue", every_s=0.02)
        assert "queued" not in results
    queued.join(30)
    assert results["queued"].status_code == 200, results["queued"].text


def test_model_limits_override_the_default_per_model(tiny_engine: EngineProcess) -> None:
    """``model_limits.a`` caps model ``a`` only; ``b`` (same engine) keeps the default (no limit)."""
    models = {"a": {"url": tiny_engine.url}, "b": {"url": tiny_engine.url}}
    gateway_cfg = {"model_limits": {"a": {"max_concurrent": 1, "retry_after_s": 7}}}
    with serve(models, gateway_cfg) as gw, httpx.Client(base_url=gw.url, timeout=60) as http:
        body = {"model": "a", "messages": HELLO, "max_tokens": 2000, "temperature": 0, "stream": True, "ignore_eos": True}
        with http.stream("POST", CHAT, json=body) as holding:
            held = holding.iter_raw()
            next(held)
            refused = http.post(CHAT, json={"model": "a", "messages": HELLO, "max_tokens": 2})
            assert_openai_error(refused, 429, "concurrency_limit_exceeded")
            assert refused.headers["retry-after"] == "7"
            with http.stream("POST", CHAT, json={**body, "model": "b"}) as other:  # b: no limit, two at once
                also_held = other.iter_raw()
                next(also_held)
                assert http.post(CHAT, json={"model": "b", "messages": HELLO, "max_tokens": 2}).status_code == 200


def test_503_engine_unreachable_and_504_stalled(tiny_engine: EngineProcess) -> None:
    with fake_stalled_upstream() as stalled:
        models = {"down": {"url": closed_port_url()}, "stalled": {"url": stalled}, "tiny": {"url": tiny_engine.url}}
        gateway_cfg = {"upstream_read_timeout_s": 2.0, "health_timeout_s": 3.0}
        with serve(models, gateway_cfg) as gw, httpx.Client(base_url=gw.url, timeout=30) as http:
            down = http.post(CHAT, json={"model": "down", "messages": HELLO})
            assert_openai_error(down, 503, "engine_unavailable")
            assert down.headers["retry-after"]
            started = time.monotonic()
            assert_openai_error(http.post(CHAT, json={"model": "stalled", "messages": HELLO}), 504, "upstream_timeout")
            assert_openai_error(http.post(CHAT, json={"model": "stalled", "messages": HELLO, "stream": True}), 504)
            assert time.monotonic() - started < 10
            ready = http.get("/ready")
            body = assert_openai_error(ready, 503, "not_ready")
            assert body["models"]["down"]["ready"] is False and body["models"]["tiny"]["ready"] is True
            assert "down" in body["error"]["message"] and "stalled" in body["error"]["message"]
            assert http.post(CHAT, json={"model": "tiny", "messages": HELLO, "max_tokens": 2}).status_code == 200


@contextmanager
def fake_unreachable_upstream() -> Iterator[str]:
    """A fake engine whose connections never complete: a listener that never accepts and whose queue
    is kept full, so the kernel drops every new SYN (for the connect-timeout test; the real engine
    cannot be made to do this on demand)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(4):
        filler = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        fillers.append(filler)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        for sock in (*fillers, listener):
            sock.close()


def test_504_when_the_engine_does_not_accept_within_the_connect_timeout() -> None:
    with fake_unreachable_upstream() as url, serve({"slow": {"url": url}}, {"upstream_connect_timeout_s": 0.5}) as gw:
        for stream in (False, True):
            body = {"model": "slow", "messages": HELLO, "stream": stream}
            response = httpx.post(gw.url + CHAT, json=body, timeout=60)
            error = assert_openai_error(response, 504, "upstream_timeout")
            assert error["error"]["message"] == "timed out connecting to the engine of slow"


def test_request_id_echoed_or_generated(gateway: GatewayServer) -> None:
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        assert http.get("/health", headers={"X-Request-Id": "abc-123"}).headers["x-request-id"] == "abc-123"
        generated = http.get("/health", headers={"X-Request-Id": "bad id\twith junk"}).headers["x-request-id"]
        assert generated != "bad id\twith junk" and len(generated) == 32
        assert http.get("/v1/models").headers["x-request-id"]  # 401s carry one too


@pytest.mark.parametrize(
    "answered",
    [
        [(b"content-type", b"application/json")],
        [(b"X-Request-Id", b"the-workers"), (b"content-type", b"application/json")],
        [(b"content-type", b"application/json"), (b"x-request-id", b"a"), (b"x-request-id-of", b"kept")],
        [],
    ],
)
def test_a_response_carries_the_gateways_request_id_once(answered: list[tuple[bytes, bytes]]) -> None:
    """Whatever request id the app's answer carried (a worker's, in any case) gives way to the gateway's; a field
    whose name only starts like it stays."""
    sent: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": list(answered)})
        await send({"type": "http.response.body", "body": b"{}"})

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    middleware = RequestContextMiddleware(app, Metrics(Registry(), multiprocess_dir=""), log_requests=False, record=False)
    scope = {"type": "http", "method": "GET", "path": "/v1/models", "headers": [(b"x-request-id", b"the-clients")]}
    asyncio.run(middleware(scope, None, send))
    headers = sent[0]["headers"]
    assert [value for name, value in headers if name.lower() == b"x-request-id"] == [b"the-clients"], headers
    assert [field for field in headers if field[0].lower() != b"x-request-id"] == [field for field in answered if field[0].lower() != b"x-request-id"]


def test_metrics_after_traffic(gateway: GatewayServer, client: openai.OpenAI) -> None:
    """Each request adds exactly one to its counters; tokens are the engine's usage; TTFT is observed once each."""
    series = {
        "ok": ("gateway_requests_total", {"model": "second", "route": CHAT, "status": "200"}),
        "latency": ("gateway_request_duration_seconds_count", {"model": "second", "route": CHAT}),
        "ttft": ("gateway_time_to_first_token_seconds_count", {"model": "second"}),
        "prompt": ("gateway_tokens_total", {"model": "second", "kind": "prompt"}),
        "completion": ("gateway_tokens_total", {"model": "second", "kind": "completion"}),
        "in_flight": ("gateway_in_flight_requests", {"model": "second"}),
    }

    def scrape() -> dict[str, float]:
        text = httpx.get(gateway.url + "/metrics", headers=auth(KEY), timeout=30).text
        return {key: prometheus_value(text, name, labels) or 0.0 for key, (name, labels) in series.items()}

    before = scrape()
    reply = client.chat.completions.create(model="second", messages=HELLO, max_tokens=3, temperature=0)
    chunks = client.chat.completions.create(
        model="second", messages=HELLO, max_tokens=5, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    streamed = [chunk.usage for chunk in chunks if chunk.usage is not None][-1]
    after = scrape()
    assert reply.usage is not None
    assert after["ok"] == before["ok"] + 2 and after["latency"] == before["latency"] + 2
    assert after["ttft"] == before["ttft"] + 2
    assert after["prompt"] == before["prompt"] + reply.usage.prompt_tokens + streamed.prompt_tokens
    assert after["completion"] == before["completion"] + reply.usage.completion_tokens + streamed.completion_tokens
    assert after["in_flight"] == 0


def test_engine_up_reports_url_models_as_probed_at_scrape_time(tiny_engine: EngineProcess) -> None:
    """A url model is up when its server answers /health now: the first scrape already says so."""
    with serve({"tiny": {"url": tiny_engine.url}, "down": {"url": closed_port_url()}}) as gw:
        text = httpx.get(gw.url + "/metrics", timeout=30).text  # no /ready call before
        assert prometheus_value(text, "gateway_engine_up", {"model": "tiny"}) == 1
        assert prometheus_value(text, "gateway_engine_up", {"model": "down"}) == 0
