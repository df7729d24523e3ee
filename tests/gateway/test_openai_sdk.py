"""The real ``openai`` SDK against the gateway in front of the real SGLang CPU engine.

Random weights: assertions are about structure, never content; temperature 0 throughout.
"""

from __future__ import annotations

import enum

import openai
import pytest
from pydantic import BaseModel, Field

MESSAGES = [{"role": "user", "content": "Say hello."}]


def test_chat_plain(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
    assert reply.object == "chat.completion"
    assert len(reply.choices) == 1
    assert reply.choices[0].message.role == "assistant"
    assert isinstance(reply.choices[0].message.content, str)
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert reply.usage is not None and reply.usage.completion_tokens <= 8 and reply.usage.prompt_tokens > 0


def test_chat_stream_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    content_chunks = [c for c in chunks if c.choices]
    assert content_chunks, "no content chunks"
    assert content_chunks[-1].choices[0].finish_reason in ("length", "stop")
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1] and not chunks[-1].choices
    assert usage_chunks[0].usage.completion_tokens <= 8
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
    assert text == plain.choices[0].message.content  # greedy: stream and plain agree


class Colour(enum.StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Verdict(BaseModel):
    colour: Colour
    count: int = Field(ge=0, le=99)  # bounded: random weights would otherwise emit endless digits
    ok: bool


def test_chat_json_schema_parse(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model="tiny", messages=MESSAGES, response_format=Verdict, max_tokens=64, temperature=0
    )
    message = completion.choices[0].message
    assert isinstance(message.parsed, Verdict), message.content
    assert isinstance(message.parsed.colour, Colour)
    assert 0 <= message.parsed.count <= 99 and isinstance(message.parsed.ok, bool)


def test_chat_n2_and_logprobs(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, temperature=0, n=2, logprobs=True, top_logprobs=2
    )
    assert [choice.index for choice in reply.choices] == [0, 1]
    for choice in reply.choices:
        assert choice.logprobs is not None and choice.logprobs.content
        for token in choice.logprobs.content:
            assert token.logprob <= 0.0
            assert len(token.top_logprobs) == 2


def test_completions_plain_and_stream(client: openai.OpenAI) -> None:
    plain = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0)
    assert plain.object == "text_completion" and len(plain.choices) == 1
    assert isinstance(plain.choices[0].text, str)
    chunks = list(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0, stream=True))
    assert chunks and all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text


def test_models_list_and_get(client: openai.OpenAI) -> None:
    models = {model.id: model for model in client.models.list()}
    assert set(models) == {"tiny", "default", "second"}
    assert models["tiny"].model_extra["max_model_len"] == 2048  # the tiny model's context length
    assert models["default"].model_extra["parent"] == "tiny"
    assert client.models.retrieve("default").id == "default"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("nope")
    assert caught.value.body["code"] == "model_not_found"


def test_two_names_routed(client: openai.OpenAI) -> None:
    """Each name reaches the engine as its own served name (the engine echoes ``model``)."""
    for asked, served in [("tiny", "tiny"), ("default", "tiny"), ("second", "second")]:
        reply = client.chat.completions.create(model=asked, messages=MESSAGES, max_tokens=2, temperature=0)
        assert reply.model == served


def test_extra_body_passes_through(client: openai.OpenAI) -> None:
    """SGLang-only fields (here ``regex``) reach the engine untouched."""
    reply = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, extra_body={"regex": "(yes|no)"}
    )
    assert reply.choices[0].message.content in ("yes", "no")


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-nope", messages=MESSAGES, max_tokens=2)
    assert caught.value.body["code"] == "model_not_found"
    assert caught.value.body["type"] == "not_found_error"
