"""The three MLflow chat interfaces over one SGLang engine, and the conversions they need.

The models-from-code files (``chat_agent.py``, ``chat_model.py``, ``responses_agent.py``) only
instantiate these classes and call ``set_model``. Each class:

- starts the engine (or connects to a URL) in ``load_context`` from ``context.model_config`` and the
  weights in ``context.artifacts`` (nothing is started while MLflow logs the model);
- maps its interface's parameters to the engine request (:mod:`model_code.params`);
- converts engine completions / chunks to its interface's types (role ``assistant``, the final
  ``finish_reason``, usage, tool calls);
- yields stream chunks that each have their interface's documented shape, so the usual loop
  (ChatModel ``chunk["choices"][0]["delta"]["content"]``, ChatAgent ``chunk["delta"]["content"]``,
  ResponsesAgent events by ``type``) never breaks; token usage comes with the final chunk / event;
- produces one MLflow trace per ``predict`` / ``predict_stream`` with inputs, outputs and usage,
  recorded after the call (:mod:`model_code.tracing`; ``mlflow.tracing``: on, off or sampled);
- has ``close()`` (stops, or stops using, its engine) and ``batch(...)`` (see :mod:`model_code.batch`).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import pydantic
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

from model_code.client import EngineClient, LogTimeClient, usage_dict
from model_code.errors import BadRequestError, EngineUnavailableError
from model_code.params import chat_agent_params, chat_model_params, responses_params
from model_code.tracing import TracePolicy, Usage, traced_call, traced_stream

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


def _last_usage(chunks: list[Any]) -> Usage | None:
    """Token usage of the last chunk that carries it (ChatAgent / ChatModel streams)."""
    for chunk in reversed(chunks):
        usage = usage_dict(getattr(chunk, "usage", None))
        if usage:
            return usage
    return None


class _EngineBacked:
    """Engine client life cycle and trace policy shared by the three flavours."""

    client: EngineClient | LogTimeClient | None = None
    tracing: TracePolicy = TracePolicy()

    def load_context(self, context: Any) -> None:
        self.client = EngineClient.from_model_config(context.model_config, context.artifacts)
        settings = self.client.settings
        self.tracing = TracePolicy(settings.tracing, settings.trace_sample_ratio)

    def _engine(self) -> EngineClient | LogTimeClient:
        if self.client is None:
            raise EngineUnavailableError(
                "the model has no engine: load it with mlflow.pyfunc.load_model (load_context was not called)"
            )
        return self.client

    @property
    def engine_process(self) -> Any:
        """The engine this model uses (:class:`launch.process.EngineProcess` of this process, or a
        :class:`launch.shared.SharedEngine`; the first replica's for a model with replicas, all of them are
        in ``client.engines``), or None (URL mode, log time)."""
        return getattr(self.client, "engine", None)

    def close(self) -> None:
        """Stop (or stop using) the engine this model holds, if any. Idempotent."""
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
    """ChatAgent chunks: every one has ``delta.content`` (a string); the last one has the finish reason and usage.

    The engine sends usage in a chunk of its own after the finish chunk: the finish chunk waits for it.
    """
    message_id: str | None = None
    tools = ToolCallAccumulator()
    final: ChatAgentChunk | None = None
    for chunk in chunks:
        message_id = message_id or chunk.id or str(uuid.uuid4())
        usage = usage_dict(chunk.usage)
        usage_model = ChatUsage(**usage) if usage else None
        if not chunk.choices:
            if usage_model is not None:
                final = (
                    final.model_copy(update={"usage": usage_model})
                    if final is not None
                    else ChatAgentChunk(
                        delta=ChatAgentMessage(role="assistant", content="", id=message_id), usage=usage_model
                    )
                )
            continue
        choice = chunk.choices[0]
        if choice.delta.tool_calls:
            tools.add(choice.delta.tool_calls)
        text = choice.delta.content
        if choice.finish_reason:
            if final is not None:
                yield final
            final = ChatAgentChunk(
                delta=ChatAgentMessage(
                    role="assistant", content=text or "", tool_calls=tools.result() or None, id=message_id
                ),
                finish_reason=choice.finish_reason,
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

    def predict(
        self,
        messages: list[ChatAgentMessage],
        context: ChatContext | None = None,
        custom_inputs: dict[str, Any] | None = None,
    ) -> ChatAgentResponse:
        def call() -> ChatAgentResponse:
            params = chat_agent_params(custom_inputs)
            return completion_to_chat_agent(self._engine().chat(_cc_messages(messages), params))

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
            _single_choice(params, "ChatAgent.predict_stream")
            yield from stream_to_chat_agent(self._engine().stream(_cc_messages(messages), params))

        inputs = {"messages": messages, "context": context, "custom_inputs": custom_inputs}
        yield from traced_stream(
            self.tracing,
            "SGLangChatAgent.predict_stream",
            SpanType.AGENT,
            inputs,
            chunks(),
            reduce_chat_agent_chunks,
            _last_usage,
        )


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


class SGLangChatModel(_EngineBacked, ChatModel):
    """ChatModel over SGLang: ``ChatParams`` fields, plus ``custom_inputs`` for ``response_format`` / ``json_schema`` / extras."""

    def predict(self, context: Any, messages: list[ChatMessage], params: ChatParams) -> ChatCompletionResponse:
        def call() -> ChatCompletionResponse:
            return completion_to_chat_model(self._engine().chat(_cc_messages(messages), chat_model_params(params)))

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
            yield from stream_to_chat_model(self._engine().stream(_cc_messages(messages), chat_model_params(params)))

        inputs = {"messages": messages, "params": params}
        yield from traced_stream(
            self.tracing,
            "SGLangChatModel.predict_stream",
            SpanType.CHAT_MODEL,
            inputs,
            chunks(),
            reduce_chat_model_chunks,
            _last_usage,
        )


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


def _responses_request(request: ResponsesAgentRequest | Mapping[str, Any]) -> ResponsesAgentRequest:
    if isinstance(request, ResponsesAgentRequest):
        return request
    try:
        return ResponsesAgentRequest(**request)
    except (TypeError, pydantic.ValidationError) as error:
        raise BadRequestError(f"not a ResponsesAgent request: {error}") from None


def _responses_usage_of(response: Any) -> Usage | None:
    """Chat-style usage from a ResponsesAgentResponse (or the ``response`` of a completed event)."""
    usage = response.get("usage") if isinstance(response, Mapping) else getattr(response, "usage", None)
    if hasattr(usage, "model_dump"):
        usage = usage.model_dump()
    if not usage:
        return None
    return {
        "prompt_tokens": usage.get("input_tokens", 0),
        "completion_tokens": usage.get("output_tokens", 0),
        "total_tokens": usage.get("total_tokens", 0),
    }


def _completed_usage(events: list[ResponsesAgentStreamEvent]) -> Usage | None:
    for event in reversed(events):
        if event.type == "response.completed":
            return _responses_usage_of(getattr(event, "response", None) or {})
    return None


class _ResponsesAgentMethods(_EngineBacked):
    """``predict`` / ``predict_stream`` of :class:`SGLangResponsesAgent`, defined outside the MLflow class so
    that MLflow does not wrap them in ``@mlflow.trace`` (they trace themselves, after the call)."""

    def predict(self, request: ResponsesAgentRequest) -> ResponsesAgentResponse:
        request = _responses_request(request)

        def call() -> ResponsesAgentResponse:
            params = responses_params(request)
            messages = to_chat_completions_input(request.input)
            return completion_to_responses(self._engine().chat(_cc_messages(messages), params))

        return traced_call(
            self.tracing,
            "SGLangResponsesAgent.predict",
            SpanType.AGENT,
            {"request": request},
            call,
            _responses_usage_of,
        )

    def predict_stream(self, request: ResponsesAgentRequest) -> Iterator[ResponsesAgentStreamEvent]:
        request = _responses_request(request)

        def events() -> Iterator[ResponsesAgentStreamEvent]:
            params = responses_params(request)
            _single_choice(params, "ResponsesAgent.predict_stream")
            messages = to_chat_completions_input(request.input)
            yield from stream_to_responses(self._engine().stream(_cc_messages(messages), params))

        yield from traced_stream(
            self.tracing,
            "SGLangResponsesAgent.predict_stream",
            SpanType.AGENT,
            {"request": request},
            events(),
            ResponsesAgent.responses_agent_output_reducer,
            _completed_usage,
        )


class SGLangResponsesAgent(_ResponsesAgentMethods, ResponsesAgent):
    """ResponsesAgent over SGLang: request fields (``text.format`` for JSON schema, tools) and ``custom_inputs``."""
