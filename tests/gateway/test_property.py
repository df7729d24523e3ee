"""Property-based fuzzing of the request surface (hypothesis, over a real socket).

Malformed, oversized and type-confused bodies, odd headers and unknown paths must get a 4xx in
OpenAI's error shape: never a 500, never a hang; and the gateway must still serve afterwards.
"""

from __future__ import annotations

import string
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from launch.model_info import vocab_size
from launch.process import EngineProcess
from tests.gateway.helpers import assert_no_internals, assert_openai_error
from tests.gateway_server import KEY, GatewayServer, auth, serve

MAX_BODY = 4096
HELLO = [{"role": "user", "content": "hi"}]
BASES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "tiny", "messages": HELLO, "max_tokens": 2},
    "/v1/completions": {"model": "tiny", "prompt": "hi", "max_tokens": 2},
    "/v1/embeddings": {"model": "tiny", "input": "hi"},
    "/v1/responses": {"model": "tiny", "input": "hi", "max_output_tokens": 2},
    "/v1/messages": {"model": "tiny", "messages": HELLO, "max_tokens": 2},
    "/v1/messages/count_tokens": {"model": "tiny", "messages": HELLO},
    "/v1/tokenize": {"model": "tiny", "prompt": "hi"},
    "/v1/detokenize": {"model": "tiny", "tokens": [1, 2]},
    "/v1/score": {"model": "tiny", "query": "q", "items": ["a"], "label_token_ids": [1]},
    "/v1/rerank": {"model": "tiny", "query": "q", "documents": ["a"]},
    "/v1/classify": {"model": "tiny", "input": "hi"},
}
# field -> strategy of values of a type the field never accepts
_text = st.text(max_size=12)
_ints = st.integers(-5, 5)
_lists = st.lists(st.integers(), min_size=1, max_size=3)
_dicts = st.dictionaries(st.text(max_size=4), st.integers(), min_size=1, max_size=2)
WRONG: dict[str, st.SearchStrategy[Any]] = {
    "model": st.one_of(_ints, _lists, _dicts, st.booleans(), st.none()),
    "stream": st.one_of(_text, _ints, _lists, _dicts),
    "n": st.one_of(_text, _lists, _dicts, st.booleans()),
    "max_tokens": st.one_of(_text, _lists, _dicts, st.booleans(), st.integers(max_value=-1)),
    "temperature": st.one_of(_text, _lists, _dicts, st.booleans(), st.floats(max_value=-0.01, allow_infinity=False)),
    "top_p": st.one_of(_text, _lists, _dicts, st.floats(min_value=1.01, allow_infinity=False)),
    "stream_options": st.one_of(_text, _ints, _lists),
}
# Routes whose model is optional (the default model when absent) take "model": null as absent.
OPTIONAL_MODEL_WRONG = st.one_of(_ints, _lists, _dicts, st.booleans())
CHAT_WRONG = {**WRONG, "messages": st.one_of(_text, _ints, _dicts, _lists, st.just([]))}
COMPLETION_WRONG = {**WRONG, "prompt": st.one_of(_ints, _dicts, st.booleans(), st.just([]))}
EMBEDDING_WRONG = {"model": WRONG["model"], "input": st.one_of(_ints, _dicts, st.booleans(), st.just([]))}
_SAMPLING_WRONG = {key: WRONG[key] for key in ("model", "stream", "temperature", "top_p")}
_MESSAGES = st.one_of(_text, _ints, _dicts, _lists, st.just([]))
FIELDS = {
    "/v1/chat/completions": CHAT_WRONG,
    "/v1/completions": COMPLETION_WRONG,
    "/v1/embeddings": EMBEDDING_WRONG,
    "/v1/responses": {**_SAMPLING_WRONG, "input": st.one_of(_ints, _dicts, st.booleans(), st.just([])),
                      "max_output_tokens": st.one_of(_text, _lists, st.integers(max_value=0)), "previous_response_id": st.one_of(_ints, _lists)},
    "/v1/messages": {**_SAMPLING_WRONG, "messages": _MESSAGES, "max_tokens": st.one_of(_text, _lists, st.integers(max_value=0)),
                     "system": st.one_of(_ints, _dicts)},
    "/v1/messages/count_tokens": {"model": WRONG["model"], "messages": _MESSAGES},
    "/v1/tokenize": {"model": OPTIONAL_MODEL_WRONG, "prompt": st.one_of(_ints, _dicts, st.booleans())},
    "/v1/detokenize": {"model": OPTIONAL_MODEL_WRONG, "tokens": st.one_of(_text, _dicts, st.booleans(), st.just([]), st.just([-1]))},
    "/v1/score": {"model": OPTIONAL_MODEL_WRONG, "query": st.one_of(_dicts, st.booleans(), st.just([-2])), "label_token_ids": st.one_of(_text, _dicts)},
    "/v1/rerank": {"model": OPTIONAL_MODEL_WRONG, "query": st.one_of(_ints, st.booleans()), "documents": st.one_of(_text, _ints, st.just([]))},
    "/v1/classify": {"model": OPTIONAL_MODEL_WRONG, "input": st.one_of(_ints, _dicts, st.booleans(), st.just([]))},
}  # fmt: skip
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8,
)
header_values = st.text(alphabet=string.ascii_letters + string.digits + " -_.:;,=/+*", max_size=60).map(str.strip)


@st.composite
def type_confused(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    path = draw(st.sampled_from(sorted(BASES)))
    body = dict(BASES[path])
    extras = draw(st.dictionaries(st.text(min_size=1, max_size=8).filter(lambda k: k not in FIELDS[path] and k not in body), json_values, max_size=3))
    body.update(extras)
    for field in draw(st.lists(st.sampled_from(sorted(FIELDS[path])), min_size=1, max_size=3, unique=True)):
        body[field] = draw(FIELDS[path][field])
    return path, body


@pytest.fixture(scope="module")
def fuzz_gateway(tiny_engine: EngineProcess) -> Iterator[GatewayServer]:
    model = {"url": tiny_engine.url, "vocab_size": vocab_size(tiny_engine.config.model_path)}
    with serve({"tiny": model}, {"api_keys": [KEY], "max_body_bytes": MAX_BODY}) as gw:
        yield gw


@pytest.fixture(scope="module")
def http(fuzz_gateway: GatewayServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fuzz_gateway.url, timeout=httpx.Timeout(20.0)) as client:
        yield client


FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def assert_dialect_error(response: httpx.Response, status: int, path: str) -> None:
    """An error in the route's dialect: Anthropic's on /v1/messages*, OpenAI's elsewhere."""
    if path.startswith("/v1/messages"):
        assert response.status_code == status, response.text
        body = response.json()
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["message"], body
        assert_no_internals(response)
    else:
        assert_openai_error(response, status)


@FUZZ
@given(case=type_confused())
def test_type_confused_bodies_are_400(http: httpx.Client, case: tuple[str, dict[str, Any]]) -> None:
    path, body = case
    assert_dialect_error(http.post(path, json=body, headers=auth()), 400, path)


@FUZZ
@given(path=st.sampled_from(sorted(BASES)), raw=st.one_of(st.binary(max_size=200), json_values.map(lambda v: __import__("json").dumps(v).encode())))
def test_malformed_bodies_are_400(http: httpx.Client, path: str, raw: bytes) -> None:
    response = http.post(path, content=raw, headers=auth())
    assert_dialect_error(response, 400, path)


@FUZZ
@given(path=st.sampled_from(sorted(BASES)), size=st.integers(MAX_BODY + 1, 4 * MAX_BODY), chunked=st.booleans())
def test_oversized_bodies_are_413(http: httpx.Client, path: str, size: int, chunked: bool) -> None:
    raw = b'{"model": "tiny", "pad": "' + b"x" * size + b'"}'
    content: Any = iter([raw[i : i + 1000] for i in range(0, len(raw), 1000)]) if chunked else raw
    assert_dialect_error(http.post(path, content=content, headers=auth()), 413, path)


@FUZZ
@given(
    path=st.sampled_from([*sorted(BASES), "/v1/models", "/metrics"]),
    headers=st.dictionaries(
        st.sampled_from(["authorization", "content-type", "x-request-id", "accept", "x-api-key", "accept-encoding", "x-junk"]),
        header_values,
        min_size=1,
        max_size=4,
    ),
    junk_json=st.booleans(),
)
def test_odd_headers_never_500(http: httpx.Client, path: str, headers: dict[str, str], junk_json: bool) -> None:
    headers.setdefault("authorization", f"Bearer {KEY}")
    if path in BASES:
        body = b"{" if junk_json else b'{"model": "nope", "messages": [], "prompt": "", "input": ""}'
        response = http.post(path, content=body, headers=headers)
    else:
        response = http.get(path, headers=headers)
    if response.status_code >= 400:
        assert_dialect_error(response, response.status_code, path)
        assert response.status_code < 500
    assert response.headers["x-request-id"]


GATEWAY_GETS = ("/", "/health", "/ready", "/metrics", "/v1/models", "/openapi.json")  # "/": the status page ("/." resolves to it)
"""The gateway's own GET routes (answered 200 here: the key is sent, the engine is up)."""


@FUZZ
@given(segments=st.lists(st.text(alphabet=string.ascii_letters + string.digits + "-._~%", min_size=1, max_size=10), min_size=1, max_size=4),
       method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]))
@example(segments=["v1", "models", "tiny"], method="GET")
@example(segments=["v1", "models", "nope"], method="GET")
@example(segments=["v1", "models"], method="POST")
@example(segments=["health"], method="GET")
@example(segments=["ready"], method="GET")
@example(segments=["metrics"], method="GET")
@example(segments=["v1", "models"], method="GET")
@example(segments=["openapi.json"], method="GET")
@example(segments=[".py"], method="GET")  # the answer echoes the path: the client's, not a leaked source file
def test_unknown_paths_and_methods_are_4xx(http: httpx.Client, segments: list[str], method: str) -> None:
    path = "/" + "/".join(segments)
    response = http.request(method, path, headers=auth())
    path = response.request.url.path  # as sent (dot segments resolved) and decoded, as the gateway routes it
    if path.startswith("/v1/models/") and method == "GET":
        assert response.status_code == (200 if path == "/v1/models/tiny" else 404), (path, response.text)
        return
    if path in GATEWAY_GETS and method == "GET":
        assert response.status_code == 200, (path, response.text)
        return
    assert_dialect_error(response, response.status_code, path)
    assert 400 <= response.status_code < 500


def test_gateway_still_serves_after_fuzzing(http: httpx.Client) -> None:
    ok = http.post("/v1/chat/completions", json={"model": "tiny", "messages": HELLO, "max_tokens": 2}, headers=auth())
    assert ok.status_code == 200 and ok.json()["choices"]
    assert http.get("/ready").status_code == 200
