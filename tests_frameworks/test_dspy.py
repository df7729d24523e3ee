"""DSPy: ``dspy.LM`` pointed at the gateway, declared to DSPy as an OpenAI-compatible server whose models call tools
and hold to JSON schemas (``dspy.lm15.register_provider``). Without that declaration DSPy sends neither ``tools`` nor
``response_format`` to a model its catalogue does not know (``openai/default``): its native function calling and its
JSONAdapter fall back to asking in the prompt, and no server can answer with calls it was not offered
(``test_an_undeclared_model_gets_neither_tools_nor_schemas``). A chat (``Predict``), a stream (``streamify``), a forced
native tool call run and answered, and a typed output (``JSONAdapter``)."""

import asyncio
from collections.abc import Iterator

import dspy
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
)
from dspy.lm15 import (
    AccessPolicy,
    EndpointSupport,
    ModelSupport,
    OpenAIChatCompat,
    ProviderDefinition,
    register_provider,
    unregister_provider,
)
from dspy.streaming import StreamListener, StreamResponse

ROW = "DSPy"
PROVIDER = "sglang-gateway"


@pytest.fixture(scope="module")
def lm(gateway_url: str) -> Iterator[dspy.LM]:
    """The gateway declared as a provider (SGLang's wire spellings), its models stated to call tools and hold to
    schemas."""
    access = AccessPolicy(
        provider=PROVIDER,
        supports=EndpointSupport(complete=True, stream=True, models=True),
        auth_modes=("bearer",),
        base_url=gateway_url + "/v1",
    )
    definition = ProviderDefinition.chat(access, compat=OpenAIChatCompat.preset("sglang"), placeholder_key=API_KEY)
    register_provider(definition, supports=ModelSupport(function_calling=True, response_schema=True), replace=True)
    try:
        yield dspy.LM(
            f"{PROVIDER}/{MODEL}",
            api_base=gateway_url + "/v1",
            api_key=API_KEY,
            temperature=0,
            max_tokens=MAX_TOKENS,
            cache=False,
        )
    finally:
        unregister_provider(PROVIDER)


class WeatherCall(dspy.Signature):
    """Call the tool that answers the question."""

    question: str = dspy.InputField()
    tools: list[dspy.Tool] = dspy.InputField()
    calls: dspy.ToolCalls = dspy.OutputField()


class WeatherAnswer(dspy.Signature):
    """Answer the question from the weather report."""

    question: str = dspy.InputField()
    weather: str = dspy.InputField()
    answer: str = dspy.OutputField()


class CityAnswer(dspy.Signature):
    question: str = dspy.InputField()
    city: City = dspy.OutputField()


def test_an_undeclared_model_gets_neither_tools_nor_schemas(gateway_url: str) -> None:
    """Why DSPy's native function calling returned no calls and its JSONAdapter got prose through a gateway: for a
    model its catalogue does not know, DSPy drops the fields, before any request."""
    plain = dspy.LM(f"openai/{MODEL}", api_base=gateway_url + "/v1", api_key=API_KEY)
    assert not plain.supports_function_calling and not plain.supports_response_schema
    assert not {"tools", "tool_choice", "response_format"} & plain.supported_params


@cell(ROW, "chat")
def test_chat(lm: dspy.LM) -> None:
    with dspy.context(lm=lm):
        assert_paris(dspy.Predict("question -> answer")(question=CHAT_QUESTION).answer)


@cell(ROW, "stream")
def test_stream(lm: dspy.LM) -> None:
    program = dspy.streamify(
        dspy.Predict("question -> answer"), stream_listeners=[StreamListener(signature_field_name="answer")]
    )

    async def run() -> list[str]:
        with dspy.context(lm=lm, adapter=dspy.JSONAdapter()):  # ChatAdapter's field markers are beyond the model
            return [chunk.chunk async for chunk in program(question=CHAT_QUESTION) if isinstance(chunk, StreamResponse)]

    deltas = asyncio.run(run())
    assert len(deltas) > 1, deltas
    assert_paris("".join(deltas))


@cell(ROW, "tool loop")
def test_tool_loop(lm: dspy.LM) -> None:
    """Native function calling (``tools`` sent, the call read back as ``ToolCalls``), the tool forced by the
    request's ``tool_choice``, run, and answered from its result."""
    weather = dspy.Tool(get_weather)
    forced = {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    with dspy.context(lm=lm, adapter=dspy.ChatAdapter(use_native_function_calling=True)):
        call = dspy.Predict(WeatherCall)(question=WEATHER_QUESTION, tools=[weather], config=forced)
        assert call.calls is not None and [c.name for c in call.calls.tool_calls] == ["get_weather"], call
        report = call.calls.tool_calls[0].execute(functions=[weather])
        answer = dspy.Predict(WeatherAnswer)(question=WEATHER_QUESTION, weather=str(report)).answer
    assert_snow(answer)


@cell(ROW, "structured output")
def test_structured_output(lm: dspy.LM) -> None:
    """JSONAdapter: a strict ``response_format`` JSON schema of the signature's outputs."""
    with dspy.context(lm=lm, adapter=dspy.JSONAdapter()):
        assert_city(dspy.Predict(CityAnswer)(question=CITY_QUESTION, config={"max_tokens": 60}).city)
