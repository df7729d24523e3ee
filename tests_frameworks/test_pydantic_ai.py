"""pydantic-ai: ``Agent`` on ``OpenAIChatModel`` and ``OpenAIResponsesModel`` with an ``OpenAIProvider`` pointed at the
gateway (it validates every chat completion with the SDK's ``ChatCompletion.model_validate``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import pytest
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
    model_limited,
)
from pydantic_ai import Agent, RunContext
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import ToolCallPart
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings


@dataclass
class ForceToolFirst(AbstractCapability[None]):
    """The weather tool forced on the run's first request only (pydantic-ai refuses a static forced choice, which
    would never let the agent answer): the per-step settings its docs prescribe."""

    def get_model_settings(self) -> Callable[[RunContext[None]], ModelSettings]:
        return lambda ctx: ModelSettings(tool_choice=["get_weather"]) if ctx.run_step <= 1 else ModelSettings()


ROWS = {"chat": "pydantic-ai (chat)", "responses": "pydantic-ai (Responses)"}


def _model(url: str, api: str) -> OpenAIChatModel | OpenAIResponsesModel:
    provider = OpenAIProvider(base_url=url + "/v1", api_key=API_KEY)
    return (
        OpenAIChatModel(MODEL, provider=provider) if api == "chat" else OpenAIResponsesModel(MODEL, provider=provider)
    )


def _settings(max_tokens: int = MAX_TOKENS) -> ModelSettings:
    return ModelSettings(temperature=0, max_tokens=max_tokens)


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_chat(gateway_url: str, api: str, request: pytest.FixtureRequest) -> None:
    request.applymarker(cell(ROWS[api], "chat"))
    result = Agent(_model(gateway_url, api), model_settings=_settings()).run_sync(CHAT_QUESTION)
    assert_paris(result.output)


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_stream(gateway_url: str, api: str, request: pytest.FixtureRequest) -> None:
    request.applymarker(cell(ROWS[api], "stream"))
    agent = Agent(_model(gateway_url, api), model_settings=_settings())

    async def run() -> list[str]:
        async with agent.run_stream(CHAT_QUESTION) as result:
            return [delta async for delta in result.stream_text(delta=True)]

    deltas = asyncio.run(run())
    assert len(deltas) > 1, deltas
    assert_paris("".join(deltas))


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_tool_loop(gateway_url: str, api: str, request: pytest.FixtureRequest) -> None:
    """The tool forced on the first request (``tool_choice`` in the run's settings), then auto for the answer."""
    request.applymarker(cell(ROWS[api], "tool loop"))
    agent = Agent(
        _model(gateway_url, api), tools=[get_weather], model_settings=_settings(60), capabilities=[ForceToolFirst()]
    )
    result = agent.run_sync(WEATHER_QUESTION)
    calls = [part for message in result.all_messages() for part in message.parts if isinstance(part, ToolCallPart)]
    assert calls and calls[0].tool_name == "get_weather", result.all_messages()
    assert_snow(result.output)


@pytest.mark.parametrize("api", ["chat", "responses"])
@model_limited(
    "the output tool (final_result) is called with arguments of City's schema, but the 135M model writes the tool's "
    "name or the country into the city's name field"
)
def test_structured_output(gateway_url: str, api: str, request: pytest.FixtureRequest) -> None:
    """``output_type=City``: pydantic-ai's default, an output tool the model must call (``tool_choice: required``)."""
    request.applymarker(cell(ROWS[api], "structured output"))
    result = Agent(_model(gateway_url, api), output_type=City, model_settings=_settings(60)).run_sync(CITY_QUESTION)
    assert_city(result.output)
