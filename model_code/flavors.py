"""The three MLflow chat interfaces over one SGLang engine, and the conversions they need.

The models-from-code files (``chat_agent.py``, ``chat_model.py``, ``responses_agent.py``) only
instantiate these classes and call ``set_model``. Each class:

- starts the engine (or connects to a URL) in ``load_context`` from ``context.model_config`` and the
  weights in ``context.artifacts`` (nothing is started while MLflow logs the model);
- maps its interface's parameters to the engine request (:mod:`model_code.params`);
- converts engine completions / chunks to its interface's types (role ``assistant``, the final
  ``finish_reason``, usage, tool calls);
- produces one MLflow trace per ``predict`` / ``predict_stream`` with inputs, outputs and usage;
- has ``close()`` (stops the engine it started) and ``batch(...)`` (see :mod:`model_code.batch`).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import mlflow
from mlflow.entities import SpanType
from mlflow.pyfunc import ChatAgent, ChatModel, ResponsesAgent
from mlflow.types.agent import ChatAgentChunk, ChatAgentMessage, ChatAgentResponse, ChatContext
from mlflow.types.chat import ChatUsage
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
from mlflow.types.responses import (
    ResponsesAgentRequest,
    ResponsesAgentResponse,
    ResponsesAgentStreamEvent,
    create_function_call_item,
    create_text_delta,
    create_text_output_item,
    to_chat_completions_input,
)

from model_code.engine_client import EngineClient, LogTimeClient, usage_dict
from model_code.errors import BadRequestError, EngineUnavailableError
from model_code.params import chat_agent_params, chat_model_params, responses_params

_CC_MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")


# ------------------------------------------------------------------------------------------ helpers
class ToolCallAccumulator:
    """Joins streamed tool-call deltas (by index) into complete calls."""

    def __init__(self) -> None:
        self._calls: dict[int, dict[str, Any]] = {}

    def add(self, deltas: Iterable[Any]) -> None:
        for delta in deltas:
            call = self._calls.setdefault(
                delta.index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            )
            if delta.id:
                call["id"] = delta.id
            if delta.function is not None:
                if delta.function.name:
                    call["function"]["name"] += delta.function.name
                if delta.function.arguments:
                    call["function"]["arguments"] += delta.function.arguments

    def result(self) -> list[dict[str, Any]]:
        calls = []
        for index in sorted(self._calls):
            call = self._calls[index]
            calls.append({**call, "id": call["id"] or f"call_{uuid.uuid4().hex[:24]}"})
        return calls

    def __bool__(self) -> bool:
        return bool(self._calls)


def _tool_calls(message: Any) -> list[dict[str, Any]]:
    return [
        {
            "id": call.id,
            "type": "function",
            "function": {"name": call.function.name, "arguments": call.function.arguments},
        }
        for call in (getattr(message, "tool_calls", None) or [])
    ]


def _cc_messages(messages: Iterable[Any]) -> list[dict[str, Any]]:
    out = []
    for message in messages:
        data = (
            message.model_dump(exclude_none=True)
            if hasattr(message, "model_dump")
            else (message.to_dict() if hasattr(message, "to_dict") else dict(message))
        )
        out.append({k: data[k] for k in _CC_MESSAGE_KEYS if k in data})
    if not out:
        raise BadRequestError("no messages")
    return out


def _single_choice(params: Mapping[str, Any], interface: str) -> None:
    if params.get("n", 1) not in (None, 1):
        raise BadRequestError(f"{interface}: n > 1 is not supported here (use the ChatModel flavour)")


class _EngineBacked:
    """Engine client life cycle shared by the three flavours."""

    client: EngineClient | LogTimeClient | None = None

    def load_context(self, context: Any) -> None:
        self.client = EngineClient.from_model_config(context.model_config, context.artifacts)

    def _engine(self) -> EngineClient | LogTimeClient:
        if self.client is None:
            raise EngineUnavailableError(
                "the model has no engine: load it with mlflow.pyfunc.load_model (load_context was not called)"
            )
        return self.client

    @property
    def engine_process(self) -> Any:
        """The :class:`launch.process.EngineProcess` this model started, or None (URL mode, log time)."""
        return getattr(self.client, "engine", None)

    def close(self) -> None:
        """Stop the engine this model started (if any). Idempotent."""
        if self.client is not None:
            self.client.close()

    def batch(self, prompts: Any, **kwargs: Any) -> Any:
        """Many prompts at once, concurrently, results in input order: see :func:`model_code.batch.batch_predict`."""
        from model_code.batch import batch_predict

        return batch_predict(self, prompts, **kwargs)


# ------------------------------------------------------------------------------------------ ChatAgent
def completion_to_chat_agent(response: Any) -> ChatAgentResponse:
    messages = []
    for choice in response.choices:
        calls = _tool_calls(choice.message)
        content = choice.message.content
        message_id = response.id if len(response.choices) == 1 else f"{response.id}-{choice.index}"
        messages.append(
            ChatAgentMessage(
                role="assistant",
                content=content if content is not None or calls else "",
                tool_calls=calls or None,
                id=message_id or str(uuid.uuid4()),
            )
        )
    usage = usage_dict(response.usage)
    return ChatAgentResponse(
        messages=messages,
        finish_reason=response.choices[0].finish_reason if response.choices else None,
        usage=ChatUsage(**usage) if usage else None,
    )


def stream_to_chat_agent(chunks: Iterable[Any]) -> Iterator[ChatAgentChunk]:
    message_id: str | None = None
    tools = ToolCallAccumulator()
    for chunk in chunks:
        message_id = message_id or chunk.id or str(uuid.uuid4())
        usage = usage_dict(chunk.usage)
        usage_model = ChatUsage(**usage) if usage else None
        if not chunk.choices:
            if usage_model:
                yield ChatAgentChunk(
                    delta=ChatAgentMessage(role="assistant", content="", id=message_id), usage=usage_model
                )
            continue
        choice = chunk.choices[0]
        if choice.delta.tool_calls:
            tools.add(choice.delta.tool_calls)
        text = choice.delta.content
        if choice.finish_reason:
            calls = tools.result() or None
            yield ChatAgentChunk(
                delta=ChatAgentMessage(
                    role="assistant", content=text or (None if calls else ""), tool_calls=calls, id=message_id
                ),
                finish_reason=choice.finish_reason,
                usage=usage_model,
            )
        elif text or usage_model:
            yield ChatAgentChunk(
                delta=ChatAgentMessage(role="assistant", content=text or "", id=message_id), usage=usage_model
            )


def reduce_chat_agent_chunks(chunks: list[Any]) -> dict[str, Any]:
    """Trace output of a ChatAgent stream: the joined message, finish reason and usage."""
    content, finish, usage, calls = "", None, None, None
    for chunk in chunks:
        data = chunk.model_dump(exclude_none=True) if hasattr(chunk, "model_dump") else chunk
        content += data.get("delta", {}).get("content") or ""
        calls = data.get("delta", {}).get("tool_calls") or calls
        finish = data.get("finish_reason") or finish
        usage = data.get("usage") or usage
    message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
    return {"messages": [message], "finish_reason": finish, "usage": usage}


class SGLangChatAgent(_EngineBacked, ChatAgent):
    """ChatAgent over SGLang: generation parameters (incl. ``response_format`` / ``json_schema``) in ``custom_inputs``."""

    @mlflow.trace(name="SGLangChatAgent.predict", span_type=SpanType.AGENT)
    def predict(
        self,
        messages: list[ChatAgentMessage],
        context: ChatContext | None = None,
        custom_inputs: dict[str, Any] | None = None,
    ) -> ChatAgentResponse:
        params = chat_agent_params(custom_inputs)
        return completion_to_chat_agent(self._engine().chat(_cc_messages(messages), params))

    @mlflow.trace(
        name="SGLangChatAgent.predict_stream", span_type=SpanType.AGENT, output_reducer=reduce_chat_agent_chunks
    )
    def predict_stream(
        self,
        messages: list[ChatAgentMessage],
        context: ChatContext | None = None,
        custom_inputs: dict[str, Any] | None = None,
    ) -> Iterator[ChatAgentChunk]:
        params = chat_agent_params(custom_inputs)
        _single_choice(params, "ChatAgent.predict_stream")
        yield from stream_to_chat_agent(self._engine().stream(_cc_messages(messages), params))


# ------------------------------------------------------------------------------------------ ChatModel
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
        calls = _llm_tool_calls(_tool_calls(choice.message))
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
    tools: dict[int, ToolCallAccumulator] = {}
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
            if choice.delta.content is None and not choice.finish_reason and not calls:
                continue  # a tool-call fragment: emitted whole with the finish reason
            choices.append(
                ChatChunkChoice(
                    index=choice.index,
                    delta=ChatChoiceDelta(role="assistant", content=choice.delta.content, tool_calls=calls),
                    finish_reason=choice.finish_reason,
                )
            )
        if choices or usage:
            yield ChatCompletionChunk(
                choices=choices,
                usage=TokenUsageStats(**usage) if usage else None,
                id=chunk.id,
                model=chunk.model,
                created=chunk.created,
            )


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


class SGLangChatModel(_EngineBacked, ChatModel):
    """ChatModel over SGLang: ``ChatParams`` fields, plus ``custom_inputs`` for ``response_format`` / ``json_schema`` / extras."""

    @mlflow.trace(name="SGLangChatModel.predict", span_type=SpanType.CHAT_MODEL)
    def predict(self, context: Any, messages: list[ChatMessage], params: ChatParams) -> ChatCompletionResponse:
        return completion_to_chat_model(self._engine().chat(_cc_messages(messages), chat_model_params(params)))

    @mlflow.trace(
        name="SGLangChatModel.predict_stream", span_type=SpanType.CHAT_MODEL, output_reducer=reduce_chat_model_chunks
    )
    def predict_stream(
        self, context: Any, messages: list[ChatMessage], params: ChatParams
    ) -> Iterator[ChatCompletionChunk]:
        yield from stream_to_chat_model(self._engine().stream(_cc_messages(messages), chat_model_params(params)))


# ------------------------------------------------------------------------------------------ ResponsesAgent
def _responses_usage(usage: Mapping[str, int] | None) -> dict[str, Any] | None:
    if not usage:
        return None
    return {
        "input_tokens": usage.get("prompt_tokens", 0),
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": usage.get("completion_tokens", 0),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.get("total_tokens", 0),
    }


def _status(finish_reason: str | None) -> dict[str, Any]:
    if finish_reason == "length":
        return {"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}}
    return {"status": "completed"}


def _responses_output(item_id: str, text: str | None, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    output = []
    if text or not calls:
        output.append(create_text_output_item(text or "", item_id))
    for call in calls:
        output.append(
            create_function_call_item(
                id=call["id"],
                call_id=call["id"],
                name=call["function"]["name"],
                arguments=call["function"]["arguments"],
            )
        )
    return output


def completion_to_responses(response: Any) -> ResponsesAgentResponse:
    choice = response.choices[0]
    item_id = response.id or str(uuid.uuid4())
    return ResponsesAgentResponse(
        id=item_id,
        model=response.model,
        output=_responses_output(item_id, choice.message.content, _tool_calls(choice.message)),
        usage=_responses_usage(usage_dict(response.usage)),
        custom_outputs={"finish_reason": choice.finish_reason},
        **_status(choice.finish_reason),
    )


def stream_to_responses(chunks: Iterable[Any]) -> Iterator[ResponsesAgentStreamEvent]:
    item_id: str | None = None
    model = None
    text = ""
    tools = ToolCallAccumulator()
    finish: str | None = None
    usage: dict[str, int] | None = None
    for chunk in chunks:
        item_id = item_id or chunk.id or str(uuid.uuid4())
        model = model or chunk.model
        usage = usage_dict(chunk.usage) or usage
        for choice in chunk.choices[:1]:
            if choice.delta.content:
                text += choice.delta.content
                yield ResponsesAgentStreamEvent(**create_text_delta(choice.delta.content, item_id))
            if choice.delta.tool_calls:
                tools.add(choice.delta.tool_calls)
            finish = choice.finish_reason or finish
    item_id = item_id or str(uuid.uuid4())
    output = _responses_output(item_id, text, tools.result())
    for item in output:
        yield ResponsesAgentStreamEvent(type="response.output_item.done", item=item)
    response = {"id": item_id, "model": model, "output": output, "usage": _responses_usage(usage), **_status(finish)}
    yield ResponsesAgentStreamEvent(
        type="response.completed",
        response={k: v for k, v in response.items() if v is not None},
        custom_outputs={"finish_reason": finish},
    )


class SGLangResponsesAgent(_EngineBacked, ResponsesAgent):
    """ResponsesAgent over SGLang: request fields (``text.format`` for JSON schema, tools) and ``custom_inputs``.

    MLflow traces ``predict`` / ``predict_stream`` of ResponsesAgent subclasses itself.
    """

    def predict(self, request: ResponsesAgentRequest) -> ResponsesAgentResponse:
        params = responses_params(request)
        messages = to_chat_completions_input(request.input)
        return completion_to_responses(self._engine().chat(_cc_messages(messages), params))

    def predict_stream(self, request: ResponsesAgentRequest) -> Iterator[ResponsesAgentStreamEvent]:
        params = responses_params(request)
        _single_choice(params, "ResponsesAgent.predict_stream")
        messages = to_chat_completions_input(request.input)
        yield from stream_to_responses(self._engine().stream(_cc_messages(messages), params))
