"""openai-agents (the OpenAI Agents SDK): ``Agent`` + ``Runner`` on ``OpenAIResponsesModel`` and on
``OpenAIChatCompletionsModel``, with an ``AsyncOpenAI`` client pointed at the gateway."""

from __future__ import annotations

import asyncio

import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from common import (
    API_KEY,
    CHAT_QUESTION,
    CITY_QUESTION,
    MAX_TOKENS,
    MODEL,
    WEATHER_QUESTION,
    City,
    assert_city,
    assert_paris,
    assert_snow,
    cell,
    get_weather,
)
from openai import AsyncOpenAI
from openai.types.responses import ResponseTextDeltaEvent

set_tracing_disabled(True)  # its traces go to OpenAI's servers otherwise

ROWS = {"responses": "openai-agents (Responses)", "chat": "openai-agents (chat)"}


def _model(url: str, api: str, max_tokens: int = MAX_TOKENS) -> tuple[object, ModelSettings]:
    client = AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
    model = OpenAIResponsesModel(MODEL, client) if api == "responses" else OpenAIChatCompletionsModel(MODEL, client)
    return model, ModelSettings(temperature=0, max_tokens=max_tokens)


def _agent(url: str, api: str, **kwargs: object) -> Agent:
    model, settings = _model(url, api)
    return Agent(
        name="assistant", instructions="You are a helpful assistant.", model=model, model_settings=settings, **kwargs
    )


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_chat(gateway_url: str, api: str, request: pytest.FixtureRequest) -> None:
    request.applymarker(cell(ROWS[api], "chat"))
    result = Runner.run_sync(_agent(gateway_url, api), CHAT_QUESTION)
    assert_paris(result.final_output)


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_stream(gateway_url: str, api: str, request: pytest.FixtureRequest) -> None:
    request.applymarker(cell(ROWS[api], "stream"))

    async def run() -> list[str]:
        result = Runner.run_streamed(_agent(gateway_url, api), CHAT_QUESTION)
        deltas = [
            event.data.delta async for event in result.stream_events()
            if event.type == "raw_response_event" and isinstance(event.data, ResponseTextDeltaEvent)
        ]  # fmt: skip
        assert result.final_output == "".join(deltas)
        return deltas

    deltas = asyncio.run(run())
    assert len(deltas) > 1, deltas
    assert_paris("".join(deltas))


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_tool_loop(gateway_url: str, api: str, request: pytest.FixtureRequest) -> None:
    """The named tool forced (``tool_choice``; the SDK resets it to auto after the call), run, then the answer."""
    request.applymarker(cell(ROWS[api], "tool loop"))
    model, _ = _model(gateway_url, api)
    agent = Agent(
        name="assistant",
        instructions="You are a helpful assistant.",
        model=model,
        tools=[function_tool(get_weather)],
        model_settings=ModelSettings(temperature=0, max_tokens=60, tool_choice="get_weather"),
    )
    result = Runner.run_sync(agent, WEATHER_QUESTION, max_turns=3)
    calls = [item for item in result.new_items if item.type == "tool_call_item"]
    assert len(calls) == 1, result.new_items
    assert_snow(result.final_output)


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_structured_output(gateway_url: str, api: str, request: pytest.FixtureRequest) -> None:
    """``output_type``: a strict JSON schema (``text.format`` on Responses, ``response_format`` on chat)."""
    request.applymarker(cell(ROWS[api], "structured output"))
    result = Runner.run_sync(_agent(gateway_url, api, output_type=City), CITY_QUESTION)
    assert_city(result.final_output)
