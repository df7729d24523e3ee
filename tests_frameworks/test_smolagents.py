"""smolagents: ``OpenAIServerModel`` pointed at the gateway, called directly (chat, stream, ``response_format``) and
driving a ``ToolCallingAgent`` (every step a forced call, ``tool_choice: required``, until its ``final_answer`` tool)."""

from __future__ import annotations

from common import (
    API_KEY,
    CHAT_QUESTION,
    CITY_QUESTION,
    FORECAST,
    MAX_TOKENS,
    MODEL,
    WEATHER_QUESTION,
    City,
    assert_city,
    assert_paris,
    assert_snow,
    cell,
    model_limited,
)
from smolagents import ChatMessage, OpenAIServerModel, ToolCallingAgent, tool

ROW = "smolagents"


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city.

    Args:
        city: The city: Paris, Tokyo or Lima.
    """
    return FORECAST if city == "Paris" else "Sunny."


def _model(url: str, max_tokens: int = MAX_TOKENS) -> OpenAIServerModel:
    return OpenAIServerModel(
        model_id=MODEL,
        api_base=url + "/v1",
        api_key=API_KEY,
        temperature=0,
        max_tokens=max_tokens,
        client_kwargs={"max_retries": 0},
    )


def _user(text: str) -> list[ChatMessage]:
    return [ChatMessage(role="user", content=[{"type": "text", "text": text}])]


@cell(ROW, "chat")
def test_chat(gateway_url: str) -> None:
    assert_paris(_model(gateway_url).generate(_user(CHAT_QUESTION)).content)


@cell(ROW, "stream")
def test_stream(gateway_url: str) -> None:
    deltas = [delta.content for delta in _model(gateway_url).generate_stream(_user(CHAT_QUESTION)) if delta.content]
    assert len(deltas) > 1, deltas
    assert_paris("".join(deltas))


@cell(ROW, "tool loop")
@model_limited(
    "ToolCallingAgent forces a call to some tool (tool_choice: required, its final_answer tool among them); "
    "the 135M model calls final_answer at once, never the weather tool"
)
def test_tool_loop(gateway_url: str) -> None:
    agent = ToolCallingAgent(tools=[get_weather], model=_model(gateway_url, 60), max_steps=3, verbosity_level=0)
    answer = agent.run(WEATHER_QUESTION)
    calls = [call.name for step in agent.memory.steps for call in (getattr(step, "tool_calls", None) or [])]
    assert calls[:1] == ["get_weather"], calls
    assert_snow(str(answer))


@cell(ROW, "structured output")
def test_structured_output(gateway_url: str) -> None:
    schema = {
        "type": "json_schema",
        "json_schema": {"name": "City", "schema": City.model_json_schema(), "strict": True},
    }
    answer = _model(gateway_url, 60).generate(_user(CITY_QUESTION), response_format=schema)
    assert_city(City.model_validate_json(answer.content))
