"""LlamaIndex: ``OpenAILike`` (its class for OpenAI-compatible servers) pointed at the gateway: chat, ``stream_chat``,
a forced ``chat_with_tools`` whose call is run and answered (LlamaIndex's own tool-calling loop, by hand), and
``structured_predict`` (a forced function call)."""

from __future__ import annotations

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
from llama_index.core.llms import ChatMessage
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from llama_index.llms.openai_like import OpenAILike

ROW = "LlamaIndex (OpenAILike)"


def _llm(url: str, max_tokens: int = MAX_TOKENS) -> OpenAILike:
    return OpenAILike(
        model=MODEL,
        api_base=url + "/v1",
        api_key=API_KEY,
        temperature=0,
        max_tokens=max_tokens,
        max_retries=0,
        timeout=300,
        is_chat_model=True,
        is_function_calling_model=True,
        context_window=8192,
    )


@cell(ROW, "chat")
def test_chat(gateway_url: str) -> None:
    assert_paris(_llm(gateway_url).chat([ChatMessage(role="user", content=CHAT_QUESTION)]).message.content or "")


@cell(ROW, "stream")
def test_stream(gateway_url: str) -> None:
    deltas = [
        chunk.delta
        for chunk in _llm(gateway_url).stream_chat([ChatMessage(role="user", content=CHAT_QUESTION)])
        if chunk.delta
    ]
    assert len(deltas) > 1, deltas
    assert_paris("".join(deltas))


@cell(ROW, "tool loop")
def test_tool_loop(gateway_url: str) -> None:
    llm, weather = _llm(gateway_url, 60), FunctionTool.from_defaults(fn=get_weather)
    history = [ChatMessage(role="user", content=WEATHER_QUESTION)]
    first = llm.chat_with_tools([weather], chat_history=history, tool_required=True)
    (call,) = llm.get_tool_calls_from_response(first, error_on_no_tool_call=True)
    assert call.tool_name == "get_weather", call
    result = weather.call(**call.tool_kwargs)
    history += [
        first.message,
        ChatMessage(
            role="tool", content=str(result), additional_kwargs={"tool_call_id": call.tool_id, "name": call.tool_name}
        ),
    ]
    final = llm.chat_with_tools([weather], chat_history=history)
    assert not llm.get_tool_calls_from_response(final, error_on_no_tool_call=False), final
    assert_snow(final.message.content or "")


@cell(ROW, "structured output")
def test_structured_output(gateway_url: str) -> None:
    assert_city(_llm(gateway_url, 60).structured_predict(City, PromptTemplate(CITY_QUESTION)))
