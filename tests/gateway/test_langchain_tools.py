"""LangChain's tool-calling agent loop through the gateway, unchanged: ``ChatOpenAI(...).bind_tools([...])`` pointed at
the gateway's ``/v1``, on the real default model (SmolLM2-135M-Instruct, greedy), over chat completions and over the
Responses API (``use_responses_api=True``), invoked and streamed.

LangChain parses the answers itself (``AIMessage.tool_calls``, streamed ``tool_call_chunks`` merged by index), so these
tests hold the gateway to what a LangChain agent reads, not to what our own tests think the SDK objects are: the call
comes back as a tool call (never as text), with an id, the tool's name and arguments of its schema; the tool's result,
sent back as a ``ToolMessage``, is what the model answers from.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from launch.process import EngineProcess
from tests.gateway_server import GatewayServer, serve_engine

pytestmark = pytest.mark.real_model

QUESTION = "What's the weather like in Paris today?"
FORECAST = "Heavy snow, minus 12 degrees."


@tool
def get_weather(city: Literal["Paris", "Tokyo", "Lima"]) -> str:
    """Get the current weather in a city."""
    return FORECAST if city == "Paris" else "Sunny."


@pytest.fixture(scope="module")
def gateway(smollm2_engine: EngineProcess) -> Iterator[GatewayServer]:
    with serve_engine("smollm2", smollm2_engine) as server:
        yield server


def _model(gateway: GatewayServer, responses: bool, max_tokens: int) -> ChatOpenAI:
    return ChatOpenAI(
        model="default", base_url=gateway.url + "/v1", api_key="unused", temperature=0, max_tokens=max_tokens,
        max_retries=0, timeout=300, use_responses_api=responses,
    )  # fmt: skip


def _ask(model: object, messages: list[BaseMessage], streamed: bool) -> AIMessage:
    if not streamed:
        answer = model.invoke(messages)  # type: ignore[attr-defined]
        assert isinstance(answer, AIMessage)
        return answer
    joined: AIMessageChunk | None = None
    for chunk in model.stream(messages):  # type: ignore[attr-defined]
        joined = chunk if joined is None else joined + chunk
    assert joined is not None, "no chunk streamed"
    return joined


@pytest.mark.parametrize("streamed", [False, True], ids=["invoke", "stream"])
@pytest.mark.parametrize("responses", [False, True], ids=["chat", "responses"])
def test_a_bind_tools_agent_loop_runs_unchanged(gateway: GatewayServer, responses: bool, streamed: bool) -> None:
    """Call (forced: ``tool_choice`` naming the tool, as LangChain sends it) -> the tool run by LangChain -> the answer."""
    llm = _model(gateway, responses, max_tokens=40)
    history: list[BaseMessage] = [HumanMessage(QUESTION)]
    first = _ask(llm.bind_tools([get_weather], tool_choice="get_weather"), history, streamed)
    assert not first.invalid_tool_calls, first.invalid_tool_calls
    (call,) = first.tool_calls
    assert call["name"] == "get_weather" and call["args"] == {"city": "Paris"} and call["id"], call
    assert "<tool_call>" not in first.text and "get_weather" not in first.text, first.content  # the text blocks only
    result = get_weather.invoke(call)
    assert isinstance(result, ToolMessage) and result.tool_call_id == call["id"] and result.content == FORECAST
    history += [first, result]
    final = _ask(_model(gateway, responses, max_tokens=26).bind_tools([get_weather]), history, streamed)
    assert not final.tool_calls, final.tool_calls
    assert "snow" in final.text.lower(), final.content
