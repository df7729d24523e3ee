"""Raw HTTP (curl-style) checks of the SSE framing the gateway relays."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator

import httpx
import pytest

from gateway.edge.cycle import GatewayCycle
from launch.process import EngineProcess
from tests.gateway_server import KEY, GatewayServer, auth, serve


def _raw_stream(gateway: GatewayServer, path: str, body: dict) -> tuple[httpx.Response, bytes]:
    with httpx.Client(timeout=60) as http, http.stream("POST", gateway.url + path, json=body, headers=auth()) as response:
        raw = b"".join(response.iter_raw())
    return response, raw


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}}),
        ("/v1/completions", {"model": "tiny", "prompt": "hi"}),
    ],
)
def test_sse_framing(gateway: GatewayServer, path: str, body: dict) -> None:
    response, raw = _raw_stream(gateway, path, {**body, "stream": True, "max_tokens": 6, "temperature": 0})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-request-id"]
    assert raw.endswith(b"\n\n"), raw[-40:]
    events = raw[:-2].split(b"\n\n")
    assert all(event.startswith(b"data: ") and b"\n" not in event for event in events), events
    assert events[-1] == b"data: [DONE]"
    payloads = [json.loads(event[6:]) for event in events[:-1]]
    assert all("choices" in p for p in payloads)
    if "stream_options" in body:
        assert payloads[-1]["usage"]["completion_tokens"] <= 6


@pytest.fixture(scope="module")
def unmeasured(tiny_engine: EngineProcess) -> Iterator[GatewayServer]:
    """A gateway that does not measure grammars (``max_grammar_compile_s`` unset): a schema the engine cannot compile
    reaches it, and fails there after the stream's 200, as it does on an engine the gateway cannot measure."""
    with serve({"tiny": {"url": tiny_engine.url}}, {"api_keys": [KEY], "request_bounds": {"max_grammar_compile_s": None}}) as server:
        yield server


def test_stream_error_event_is_sanitized(gateway: GatewayServer, unmeasured: GatewayServer) -> None:
    """An error the engine reports inside a 200 stream reaches the client in OpenAI's shape, without paths. (Where
    grammars are measured, the same schema is refused before the stream: 400 invalid_grammar.)"""
    schema = {"name": "bad", "schema": {"type": "bogus"}}  # SGLang fails compiling it, after the 200
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": schema}}
    refused, said = _raw_stream(gateway, "/v1/chat/completions", body)
    assert refused.status_code == 400 and json.loads(said)["error"]["code"] == "invalid_grammar", said
    response, raw = _raw_stream(unmeasured, "/v1/chat/completions", body)
    assert response.status_code == 200
    events = raw.strip().split(b"\n\n")
    errors = [json.loads(e[6:]) for e in events if e.startswith(b'data: {"error"')]
    assert len(errors) == 1, raw
    error = errors[0]["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert "/project" not in error["message"] and ".cc" not in error["message"], error["message"]
    assert "bogus" in error["message"]


def test_a_finished_request_leaves_no_reference_cycle_for_the_collector(gateway: GatewayServer) -> None:
    """The HTTP cycle and the request's scope refer to each other while it runs; once answered (streamed or not), the
    two are freed by their counts. Were they a reference cycle, every request would leave a dozen objects for the
    cyclic collector, whose passes then walk them: with it off, they would pile up here, one set a request."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    gc.collect()
    gc.disable()
    try:
        with httpx.Client(base_url=gateway.url, headers=auth(), timeout=60) as http:
            for stream in (False, True) * 10:
                assert http.post("/v1/chat/completions", json={**body, "stream": stream}).status_code == 200
        left = sum(1 for thing in gc.get_objects() if isinstance(thing, GatewayCycle))
    finally:
        gc.enable()
    assert left <= 2, f"{left} HTTP cycles of 20 requests wait for the collector"
