"""OpenTelemetry traces (``gateway.tracing``), exported over OTLP/HTTP to a real receiver in the test process
(:mod:`tests.otlp`, the protobuf service of ``opentelemetry-proto``), in front of the session's real CPU engine.

The gateway flushes its spans when it stops (``serve`` leaving its block): each test reads them after that.
The engine's own spans under the gateway's are in ``test_tracing_engine.py`` (an engine started with its tracing on).
"""

from __future__ import annotations

import json
import secrets
import socket
import time

import httpx
import openai
import pytest

from launch.process import EngineProcess
from tests.fake_upstreams import SSE_HEAD, fake_answering_upstream, http_chunk, read_request
from tests.gateway_server import KEY, auth, serve
from tests.otlp import Span, otlp_grpc_receiver, otlp_receiver

SERVER, CLIENT, INTERNAL = 2, 3, 1
HELLO = [{"role": "user", "content": "Say something."}]


def _tracing(endpoint: str, **more: object) -> dict[str, object]:
    return {"keys": [{"name": "team-a", "key": KEY}], "tracing": {"enabled": True, "endpoint": endpoint, **more}}


def _one(spans: list[Span], **where: object) -> Span:
    found = [span for span in spans if all(getattr(span, key) == value for key, value in where.items())]
    assert len(found) == 1, (where, [(span.name, span.kind, span.parent_id) for span in spans])
    return found[0]


def test_a_request_is_one_trace_continuing_the_clients_with_genai_attributes(tiny_engine: EngineProcess) -> None:
    client_trace, client_span = secrets.token_hex(16), secrets.token_hex(8)
    with otlp_receiver() as otlp:
        with serve({"tiny": {"url": tiny_engine.url}}, _tracing(otlp.endpoint)) as gw:
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
            raw = client.chat.completions.with_raw_response.create(
                model="tiny", messages=HELLO, max_tokens=6, temperature=0.5, top_p=0.9,
                extra_headers={"traceparent": f"00-{client_trace}-{client_span}-01", "tracestate": "vendor=abc"},
            )  # fmt: skip
            answer = raw.parse()
            request_id = raw.headers["x-request-id"]
            chunks = list(
                client.chat.completions.create(
                    model="tiny", messages=HELLO, max_tokens=5, temperature=0, stream=True, stream_options={"include_usage": True}
                )
            )
            missing = httpx.post(gw.url + "/v1/chat/completions", json={"model": "nope", "messages": HELLO}, headers=auth(), timeout=30)
            assert missing.status_code == 404
        spans = otlp.of_trace(client_trace)

    # the plain request: one trace under the client's span, the server span above its queue wait and its attempt
    assert {span.service for span in spans} == {"sglang-gateway"}
    server = _one(spans, kind=SERVER)
    assert server.parent_id == client_span and server.name == "POST /v1/chat/completions"
    attributes = server.attributes
    assert attributes["gen_ai.operation.name"] == "chat" and attributes["gen_ai.request.model"] == "tiny"
    assert attributes["gen_ai.usage.input_tokens"] == answer.usage.prompt_tokens
    assert attributes["gen_ai.usage.output_tokens"] == answer.usage.completion_tokens
    assert attributes["gen_ai.response.finish_reasons"] == [answer.choices[0].finish_reason]
    assert attributes["gen_ai.request.max_tokens"] == 6 and attributes["gen_ai.request.temperature"] == 0.5
    assert attributes["gen_ai.request.top_p"] == 0.9
    assert attributes["gateway.request_id"] == request_id and attributes["gateway.key_name"] == "team-a"
    assert attributes["http.response.status_code"] == 200 and attributes["gateway.stream"] is False
    assert KEY not in json.dumps([span.attributes for span in spans])  # the key's name, never the key
    queue = _one(spans, kind=INTERNAL)
    attempt = _one(spans, kind=CLIENT)
    assert queue.parent_id == attempt.parent_id == server.span_id and queue.name == "gateway.queue"
    assert attempt.name == "chat tiny" and attempt.attributes["server.port"] == int(tiny_engine.url.rsplit(":", 1)[1])
    assert "first_byte" in attempt.events and attempt.status_code == 0
    assert server.start_ns <= queue.start_ns <= queue.end_ns <= attempt.start_ns <= attempt.end_ns <= server.end_ns

    # the stream: its own trace (no traceparent), tokens from the usage chunk, the finish reason from its last events
    streamed = [span for span in otlp.spans if span.kind == SERVER and span.attributes.get("gateway.stream") is True]
    assert len(streamed) == 1, streamed
    stream = streamed[0]
    assert stream.trace_id != client_trace and stream.parent_id == ""
    usage = chunks[-1].usage
    assert usage is not None
    assert stream.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens == 5
    assert stream.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert stream.attributes["gen_ai.server.time_to_first_token"] > 0

    # a client error: its code as error.type, the span not marked failed (a 4xx is the client's)
    refused = next(span for span in otlp.spans if span.kind == SERVER and span.attributes["http.response.status_code"] == 404)
    assert refused.attributes["error.type"] == "model_not_found" and refused.status_code == 0


def test_a_stream_the_client_cuts_ends_its_spans_cancelled(tiny_engine: EngineProcess) -> None:
    with otlp_receiver() as otlp:
        with serve({"tiny": {"url": tiny_engine.url}}, _tracing(otlp.endpoint)) as gw:
            body = {"model": "tiny", "messages": HELLO, "max_tokens": 1500, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, headers=auth(), timeout=60) as response:
                lines = response.iter_lines()
                for _ in range(3):
                    next(lines)
            # the client is gone: the gateway notices, closes the upstream (the engine aborts) and ends the spans
        spans = otlp.wait_for(lambda spans: any(span.kind == SERVER for span in spans), 30, "the server span")
    server = _one(spans, kind=SERVER)
    assert server.attributes["gateway.cancelled"] is True and server.attributes["error.type"] == "cancelled"
    assert "cancelled" in server.events and server.status_code == 2 and server.status_message == "client disconnected"
    attempt = _one(spans, kind=CLIENT)
    assert attempt.status_code == 2 and attempt.attributes["error.type"] == "cancelled"
    assert server.attributes.get("gen_ai.usage.output_tokens") is None or server.attributes["gen_ai.usage.output_tokens"] < 1500


def test_sampling_at_zero_exports_nothing_but_a_sampled_client_trace_is_kept(tiny_engine: EngineProcess) -> None:
    client_trace, client_span = secrets.token_hex(16), secrets.token_hex(8)
    with otlp_receiver() as otlp:
        with serve({"tiny": {"url": tiny_engine.url}}, _tracing(otlp.endpoint, sample_ratio=0)) as gw:
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
            for _ in range(3):
                client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2)
            unsampled = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-00"
            client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2, extra_headers={"traceparent": unsampled})
            sampled = f"00-{client_trace}-{client_span}-01"  # the client's decision wins over the ratio (parent-based)
            client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2, extra_headers={"traceparent": sampled})
    assert {span.trace_id for span in otlp.spans} == {client_trace}, [(span.name, span.trace_id) for span in otlp.spans]
    assert _one(otlp.spans, kind=SERVER).parent_id == client_span


def test_spans_go_over_grpc_to_a_collectors_trace_service() -> None:
    """``protocol: grpc``: the same spans through OTLP/gRPC (no engine needed: a request for an unknown model is
    answered by the gateway alone, and traced)."""
    client_trace, client_span = secrets.token_hex(16), secrets.token_hex(8)
    with otlp_grpc_receiver() as otlp:
        with serve({"tiny": {"url": "http://127.0.0.1:9"}}, _tracing(otlp.endpoint, protocol="grpc", service_name="gw-grpc")) as gw:
            missing = httpx.post(
                gw.url + "/v1/chat/completions", json={"model": "nope", "messages": HELLO}, timeout=30,
                headers={**auth(), "traceparent": f"00-{client_trace}-{client_span}-01"},
            )  # fmt: skip
            assert missing.status_code == 404
    server = _one(otlp.of_trace(client_trace), kind=SERVER)
    assert server.service == "gw-grpc" and server.parent_id == client_span and server.name == "POST /v1/chat/completions"
    assert server.attributes["error.type"] == "model_not_found" and server.attributes["gateway.key_name"] == "team-a"


@pytest.mark.parametrize(
    "pauses", [(0.05, 0.05, 0.05, 0.05), (0.002, 0.03, 0.03, 0.0)], ids=["50ms-apart", "finish-and-usage-before-the-handover"]
)
def test_a_streams_finish_reason_is_traced_when_finish_usage_and_done_come_in_separate_reads(pauses: tuple[float, ...]) -> None:
    """A FAKE engine (it can be made to pause between its last events; the real one sends them as it pleases)
    sends its finish event, its usage and [DONE] in separate reads: [DONE] goes out as it comes, and the trace still
    names the finish reason from the events before it. 50 ms apart, the stream goes to the native relay at its finish
    (its first read 10 ms after the first); in the second timing the Python relay writes the finish and the usage, and
    the native one only [DONE] and the end."""

    def answer(conn: socket.socket) -> None:
        read_request(conn)
        conn.sendall(SSE_HEAD)
        for event, pause in zip((
            b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n',
            b'data: {"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n',
            b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}\n\n',
            b"data: [DONE]\n\n",
        ), pauses, strict=True):  # fmt: skip
            conn.sendall(http_chunk(event))
            time.sleep(pause)
        conn.sendall(b"0\r\n\r\n")

    with otlp_receiver() as otlp:
        with fake_answering_upstream(answer) as url, serve({"m": {"url": url}}, _tracing(otlp.endpoint)) as gw:
            body = {"model": "m", "messages": HELLO, "max_tokens": 1, "stream": True, "stream_options": {"include_usage": True}}
            with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, headers=auth(), timeout=30) as streamed:
                assert b"data: [DONE]" in b"".join(streamed.iter_raw())
        stream = _one(otlp.spans, kind=SERVER)
    assert stream.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert stream.attributes["gen_ai.usage.output_tokens"] == 1
