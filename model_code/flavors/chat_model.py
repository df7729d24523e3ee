"""The ``chat_model`` flavour: the SGLang engine as an MLflow ``ChatModel`` (OpenAI chat schema, chat endpoints).

Parameters are the ``ChatParams`` fields at the top level, plus ``custom_inputs`` for what ``ChatParams`` lacks
(``response_format``, ``json_schema``, SGLang extras). ``ChatModel`` is deprecated in MLflow 3 in favour of
``ResponsesAgent``, but it is the closest to the OpenAI chat API.

This module is also the flavour's models-from-code file: log it with
``model_code.log_model(config, flavor="chat_model")``; run by MLflow it sets the model, imported it only
defines the flavour.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from mlflow.entities import SpanType
from mlflow.models import set_model
from mlflow.pyfunc import ChatModel
from mlflow.types.llm import (
    ChatChoice,
    ChatChoiceDelta,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatMessage,
    ChatParams,
    FunctionToolCallArguments,
    TokenUsageStats,
    ToolCall,
)

from model_code.client import usage_dict
from model_code.flavors.common import EngineBacked, ToolCallAccumulator, cc_messages, last_usage, tool_calls_of
from model_code.flavors.spec import QUESTION, FlavorSpec, executed_by_mlflow
from model_code.tracing import Usage, traced_call, traced_stream

SPEC = FlavorSpec(
    "chat_model", Path(__file__).resolve(), "ChatModel", {"messages": QUESTION, "temperature": 0.1, "max_tokens": 50}
)

_CHAT_PARAMS_FIELDS = (
    "temperature",
    "max_tokens",
    "stop",
    "n",
    "top_p",
    "top_k",
    "frequency_penalty",
    "presence_penalty",
)


def chat_model_params(params: Any) -> dict[str, Any]:
    """ChatModel: the ``ChatParams`` fields, ``tools``, then ``custom_inputs`` (which win)."""
    if params is None:
        return {}
    out: dict[str, Any] = {}
    for field in _CHAT_PARAMS_FIELDS:
        value = getattr(params, field, None)
        if value is not None:
            out[field] = value
    if out.get("n") == 1:
        out.pop("n")
    tools = getattr(params, "tools", None)
    if tools:
        out["tools"] = [tool.to_dict() if hasattr(tool, "to_dict") else dict(tool) for tool in tools]
    out.update(getattr(params, "custom_inputs", None) or {})
    return out


def _llm_tool_calls(calls: list[dict[str, Any]]) -> list[ToolCall] | None:
    if not calls:
        return None
    return [
        ToolCall(
            id=c["id"],
            function=FunctionToolCallArguments(name=c["function"]["name"], arguments=c["function"]["arguments"]),
        )
        for c in calls
    ]


def completion_to_chat_model(response: Any) -> ChatCompletionResponse:
    choices = []
    for choice in response.choices:
        calls = _llm_tool_calls(tool_calls_of(choice.message))
        content = choice.message.content
        choices.append(
            ChatChoice(
                index=choice.index,
                message=ChatMessage(
                    role="assistant", content=content if content is not None or calls else "", tool_calls=calls
                ),
                finish_reason=choice.finish_reason or "stop",
            )
        )
    usage = usage_dict(response.usage)
    return ChatCompletionResponse(
        choices=choices,
        usage=TokenUsageStats(**usage) if usage else None,
        id=response.id,
        model=response.model,
        created=response.created,
    )


def stream_to_chat_model(chunks: Iterable[Any]) -> Iterator[ChatCompletionChunk]:
    """ChatModel chunks: every one has ``choices[0].delta.content`` (a string); usage comes with the last one.

    The engine ends with a usage-only chunk (no choices): its usage goes on the finish chunk, which is
    held until then. Tool-call fragments are joined and sent whole with their finish reason.
    """
    tools: dict[int, ToolCallAccumulator] = {}
    finals: list[ChatCompletionChunk] = []
    for chunk in chunks:
        usage = usage_dict(chunk.usage)
        choices = []
        for choice in chunk.choices:
            if choice.delta.tool_calls:
                tools.setdefault(choice.index, ToolCallAccumulator()).add(choice.delta.tool_calls)
            calls = (
                _llm_tool_calls(tools.pop(choice.index).result())
                if choice.finish_reason and choice.index in tools
                else None
            )
            if not choice.delta.content and not choice.finish_reason and not calls:
                continue  # an empty delta, or a tool-call fragment
            choices.append(
                ChatChunkChoice(
                    index=choice.index,
                    delta=ChatChoiceDelta(role="assistant", content=choice.delta.content or "", tool_calls=calls),
                    finish_reason=choice.finish_reason,
                )
            )
        if usage and not choices:
            if not finals:  # usage without a finish chunk before it: give it an empty delta
                finals.append(_chat_model_chunk(chunk, [_empty_choice()], None))
            finals[-1].usage = TokenUsageStats(**usage)
            continue
        if not choices:
            continue
        out = _chat_model_chunk(chunk, choices, usage)
        if any(choice.finish_reason for choice in choices):
            finals.append(out)
        else:
            yield out
    yield from finals


def _chat_model_chunk(chunk: Any, choices: list[ChatChunkChoice], usage: Usage | None) -> ChatCompletionChunk:
    return ChatCompletionChunk(
        choices=choices,
        usage=TokenUsageStats(**usage) if usage else None,
        id=chunk.id,
        model=chunk.model,
        created=chunk.created,
    )


def _empty_choice() -> ChatChunkChoice:
    return ChatChunkChoice(index=0, delta=ChatChoiceDelta(role="assistant", content=""), finish_reason=None)


def reduce_chat_model_chunks(chunks: list[Any]) -> dict[str, Any]:
    """Trace output of a ChatModel stream: joined content per choice, finish reasons and usage."""
    contents: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage = None
    for chunk in chunks:
        data = chunk.to_dict() if hasattr(chunk, "to_dict") else chunk
        for choice in data.get("choices", []):
            index = choice.get("index", 0)
            contents[index] = contents.get(index, "") + (choice.get("delta", {}).get("content") or "")
            if choice.get("finish_reason"):
                finishes[index] = choice["finish_reason"]
        usage = data.get("usage") or usage
    return {
        "choices": [
            {"index": i, "message": {"role": "assistant", "content": contents[i]}, "finish_reason": finishes.get(i)}
            for i in sorted(contents)
        ],
        "usage": usage,
    }


class SGLangChatModel(EngineBacked, ChatModel):
    """ChatModel over SGLang: ``ChatParams`` fields, plus ``custom_inputs`` for ``response_format`` / ``json_schema`` / extras."""

    def predict(self, context: Any, messages: list[ChatMessage], params: ChatParams) -> ChatCompletionResponse:
        def call() -> ChatCompletionResponse:
            return completion_to_chat_model(self._engine().chat(cc_messages(messages), chat_model_params(params)))

        inputs = {"messages": messages, "params": params}
        return traced_call(
            self.tracing,
            "SGLangChatModel.predict",
            SpanType.CHAT_MODEL,
            inputs,
            call,
            lambda out: usage_dict(out.usage),
        )

    def predict_stream(
        self, context: Any, messages: list[ChatMessage], params: ChatParams
    ) -> Iterator[ChatCompletionChunk]:
        def chunks() -> Iterator[ChatCompletionChunk]:
            yield from stream_to_chat_model(self._engine().stream(cc_messages(messages), chat_model_params(params)))

        inputs = {"messages": messages, "params": params}
        yield from traced_stream(
            self.tracing,
            "SGLangChatModel.predict_stream",
            SpanType.CHAT_MODEL,
            inputs,
            chunks(),
            reduce_chat_model_chunks,
            last_usage,
        )


if executed_by_mlflow(__package__):  # the models-from-code entry (see executed_by_mlflow)
    set_model(SGLangChatModel())
