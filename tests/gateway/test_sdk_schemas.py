"""Every generation route's answers, plain and streamed, as the official SDKs' own response models take them
(tests/sdk_models.py: strict validation, the SDK's dump, pydantic-ai's ``model_validate``, no undeclared key that is
not a known harmless SGLang addition), on the real engine through the gateway. Embeddings: tests/gateway/
test_embeddings.py (an embedding engine); batch output lines: tests/batches/test_batch_engine.py.

The tiny random-weight model is enough for shapes: a forced tool call is held to the tool's schema by the engine's
grammar (sampled, it ends in tens of tokens; an enum keeps the argument short), so every route's tool-call objects
come back too. The real default model (SmolLM2) checks the same on calls the model makes itself (``real_model``).

SGLang 0.5.23's plain chat and text completions carry ``"metadata": {"weight_version": ..., "weight_versions":
[{...}]}``: the list is no string, which OpenAI's ``Metadata`` (and so pydantic-ai, through ``ChatCompletion`` of
openai 3) refuses. The gateway drops it unless the client asks for the engine's answer as written
(``X-SGLang-Extensions: keep``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent

from launch.process import EngineProcess
from tests.gateway.helpers import assert_openai_error
from tests.gateway_server import GatewayServer, serve_engine
from tests.sdk_models import assert_sdk_valid

CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}}, "required": ["city"]}
TOOL = {"name": "get_weather", "description": "Get the current weather in a city", "parameters": CITY}
QUESTION = "What's the weather like in Paris today?"
PLAIN = {"temperature": 0, "max_tokens": 8}
FORCED = {"temperature": 1.0, "max_tokens": 300}  # sampled: a forced call ends in tens of tokens (greedy may loop)

# route -> (path, body without model and sampling, plain model, stream event model)
CASES: dict[str, tuple[str, dict[str, Any], Any, Any]] = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": QUESTION}], "logprobs": True, "top_logprobs": 2},
             ChatCompletion, ChatCompletionChunk),
    "chat_tools": ("/v1/chat/completions", {"messages": [{"role": "user", "content": QUESTION}],
                   "tools": [{"type": "function", "function": TOOL}], "tool_choice": "required"}, ChatCompletion, ChatCompletionChunk),
    "completions": ("/v1/completions", {"prompt": "Once upon a time", "logprobs": 2}, Completion, Completion),
    "responses": ("/v1/responses", {"input": QUESTION, "store": False}, Response, ResponseStreamEvent),
    "responses_tools": ("/v1/responses", {"input": QUESTION, "store": False, "tools": [{"type": "function", **TOOL}],
                        "tool_choice": "required"}, Response, ResponseStreamEvent),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": QUESTION}]}, Message, RawMessageStreamEvent),
    "messages_tools": ("/v1/messages", {"messages": [{"role": "user", "content": QUESTION}], "tool_choice": {"type": "any"},
                       "tools": [{"name": TOOL["name"], "description": TOOL["description"], "input_schema": CITY}]},
                       Message, RawMessageStreamEvent),
}  # fmt: skip


@pytest.fixture(scope="module")
def gateway(tiny_engine: EngineProcess) -> Iterator[GatewayServer]:
    with serve_engine("tiny", tiny_engine) as server:
        yield server


@pytest.fixture(scope="module")
def real_gateway(smollm2_engine: EngineProcess) -> Iterator[GatewayServer]:
    with serve_engine("smollm2", smollm2_engine) as server:
        yield server


def _body(case: str, stream: bool, sampling: dict[str, Any]) -> dict[str, Any]:
    path, body, _, _ = CASES[case]
    tokens = {"max_output_tokens": sampling["max_tokens"]} if path == "/v1/responses" else {"max_tokens": sampling["max_tokens"]}
    extra = {"stream_options": {"include_usage": True}} if stream and path in ("/v1/chat/completions", "/v1/completions") else {}
    return {"model": "default", **body, "temperature": sampling["temperature"], **tokens, "stream": stream, **extra}


def _events(response: httpx.Response) -> list[dict[str, Any]]:
    """The JSON objects of an SSE body's ``data:`` lines (``[DONE]`` left out), in order."""
    return [json.loads(line[6:]) for line in response.text.split("\n") if line.startswith("data: {")]


def _answers(url: str, case: str, stream: bool, sampling: dict[str, Any], headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    path = CASES[case][0]
    response = httpx.post(url + path, json=_body(case, stream, sampling), headers=headers, timeout=300)
    assert response.status_code == 200, response.text
    answers = _events(response) if stream else [response.json()]
    failed = [answer for answer in answers if answer.get("type") == "error" or (answer.get("error") is not None and "type" not in answer)]
    assert answers and not failed, answers
    return answers


def _assert_valid(case: str, stream: bool, answers: list[dict[str, Any]]) -> None:
    _, _, plain, event = CASES[case]
    for answer in answers:
        assert_sdk_valid(event if stream else plain, answer, allow_null_finish=stream and plain is Completion)


def _tool_calls(answers: list[dict[str, Any]]) -> int:
    """How many tool-call objects the answers hold (a forced call must come back as one)."""
    text = json.dumps(answers)
    return sum(text.count(marker) for marker in ('"tool_calls": [{', '"type": "function_call"', '"type": "tool_use"'))


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("case", list(CASES))
def test_answers_validate_against_the_sdk_models(case: str, stream: bool, gateway: GatewayServer) -> None:
    answers = _answers(gateway.url, case, stream, FORCED if case.endswith("_tools") else PLAIN)
    _assert_valid(case, stream, answers)
    if case.endswith("_tools"):
        assert _tool_calls(answers), answers  # the route's tool-call objects were checked, not only text


def test_the_engine_answer_as_written_when_asked(gateway: GatewayServer) -> None:
    """``X-SGLang-Extensions: keep``: SGLang's weight versions come back (``drop``, the default, leaves the string
    ``weight_version`` alone); any other value is refused, naming the two."""
    kept = _answers(gateway.url, "chat", False, PLAIN, {"X-SGLang-Extensions": "keep"})[0]
    assert isinstance(kept["metadata"]["weight_versions"], list), kept
    for headers in ({"X-SGLang-Extensions": "drop"}, None):
        dropped = _answers(gateway.url, "completions", False, PLAIN, headers)[0]
        assert dropped["metadata"] == {"weight_version": kept["metadata"]["weight_version"]}, dropped
    refused = httpx.post(gateway.url + "/v1/chat/completions", json=_body("chat", False, PLAIN), headers={"X-SGLang-Extensions": "all"}, timeout=60)
    error = assert_openai_error(refused, 400, "invalid_header")["error"]
    assert "'keep' or 'drop'" in error["message"] and error["param"] == "x-sglang-extensions", error


@pytest.mark.real_model
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("case", ["chat_tools", "responses_tools"])
def test_real_model_answers_validate_against_the_sdk_models(case: str, stream: bool, real_gateway: GatewayServer) -> None:
    """SmolLM2's forced calls (greedy: the real model writes its call itself; the chat route ends at the call, in
    about 30 tokens). The other routes' shapes are the tiny model's above."""
    answers = _answers(real_gateway.url, case, stream, {"temperature": 0, "max_tokens": 40})
    _assert_valid(case, stream, answers)
    if case.endswith("_tools"):
        assert _tool_calls(answers), answers
