"""instructor: ``instructor.from_openai`` (chat completions) and ``instructor.from_anthropic`` (Messages): a plain
answer (``response_model=None``), a forced tool call (``Mode.TOOLS`` /
``Mode.ANTHROPIC_TOOLS``: the object as the call's arguments; streamed, the partial objects) and a JSON answer
(``Mode.JSON_SCHEMA``: ``response_format``; ``Mode.ANTHROPIC_JSON``: the schema in the system prompt). instructor has no agent loop: its "tool loop" is the forced call it parses."""

from __future__ import annotations

import instructor
import pytest
from anthropic import Anthropic
from common import (
    API_KEY,
    CHAT_QUESTION,
    CITY_QUESTION,
    MAX_TOKENS,
    MODEL,
    City,
    assert_city,
    assert_paris,
    cell,
    model_limited,
)
from openai import OpenAI

ROWS = {"openai": "instructor (OpenAI)", "anthropic": "instructor (Anthropic)"}
PROMPTED_JSON = (
    "ANTHROPIC_JSON asks for the JSON in the system prompt only (Messages has no response_format to hold it to): "
    "the 135M model writes the schema back instead of an instance"
)
MODES = {
    ("openai", "tools"): instructor.Mode.TOOLS, ("openai", "json"): instructor.Mode.JSON_SCHEMA,
    ("anthropic", "tools"): instructor.Mode.ANTHROPIC_TOOLS, ("anthropic", "json"): instructor.Mode.ANTHROPIC_JSON,
}  # fmt: skip


def _client(url: str, api: str, mode: str = "tools") -> instructor.Instructor:
    if api == "openai":
        return instructor.from_openai(
            OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0), mode=MODES[api, mode]
        )
    return instructor.from_anthropic(Anthropic(base_url=url, api_key=API_KEY, max_retries=0), mode=MODES[api, mode])


def _greedy(api: str) -> dict[str, object]:
    """temperature 0: the anthropic SDK (2.x) no longer takes ``temperature`` as an argument; the API still does."""
    return {"temperature": 0} if api == "openai" else {"extra_body": {"temperature": 0}}


def _ask(
    client: instructor.Instructor, api: str, question: str, response_model: object, max_tokens: int = MAX_TOKENS
) -> object:
    return client.create(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        response_model=response_model,
        max_tokens=max_tokens,
        max_retries=0,
        **_greedy(api),
    )


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_chat(gateway_url: str, api: str, request: pytest.FixtureRequest) -> None:
    request.applymarker(cell(ROWS[api], "chat"))
    answer = _ask(_client(gateway_url, api), api, CHAT_QUESTION, None)
    text = answer.choices[0].message.content if api == "openai" else answer.content[0].text  # type: ignore[attr-defined]
    assert_paris(text)


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_stream(gateway_url: str, api: str, request: pytest.FixtureRequest) -> None:
    """``create_partial`` in tools mode: the object built up from the streamed call's arguments."""
    request.applymarker(cell(ROWS[api], "stream"))
    client = _client(gateway_url, api, "tools")
    partials = list(
        client.create_partial(
            model=MODEL,
            messages=[{"role": "user", "content": CITY_QUESTION}],
            response_model=City,
            max_tokens=60,
            max_retries=0,
            **_greedy(api),
        )
    )
    assert len(partials) > 1, partials
    assert_city(City.model_validate(partials[-1].model_dump()))


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_tool_loop(gateway_url: str, api: str, request: pytest.FixtureRequest) -> None:
    request.applymarker(cell(ROWS[api], "tool loop"))
    assert_city(_ask(_client(gateway_url, api, "tools"), api, CITY_QUESTION, City, max_tokens=60))  # type: ignore[arg-type]


@pytest.mark.parametrize("api", ["openai", pytest.param("anthropic", marks=model_limited(PROMPTED_JSON))])
def test_structured_output(gateway_url: str, api: str, request: pytest.FixtureRequest) -> None:
    request.applymarker(cell(ROWS[api], "structured output"))
    assert_city(_ask(_client(gateway_url, api, "json"), api, CITY_QUESTION, City, max_tokens=60))  # type: ignore[arg-type]
