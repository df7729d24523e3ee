"""The ``chat_agent`` flavour: the SGLang engine as an MLflow ``ChatAgent`` (agent notebooks).

Generation parameters (incl. ``response_format`` / ``json_schema``) go in ``custom_inputs``: MLflow drops
top-level generation fields of a ChatAgent request. Stream chunks each have ``delta.content`` (a string); the
last one has the finish reason and the usage.

This module is also the flavour's models-from-code file: log it with
``model_code.log_model(config, flavor="chat_agent")`` (or give its path as ``python_model=`` to
``mlflow.pyfunc.log_model``); run by MLflow it sets the model, imported it only defines the flavour.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from mlflow.entities import SpanType
from mlflow.models import set_model
from mlflow.pyfunc import ChatAgent
from mlflow.types.agent import ChatAgentChunk, ChatAgentMessage, ChatAgentResponse, ChatContext
from mlflow.types.chat import ChatUsage

from model_code.client import usage_dict
from model_code.flavors.common import (
    EngineBacked,
    ToolCallAccumulator,
    as_dict,
    cc_messages,
    last_usage,
    single_choice,
    tool_calls_of,
)
from model_code.flavors.spec import QUESTION, FlavorSpec, executed_by_mlflow
from model_code.tracing import traced_call, traced_stream

SPEC = FlavorSpec(
    "chat_agent",
    Path(__file__).resolve(),
    "ChatAgent",
    {"messages": QUESTION, "custom_inputs": {"temperature": 0.1, "max_tokens": 50}},
)


def chat_agent_params(custom_inputs: Mapping[str, Any] | None) -> dict[str, Any]:
    """ChatAgent: generation parameters travel in ``custom_inputs``."""
    return dict(custom_inputs or {})


def completion_to_chat_agent(response: Any) -> ChatAgentResponse:
    """A ChatAgent response from an engine completion (a dict, or the openai SDK's model)."""
    response = as_dict(response)
    choices = response.get("choices") or []
    messages = []
    for choice in choices:
        message = choice.get("message") or {}
        calls = tool_calls_of(message)
        content = message.get("content")
        message_id = response.get("id") if len(choices) == 1 else f"{response.get('id')}-{choice.get('index', 0)}"
        messages.append(
            ChatAgentMessage(
                role="assistant",
                content=content if content is not None or calls else "",
                tool_calls=calls or None,
                id=message_id or str(uuid.uuid4()),
            )
        )
    usage = usage_dict(response.get("usage"))
    return ChatAgentResponse(
        messages=messages,
        finish_reason=choices[0].get("finish_reason") if choices else None,
        usage=ChatUsage(**usage) if usage else None,
    )


def stream_to_chat_agent(chunks: Iterable[Any]) -> Iterator[ChatAgentChunk]:
    """ChatAgent chunks: every one has ``delta.content`` (a string); the last one has the finish reason and usage.

    The engine sends usage in a chunk of its own after the finish chunk: the finish chunk waits for it. One
    pass per engine chunk (a dict; the openai SDK's models are dumped first), one ChatAgentChunk built per text.
    """
    message_id: str | None = None
    tools = ToolCallAccumulator()
    final: ChatAgentChunk | None = None
    for chunk in chunks:
        if not isinstance(chunk, dict):
            chunk = as_dict(chunk)
        if message_id is None:
            message_id = chunk.get("id") or str(uuid.uuid4())
        raw_usage = chunk.get("usage")
        usage = usage_dict(raw_usage) if raw_usage else None
        usage_model = ChatUsage(**usage) if usage else None
        choices = chunk.get("choices")
        if not choices:
            if usage_model is not None:
                final = (
                    final.model_copy(update={"usage": usage_model})
                    if final is not None
                    else ChatAgentChunk(
                        delta=ChatAgentMessage(role="assistant", content="", id=message_id), usage=usage_model
                    )
                )
            continue
        choice = choices[0]
        delta = choice.get("delta") or {}
        if delta.get("tool_calls"):
            tools.add(delta["tool_calls"])
        text = delta.get("content")
        finish_reason = choice.get("finish_reason")
        if finish_reason:
            if final is not None:
                yield final
            final = ChatAgentChunk(
                delta=ChatAgentMessage(
                    role="assistant", content=text or "", tool_calls=tools.result() or None, id=message_id
                ),
                finish_reason=finish_reason,
                usage=usage_model,
            )
        elif text:
            yield ChatAgentChunk(
                delta=ChatAgentMessage(role="assistant", content=text, id=message_id), usage=usage_model
            )
    if final is not None:
        yield final


def reduce_chat_agent_chunks(chunks: list[Any]) -> dict[str, Any]:
    """Trace output of a ChatAgent stream: the joined message, finish reason and usage."""
    texts: list[str] = []
    finish, usage, calls = None, None, None
    for chunk in chunks:
        if isinstance(chunk, ChatAgentChunk):  # read, not dumped: one dump per chunk is MLflow's own already
            delta = chunk.delta
            texts.append(delta.content or "")
            calls = delta.tool_calls or calls
            finish = chunk.finish_reason or finish
            usage = chunk.usage or usage
            continue
        texts.append(chunk.get("delta", {}).get("content") or "")
        calls = chunk.get("delta", {}).get("tool_calls") or calls
        finish = chunk.get("finish_reason") or finish
        usage = chunk.get("usage") or usage
    if calls and not isinstance(calls[0], dict):
        calls = [call.model_dump(exclude_none=True) for call in calls]
    if usage is not None and not isinstance(usage, dict):
        usage = usage.model_dump(exclude_none=True)
    message = {"role": "assistant", "content": "".join(texts), **({"tool_calls": calls} if calls else {})}
    return {"messages": [message], "finish_reason": finish, "usage": usage}


class SGLangChatAgent(EngineBacked, ChatAgent):
    """ChatAgent over SGLang: generation parameters (incl. ``response_format`` / ``json_schema``) in ``custom_inputs``."""

    def predict(
        self,
        messages: list[ChatAgentMessage],
        context: ChatContext | None = None,
        custom_inputs: dict[str, Any] | None = None,
    ) -> ChatAgentResponse:
        def call() -> ChatAgentResponse:
            params = chat_agent_params(custom_inputs)
            return completion_to_chat_agent(self._engine().chat_json(cc_messages(messages), params))

        inputs = {"messages": messages, "context": context, "custom_inputs": custom_inputs}
        return traced_call(
            self.tracing, "SGLangChatAgent.predict", SpanType.AGENT, inputs, call, lambda out: usage_dict(out.usage)
        )

    def predict_stream(
        self,
        messages: list[ChatAgentMessage],
        context: ChatContext | None = None,
        custom_inputs: dict[str, Any] | None = None,
    ) -> Iterator[ChatAgentChunk]:
        def chunks() -> Iterator[ChatAgentChunk]:
            params = chat_agent_params(custom_inputs)
            single_choice(params, "ChatAgent.predict_stream")
            yield from stream_to_chat_agent(self._engine().stream_json(cc_messages(messages), params))

        inputs = {"messages": messages, "context": context, "custom_inputs": custom_inputs}
        yield from traced_stream(
            self.tracing,
            "SGLangChatAgent.predict_stream",
            SpanType.AGENT,
            inputs,
            chunks(),
            reduce_chat_agent_chunks,
            last_usage,
        )


if executed_by_mlflow(__package__):  # the models-from-code entry (see executed_by_mlflow)
    set_model(SGLangChatAgent())
