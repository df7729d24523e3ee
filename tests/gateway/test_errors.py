"""Every error status the gateway answers, in OpenAI's shape, and the sanitizer behind them."""

from __future__ import annotations

import json
import threading
import time

import httpx

from gateway.errors import sanitize_message, upstream_error
from launch.process import EngineProcess
from tests.gateway.helpers import (
    KEY,
    GatewayServer,
    assert_openai_error,
    auth,
    closed_port_url,
    fake_stalled_upstream,
    serve,
)

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
        ok = http.post(CHAT, json={"model": "tiny", "messages": HELLO, "max_tokens": 2})
        assert ok.status_code == 200


def test_429_concurrency_limit_with_retry_after(tiny_engine: EngineProcess) -> None:
    limits = {"limits": {"max_concurrent": 1, "retry_after_s": 3}}
    with serve({"tiny": {"url": tiny_engine.url}}, limits) as gw, httpx.Client(base_url=gw.url, timeout=60) as http:
        body = {"model": "tiny", "messages": HELLO, "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}
        with http.stream("POST", CHAT, json=body) as holding:
            assert holding.status_code == 200
            chunks = holding.iter_raw()
            next(chunks)  # the slot is taken while this stream is open
            refused = http.post(CHAT, json={"model": "tiny", "messages": HELLO, "max_tokens": 2})
            assert_openai_error(refused, 429, "concurrency_limit_exceeded")
            assert refused.headers["retry-after"] == "3"
        # The slot frees as soon as the gateway sees the holder go away.
        deadline = time.monotonic() + 10
        while (status := http.post(CHAT, json={"model": "tiny", "messages": HELLO, "max_tokens": 2}).status_code) == 429:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert status == 200


def test_429_after_queue_timeout_and_queued_request_proceeds(tiny_engine: EngineProcess) -> None:
    limits = {"limits": {"max_concurrent": 1, "max_queue": 1, "queue_timeout_s": 1.0}}
    with serve({"tiny": {"url": tiny_engine.url}}, limits) as gw, httpx.Client(base_url=gw.url, timeout=60) as http:
        body = {"model": "tiny", "messages": HELLO, "max_tokens": 2000, "temperature": 0, "stream": True, "ignore_eos": True}
        with http.stream("POST", CHAT, json=body) as holding:
            chunks = holding.iter_raw()
            next(chunks)
            started = time.monotonic()
            refused = http.post(CHAT, json={"model": "tiny", "messages": HELLO, "max_tokens": 2})
            assert_openai_error(refused, 429, "concurrency_limit_exceeded")
            assert time.monotonic() - started >= 0.9  # it waited in the queue first
        # A queued request gets the slot as soon as the holder goes away.
        results: list[int] = []

        def queued() -> None:
            response = httpx.post(gw.url + CHAT, json={"model": "tiny", "messages": HELLO, "max_tokens": 2}, timeout=60)
            results.append(response.status_code)

        with http.stream("POST", CHAT, json=body) as holding:
            chunks = holding.iter_raw()
            next(chunks)
            waiter = threading.Thread(target=queued)
            waiter.start()
            time.sleep(0.3)
        waiter.join(30)
        assert results == [200]


def test_503_engine_unreachable_and_504_stalled(tiny_engine: EngineProcess) -> None:
    with fake_stalled_upstream() as stalled:
        models = {"down": {"url": closed_port_url()}, "stalled": {"url": stalled}, "tiny": {"url": tiny_engine.url}}
        gateway_cfg = {"upstream_read_timeout_s": 0.5, "health_timeout_s": 3.0}
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


def test_request_id_echoed_or_generated(gateway: GatewayServer) -> None:
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        assert http.get("/health", headers={"X-Request-Id": "abc-123"}).headers["x-request-id"] == "abc-123"
        generated = http.get("/health", headers={"X-Request-Id": "bad id\twith junk"}).headers["x-request-id"]
        assert generated != "bad id\twith junk" and len(generated) == 32
        assert http.get("/v1/models").headers["x-request-id"]  # 401s carry one too


def test_metrics_after_traffic(gateway: GatewayServer) -> None:
    from tests.gateway.helpers import prometheus_value

    with httpx.Client(base_url=gateway.url, headers=auth(KEY), timeout=30) as http:
        http.post(CHAT, json={"model": "second", "messages": HELLO, "max_tokens": 3, "temperature": 0})
        text = http.get("/metrics").text
    assert prometheus_value(text, "gateway_requests_total", {"model": "second", "route": CHAT, "status": "200"}) >= 1
    assert prometheus_value(text, "gateway_tokens_total", {"model": "second", "kind": "completion"}) >= 1
    assert prometheus_value(text, "gateway_request_duration_seconds_count", {"model": "second", "route": CHAT}) >= 1
    assert prometheus_value(text, "gateway_in_flight_requests", {"model": "second"}) == 0
    assert prometheus_value(text, "gateway_engine_up", {"model": "tiny"}) is not None
