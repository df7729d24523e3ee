"""The lean engine client (model_code/lean.py) against the openai SDK path it replaces in the flavours: the same
chunks, the same flavour output, the same typed errors, on streams in SGLang's wire format replayed by a FAKE
transport (httpx.MockTransport: the answers are byte-exact and cut at arbitrary points, which a real engine
cannot be made to do on demand)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from model_code.client import EngineClient
from model_code.errors import EngineRequestError
from model_code.flavors.chat_agent import stream_to_chat_agent
from model_code.flavors.chat_model import stream_to_chat_model
from model_code.flavors.responses_agent import stream_to_responses
from model_code.lean import sse_data
from model_code.replica_set import Replica, ReplicaSet
from model_code.target import ModelCodeSettings

MESSAGES = [{"role": "user", "content": "hi"}]
BASE = {"id": "b1e4c0", "object": "chat.completion.chunk", "created": 1765000000, "model": "m"}


def _choice(delta: dict, finish: str | None = None, index: int = 0) -> dict:
    # SGLang sends these keys on every choice, null or not
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish, "matched_stop": None}


def _sse(chunks: list[dict], crlf: bool = False) -> bytes:
    newline = "\r\n" if crlf else "\n"
    lines = [f"data: {json.dumps({**BASE, **chunk})}{newline}{newline}" for chunk in chunks]
    return ("".join(lines) + f"data: [DONE]{newline}{newline}").encode()


USAGE = {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
TEXT = [
    {"choices": [_choice({"role": "assistant", "content": ""})], "usage": None},
    {"choices": [_choice({"content": "Hel", "reasoning_content": None, "tool_calls": None})], "usage": None},
    {"choices": [_choice({"content": "lo é"})], "usage": None},
    {"choices": [_choice({"content": ""}, "stop")], "usage": None},
    {"choices": [], "usage": USAGE},
]
TOOLS = [
    {"choices": [_choice({"role": "assistant", "content": None})], "usage": None},
    {"choices": [_choice({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                          "function": {"name": "get_weather", "arguments": ""}}]})], "usage": None},
    {"choices": [_choice({"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\": "}}]})], "usage": None},
    {"choices": [_choice({"tool_calls": [{"index": 0, "function": {"arguments": "\"Paris\"}"}}]})], "usage": None},
    {"choices": [_choice({"tool_calls": [{"index": 1, "id": "call_2", "type": "function",
                                          "function": {"name": "get_time", "arguments": "{}"}}]})], "usage": None},
    {"choices": [_choice({}, "tool_calls")], "usage": None},
    {"choices": [], "usage": USAGE},
]  # fmt: skip
LENGTH = [{"choices": [_choice({"content": "a"})]}, {"choices": [_choice({"content": "b"}, "length")], "usage": USAGE}]
STREAMS = {"text": _sse(TEXT), "text-crlf": _sse(TEXT, crlf=True), "tools": _sse(TOOLS), "length": _sse(LENGTH)}


def _pieces(data: bytes, size: int) -> httpx.SyncByteStream:
    class Pieces(httpx.SyncByteStream):
        def __iter__(self) -> Iterator[bytes]:
            for start in range(0, len(data), size):
                yield data[start : start + size]

    return Pieces()


def _client(answer: Callable[[httpx.Request], httpx.Response]) -> EngineClient:
    settings = ModelCodeSettings(max_retries=0)
    replica = Replica(0, "http://fake-engine", "k", settings)
    replica._client = openai.OpenAI(
        base_url=replica.base_url, api_key="k", max_retries=0, http_client=httpx.Client(transport=httpx.MockTransport(answer))
    )
    return EngineClient("m", ReplicaSet([replica]), settings)


def _replaying(data: bytes, size: int = 7, sent: list | None = None) -> EngineClient:
    def answer(request: httpx.Request) -> httpx.Response:
        if sent is not None:
            sent.append(request)
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_pieces(data, size))

    return _client(answer)


@pytest.mark.parametrize("size", [1, 7, 4096])
@pytest.mark.parametrize("name", sorted(STREAMS))
def test_the_lean_client_yields_the_sdks_chunks_chunk_for_chunk(name, size):
    client = _replaying(STREAMS[name], size)
    old = [chunk.model_dump(exclude_unset=True) for chunk in client.stream(MESSAGES)]
    new = list(client.stream_json(MESSAGES))
    assert new == old and len(new) == STREAMS[name].count(b"data: {")


def _dump(item):
    return item.to_dict() if hasattr(item, "to_dict") else item.model_dump(exclude_none=True)


@pytest.mark.parametrize("name", sorted(STREAMS))
@pytest.mark.parametrize("convert", [stream_to_chat_agent, stream_to_chat_model, stream_to_responses])
def test_each_flavour_converts_both_clients_streams_alike(name, convert, monkeypatch):
    client = _replaying(STREAMS[name])
    ids = iter(range(1000))
    monkeypatch.setattr("uuid.uuid4", lambda: type("U", (), {"hex": f"{next(ids):032x}"})())  # same fresh ids
    old = [_dump(item) for item in convert(client.stream(MESSAGES))]
    ids = iter(range(1000))
    new = [_dump(item) for item in convert(client.stream_json(MESSAGES))]
    assert new == old and new


def test_the_lean_request_is_the_sdks_request():
    sent: list[httpx.Request] = []
    client = _replaying(STREAMS["text"], sent=sent)
    params = {"temperature": 0.2, "max_tokens": 5, "top_k": 3, "json_schema": {"type": "object"}}
    list(client.stream(MESSAGES, params))
    list(client.stream_json(MESSAGES, params))
    old, new = sent
    assert json.loads(new.content) == json.loads(old.content)
    assert new.url == old.url and new.headers["authorization"] == old.headers["authorization"] == "Bearer k"


def _statuses() -> list[tuple[int, dict]]:
    return [
        (400, {"error": {"message": "This model's maximum context length is 2048 tokens", "code": 400}}),
        (400, {"object": "error", "message": "bad top_k", "type": "BadRequestError", "code": 400}),
        (401, {"error": {"message": "bad key"}}),
        (404, {"detail": "Not Found"}),
        (429, {"error": {"message": "slow down"}}),
        (500, {"error": {"message": "boom"}}),
        (503, {"error": {"message": "busy"}}),
    ]


def _raised(call: Callable[[], object]) -> EngineRequestError:
    with pytest.raises(EngineRequestError) as caught:
        call()
    return caught.value


@pytest.mark.parametrize(("status", "body"), _statuses())
def test_refusals_raise_the_same_typed_errors_on_both_paths(status, body):
    client = _client(lambda request: httpx.Response(status, json=body))
    for old_call, new_call in (
        (lambda: client.chat(MESSAGES), lambda: client.chat_json(MESSAGES)),
        (lambda: list(client.stream(MESSAGES)), lambda: list(client.stream_json(MESSAGES))),
    ):
        old, new = _raised(old_call), _raised(new_call)
        assert (type(new), str(new), new.engine_status, new.body) == (type(old), str(old), old.engine_status, old.body)


@pytest.mark.parametrize(
    "event",
    [{"error": {"message": "out of memory", "code": 500}}, {"error": {"message": "bad grammar", "code": 400}}, {"error": "x"}],
)
def test_an_error_event_mid_stream_raises_the_same_typed_error(event):
    data = _sse(TEXT[:2]).replace(b"data: [DONE]", f"data: {json.dumps(event)}".encode())
    client = _replaying(data)
    got_old, got_new = [], []
    old = _raised(lambda: got_old.extend(client.stream(MESSAGES)))
    new = _raised(lambda: got_new.extend(client.stream_json(MESSAGES)))
    assert (type(new), str(new), new.body) == (type(old), str(old), old.body)


@pytest.mark.parametrize("error", [httpx.ConnectError("refused"), httpx.ReadTimeout("slow")])
def test_transport_failures_raise_the_same_typed_errors(error, monkeypatch):
    monkeypatch.setattr(time, "sleep", lambda seconds: None)

    def answer(request: httpx.Request) -> httpx.Response:
        raise error

    for old_call, new_call in (  # a fresh client each: a timeout puts the call's shape in quarantine
        (lambda: _client(answer).chat(MESSAGES), lambda: _client(answer).chat_json(MESSAGES)),
        (lambda: list(_client(answer).stream(MESSAGES)), lambda: list(_client(answer).stream_json(MESSAGES))),
    ):
        old, new = _raised(old_call), _raised(new_call)
        assert (type(new), str(new)) == (type(old), str(old))


def test_the_sse_reader_joins_multi_line_data_and_skips_comments_and_fields():
    stream = [b": ping\n\nevent: x\nid: 3\ndata: {\"a\":\ndata:  1}\n", b"\n", b"data:[DONE]"]
    assert list(sse_data(iter(stream))) == [b'{"a":\n 1}', b"[DONE]"]


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_trace_reducers_read_built_chunks_as_they_read_their_dumps(name):
    from model_code.flavors.chat_agent import reduce_chat_agent_chunks
    from model_code.flavors.chat_model import reduce_chat_model_chunks

    agent = list(stream_to_chat_agent(_replaying(STREAMS[name]).stream_json(MESSAGES)))
    assert reduce_chat_agent_chunks(agent) == reduce_chat_agent_chunks([c.model_dump(exclude_none=True) for c in agent])
    chat = list(stream_to_chat_model(_replaying(STREAMS[name]).stream_json(MESSAGES)))
    assert reduce_chat_model_chunks(chat) == reduce_chat_model_chunks([c.to_dict() for c in chat])
