"""LangGraph: a ``StateGraph`` over ``MessagesState`` whose model node is LangChain's ``ChatOpenAI`` (chat completions,
and ``use_responses_api=True``) or ``ChatAnthropic`` (Messages), with LangGraph's ``ToolNode`` running the tool."""

from __future__ import annotations

from typing import Literal

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
from langchain_anthropic import ChatAnthropic
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

ROWS = {
    "chat": "LangGraph (ChatOpenAI chat)",
    "responses": "LangGraph (ChatOpenAI Responses)",
    "anthropic": "LangGraph (ChatAnthropic)",
}
APIS = list(ROWS)
weather_tool = tool(get_weather)


def _llm(url: str, api: str, max_tokens: int = MAX_TOKENS) -> BaseChatModel:
    if api == "anthropic":
        return ChatAnthropic(
            model=MODEL, base_url=url, api_key=API_KEY, temperature=0, max_tokens=max_tokens, max_retries=0
        )
    return ChatOpenAI(
        model=MODEL,
        base_url=url + "/v1",
        api_key=API_KEY,
        temperature=0,
        max_tokens=max_tokens,
        max_retries=0,
        use_responses_api=api == "responses",
    )


def _chat_graph(llm: BaseChatModel):  # type: ignore[no-untyped-def]
    graph = StateGraph(MessagesState)
    graph.add_node("model", lambda state: {"messages": [llm.invoke(state["messages"])]})
    graph.add_edge(START, "model")
    graph.add_edge("model", END)
    return graph.compile()


@pytest.mark.parametrize("api", APIS)
def test_chat(gateway_url: str, api: str, request: pytest.FixtureRequest) -> None:
    request.applymarker(cell(ROWS[api], "chat"))
    state = _chat_graph(_llm(gateway_url, api)).invoke({"messages": [("user", CHAT_QUESTION)]})
    answer = state["messages"][-1]
    assert isinstance(answer, AIMessage)
    assert_paris(answer.text)


@pytest.mark.parametrize("api", APIS)
def test_stream(gateway_url: str, api: str, request: pytest.FixtureRequest) -> None:
    """``stream_mode="messages"``: the model's tokens as LangGraph relays them."""
    request.applymarker(cell(ROWS[api], "stream"))
    graph = _chat_graph(_llm(gateway_url, api))
    chunks = [
        chunk for chunk, _ in graph.stream({"messages": [("user", CHAT_QUESTION)]}, stream_mode="messages")
        if isinstance(chunk, AIMessageChunk) and chunk.text
    ]  # fmt: skip
    assert len(chunks) > 1, chunks
    assert_paris("".join(chunk.text for chunk in chunks))


@pytest.mark.parametrize("api", APIS)
def test_tool_loop(gateway_url: str, api: str, request: pytest.FixtureRequest) -> None:
    """model (the tool forced on the first turn) -> ToolNode -> model (tools offered, auto) -> END."""
    request.applymarker(cell(ROWS[api], "tool loop"))
    llm = _llm(gateway_url, api, max_tokens=60)
    forced, free = llm.bind_tools([weather_tool], tool_choice="get_weather"), llm.bind_tools([weather_tool])

    def model(state: MessagesState) -> dict[str, list[AIMessage]]:
        first = not any(isinstance(message, ToolMessage) for message in state["messages"])
        return {"messages": [(forced if first else free).invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", model)
    graph.add_node("tools", ToolNode([weather_tool]))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)
    graph.add_edge("tools", "model")
    state = graph.compile().invoke({"messages": [("user", WEATHER_QUESTION)]}, {"recursion_limit": 6})
    results = [message for message in state["messages"] if isinstance(message, ToolMessage)]
    assert len(results) == 1 and "snow" in str(results[0].content).lower(), state["messages"]
    assert_snow(state["messages"][-1].text)


@pytest.mark.parametrize("api", APIS)
def test_structured_output(gateway_url: str, api: str, request: pytest.FixtureRequest) -> None:
    """``with_structured_output(City)`` in a node: a JSON schema on OpenAI, a forced tool on Anthropic (LangChain's
    defaults)."""
    request.applymarker(cell(ROWS[api], "structured output"))
    structured = _llm(gateway_url, api, max_tokens=60).with_structured_output(City)
    graph = StateGraph(MessagesState)
    result: dict[Literal["city"], City] = {}

    def node(state: MessagesState) -> dict[str, list[object]]:
        result["city"] = structured.invoke(state["messages"])  # type: ignore[assignment]
        return {"messages": []}

    graph.add_node("model", node)
    graph.add_edge(START, "model")
    graph.add_edge("model", END)
    graph.compile().invoke({"messages": [("user", CITY_QUESTION)]})
    assert_city(result["city"])
