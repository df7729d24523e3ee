"""What every framework's four cases ask of the default model, the same for all: a chat, a stream, a forced tool
loop to its final answer, and a structured output. Greedy and short (135M parameters on 2 CPU cores).

A case that fails for the model's sake is marked :func:`model_limited`, with the reason; one that fails for a gateway
change still to land is marked :func:`gateway_pending`. Both are non-strict xfails: a case that starts passing shows
as XPASS (counted as a pass in the matrix), and a case that fails unmarked fails the run."""

from typing import Literal

import pytest
from pydantic import BaseModel

MODEL = "default"
API_KEY = "unused"  # the default deployment has no client keys; every SDK insists on one
MAX_TOKENS = 40
CHAT_QUESTION = "What is the capital of France? Answer in one sentence."
WEATHER_QUESTION = "What's the weather like in Paris today?"
FORECAST = "Heavy snow, minus 12 degrees."
CITY_QUESTION = "Paris is the capital of France. Give the city and its country as JSON."

CAPABILITIES = ("chat", "stream", "tool loop", "structured output")
MODEL_LIMITED = "model-limited: "
GATEWAY_PENDING = "gateway (pending): "


def get_weather(city: Literal["Paris", "Tokyo", "Lima"]) -> str:
    """Get the current weather in a city."""
    return FORECAST if city == "Paris" else "Sunny."


class City(BaseModel):
    """A city and the country it is in."""

    name: str
    country: str


def cell(framework: str, capability: str) -> pytest.MarkDecorator:
    """The matrix cell a test fills (its row: the framework and API; its column: one of CAPABILITIES)."""
    assert capability in CAPABILITIES, capability
    return pytest.mark.matrix(framework, capability)


def model_limited(reason: str) -> pytest.MarkDecorator:
    """A case the 135M default model fails on its own (what it writes), not the gateway: kept, and counted."""
    return pytest.mark.xfail(strict=False, reason=MODEL_LIMITED + reason)


def gateway_pending(reason: str) -> pytest.MarkDecorator:
    """A case that fails for the gateway's sake until a change under way lands: it turns green (XPASS) then."""
    return pytest.mark.xfail(strict=False, reason=GATEWAY_PENDING + reason)


def assert_paris(text: str) -> None:
    assert "paris" in text.lower(), text


def assert_snow(text: str) -> None:
    """The final answer came from the tool's result (the model cannot know the forecast otherwise)."""
    assert "snow" in text.lower(), text


def assert_city(city: City) -> None:
    assert isinstance(city, City) and city.name.strip().lower() == "paris", city
