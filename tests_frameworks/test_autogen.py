"""AutoGen: ``OpenAIChatCompletionClient`` (autogen-ext) pointed at the gateway, with the ``model_info`` a model
OpenAI's catalogue does not know needs: ``create``, ``create_stream``, a forced ``FunctionTool`` call run and answered
(the loop AutoGen's agents run), and ``json_output=City`` (a strict ``response_format``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from autogen_core import CancellationToken, FunctionCall
from autogen_core.models import (
    AssistantMessage,
    CreateResult,
    FunctionExecutionResult,
    FunctionExecutionResultMessage,
    ModelInfo,
    UserMessage,
)
from autogen_core.tools import FunctionTool
from autogen_ext.models.openai import OpenAIChatCompletionClient
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

ROW = "AutoGen"
INFO = ModelInfo(vision=False, function_calling=True, json_output=True, structured_output=True, family="unknown")
T = TypeVar("T")


def _run(url: str, body: Callable[[OpenAIChatCompletionClient], Awaitable[T]], max_tokens: int = MAX_TOKENS) -> T:
    async def run() -> T:
        client = OpenAIChatCompletionClient(
            model=MODEL,
            base_url=url + "/v1",
            api_key=API_KEY,
            model_info=INFO,
            temperature=0,
            max_tokens=max_tokens,
            max_retries=0,
        )
        try:
            return await body(client)
        finally:
            await client.close()

    return asyncio.run(run())


@cell(ROW, "chat")
def test_chat(gateway_url: str) -> None:
    async def body(client: OpenAIChatCompletionClient) -> CreateResult:
        return await client.create([UserMessage(content=CHAT_QUESTION, source="user")])

    result = _run(gateway_url, body)
    assert isinstance(result.content, str)
    assert_paris(result.content)


@cell(ROW, "stream")
def test_stream(gateway_url: str) -> None:
    async def body(client: OpenAIChatCompletionClient) -> list[str | CreateResult]:
        return [item async for item in client.create_stream([UserMessage(content=CHAT_QUESTION, source="user")])]

    items = _run(gateway_url, body)
    deltas = [item for item in items if isinstance(item, str)]
    assert len(deltas) > 1 and isinstance(items[-1], CreateResult), items
    assert_paris("".join(deltas))


@cell(ROW, "tool loop")
def test_tool_loop(gateway_url: str) -> None:
    weather = FunctionTool(get_weather, description="Get the current weather in a city.")

    async def body(client: OpenAIChatCompletionClient) -> str:
        history = [UserMessage(content=WEATHER_QUESTION, source="user")]
        first = await client.create(history, tools=[weather], tool_choice=weather)
        assert isinstance(first.content, list) and len(first.content) == 1, first
        call: FunctionCall = first.content[0]
        assert call.name == "get_weather", call
        output = await weather.run_json(
            weather.args_type().model_validate_json(call.arguments).model_dump(), CancellationToken()
        )
        result = FunctionExecutionResult(
            content=weather.return_value_as_string(output), call_id=call.id, name=call.name, is_error=False
        )
        history += [
            AssistantMessage(content=first.content, source="assistant"),
            FunctionExecutionResultMessage(content=[result]),
        ]
        final = await client.create(history, tools=[weather])
        assert isinstance(final.content, str), final
        return final.content

    assert_snow(_run(gateway_url, body, 60))


@cell(ROW, "structured output")
def test_structured_output(gateway_url: str) -> None:
    async def body(client: OpenAIChatCompletionClient) -> CreateResult:
        return await client.create([UserMessage(content=CITY_QUESTION, source="user")], json_output=City)

    result = _run(gateway_url, body, 60)
    assert isinstance(result.content, str)
    assert_city(City.model_validate_json(result.content))
