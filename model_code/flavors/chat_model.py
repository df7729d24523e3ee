"""The ``chat_model`` flavour: the SGLang engine as an MLflow ``ChatModel`` (OpenAI chat schema, chat endpoints).

Parameters are the ``ChatParams`` fields at the top level, plus ``custom_inputs`` for what ``ChatParams`` lacks
(``response_format``, ``json_schema``, SGLang extras). ``ChatModel`` is deprecated in MLflow 3 in favour of
``ResponsesAgent``, but it is the closest to the OpenAI chat API.

This module is also the flavour's models-from-code file: log it with
``model_code.log_model(config, flavor="chat_model")``; run by MLflow it sets the model, imported it only
defines the flavour.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

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
from model_code.flavors.common import (
    EngineBacked,
    ToolCallAccumulator,
    as_dict,
    cc_messages,
    last_usage,
    tool_calls_of,
)
from model_code.flavors.spec import QUESTION, FlavorSpec, executed_by_mlflow
from model_code.tracing import Usage, traced_call, traced_stream

T = TypeVar("T")

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
    """A ChatModel response from an engine completion (a dict, or the openai SDK's model)."""
    response = as_dict(response)
    choices = []
    for choice in response.get("choices") or []:
        message = choice.get("message") or {}
        calls = _llm_tool_calls(tool_calls_of(message))
        content = message.get("content")
        choices.append(
            ChatChoice(
                index=choice.get("index", 0),
                message=ChatMessage(
                    role="assistant", content=content if content is not None or calls else "", tool_calls=calls
                ),
                finish_reason=choice.get("finish_reason") or "stop",
            )
        )
    usage = usage_dict(response.get("usage"))
    return ChatCompletionResponse(
        choices=choices,
        usage=TokenUsageStats(**usage) if usage else None,
        id=response.get("id"),
        model=response.get("model"),
        created=response.get("created"),
    )


class BuiltChatModelChunk(ChatCompletionChunk):
    """A :class:`ChatCompletionChunk` built from fields this module made itself: its ``to_dict()`` (what MLflow's
    ChatModel wrapper sends for each chunk) is the dict built with it, not a ``dataclasses.asdict`` walk, and
    nothing is validated again (MLflow's dataclasses re-check every nested field in ``__post_init__``)."""

    _data: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return dict(self._data)


def _built_chunk(data: dict[str, Any]) -> BuiltChatModelChunk:
    """The chunk of ``data`` (the wire dict, ``None`` values left out): the dataclass fields hold the dataclass
    objects, built without their checks, so attribute readers see what ``to_dict()`` says."""
    chunk = object.__new__(BuiltChatModelChunk)
    fields = chunk.__dict__
    fields["choices"] = [_built_choice(choice) for choice in data["choices"]]
    usage = data.get("usage")
    fields["usage"] = _built(TokenUsageStats, usage) if usage else None
    fields["id"] = data.get("id")
    fields["model"] = data.get("model")
    fields["object"] = data["object"]
    fields["created"] = data.get("created")
    fields["custom_outputs"] = None
    fields["_data"] = data
    return chunk


def _built(cls: type[T], data: dict[str, Any]) -> T:
    obj = object.__new__(cls)
    obj.__dict__.update({field.name: data.get(field.name) for field in dataclasses.fields(cls)})  # type: ignore[arg-type]
    return obj


def _built_choice(choice: dict[str, Any]) -> ChatChunkChoice:
    delta = dict(choice["delta"])
    calls = delta.get("tool_calls")
    if calls:
        delta["tool_calls"] = [
            _built(ToolCall, {**call, "function": _built(FunctionToolCallArguments, call["function"])}) for call in calls
        ]
    built = _built(ChatChunkChoice, {**choice, "delta": _built(ChatChoiceDelta, delta)})
    return built


def _chunk_dict(chunk: dict[str, Any], choices: list[dict[str, Any]], usage: Usage | None) -> dict[str, Any]:
    """The ChatModel chunk's dict, as ``ChatCompletionChunk(...).to_dict()`` writes it (no ``None`` values)."""
    data: dict[str, Any] = {"choices": choices}
    if usage:
        data["usage"] = dict(usage)
    for key in ("id", "model"):
        if chunk.get(key) is not None:
            data[key] = chunk[key]
    data["object"] = "chat.completion.chunk"
    if chunk.get("created") is not None:
        data["created"] = chunk["created"]
    return data


def _choice_dict(index: int, content: str, finish_reason: str | None, calls: list[dict[str, Any]] | None) -> dict[str, Any]:
    delta: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        delta["tool_calls"] = [
            {"id": call["id"], "type": "function", "function": {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}}
            for call in calls
        ]
    choice: dict[str, Any] = {"delta": delta, "index": index}
    if finish_reason is not None:
        choice["finish_reason"] = finish_reason
    return choice


def stream_to_chat_model(chunks: Iterable[Any]) -> Iterator[ChatCompletionChunk]:
    """ChatModel chunks: every one has ``choices[0].delta.content`` (a string); usage comes with the last one.

    The engine ends with a usage-only chunk (no choices): its usage goes on the finish chunk, which is
    held until then. Tool-call fragments are joined and sent whole with their finish reason. One pass per
    engine chunk (a dict; the openai SDK's models are dumped first); each ChatModel chunk is built once.
    """
    tools: dict[int, ToolCallAccumulator] = {}
    finals: list[dict[str, Any]] = []
    for chunk in chunks:
        if not isinstance(chunk, dict):
            chunk = as_dict(chunk)
        raw_usage = chunk.get("usage")
        usage = usage_dict(raw_usage) if raw_usage else None
        choices = []
        finished = False
        for choice in chunk.get("choices") or ():
            index = choice.get("index", 0)
            delta = choice.get("delta") or {}
            if delta.get("tool_calls"):
                tools.setdefault(index, ToolCallAccumulator()).add(delta["tool_calls"])
            finish_reason = choice.get("finish_reason")
            calls = tools.pop(index).result() if finish_reason and index in tools else None
            content = delta.get("content")
            if not content and not finish_reason and not calls:
                continue  # an empty delta, or a tool-call fragment
            finished = finished or bool(finish_reason)
            choices.append(_choice_dict(index, content or "", finish_reason, calls))
        if usage and not choices:
            if not finals:  # usage without a finish chunk before it: give it an empty delta
                finals.append(_chunk_dict(chunk, [_choice_dict(0, "", None, None)], None))
            finals[-1]["usage"] = dict(usage)
            continue
        if not choices:
            continue
        out = _chunk_dict(chunk, choices, usage)
        if finished:
            finals.append(out)
        else:
            yield _built_chunk(out)
    for final in finals:
        yield _built_chunk(final)


def reduce_chat_model_chunks(chunks: list[Any]) -> dict[str, Any]:
    """Trace output of a ChatModel stream: joined content per choice, finish reasons and usage."""
    contents: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage = None
    for chunk in chunks:
        data = chunk._data if isinstance(chunk, BuiltChatModelChunk) else (chunk.to_dict() if hasattr(chunk, "to_dict") else chunk)
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
            return completion_to_chat_model(self._engine().chat_json(cc_messages(messages), chat_model_params(params)))

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
            yield from stream_to_chat_model(self._engine().stream_json(cc_messages(messages), chat_model_params(params)))

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
