"""The ``responses_agent`` flavour: the SGLang engine as an MLflow ``ResponsesAgent`` (MLflow's recommended interface).

Requests are OpenAI Responses-style: ``input``, the generation fields (``temperature``, ``max_output_tokens``,
``tools``, ``text.format`` for a JSON schema...) and ``custom_inputs``; streams are Responses events by ``type``,
the usage in ``response.completed``.

This module is also the flavour's models-from-code file: log it with
``model_code.log_model(config, flavor="responses_agent")``; run by MLflow it sets the model, imported it only
defines the flavour.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pydantic
from mlflow.entities import SpanType
from mlflow.models import set_model
from mlflow.pyfunc import ResponsesAgent
from mlflow.types.responses import (
    ResponsesAgentRequest,
    ResponsesAgentResponse,
    ResponsesAgentStreamEvent,
    create_function_call_item,
    create_text_delta,
    create_text_output_item,
    to_chat_completions_input,
)

from model_code.client import usage_dict
from model_code.errors import BadRequestError
from model_code.flavors.common import (
    EngineBacked,
    ToolCallAccumulator,
    as_dict,
    cc_messages,
    single_choice,
    tool_calls_of,
)
from model_code.flavors.spec import QUESTION, FlavorSpec, executed_by_mlflow
from model_code.tracing import Usage, traced_call, traced_stream

SPEC = FlavorSpec(
    "responses_agent",
    Path(__file__).resolve(),
    "ResponsesAgent",
    {"input": QUESTION, "temperature": 0.1, "max_output_tokens": 50},
)


# ------------------------------------------------------------------------------------------ parameters
def responses_params(request: Any) -> dict[str, Any]:
    """ResponsesAgent: request fields mapped to chat-completions names, then ``custom_inputs``."""
    out: dict[str, Any] = {}
    for field in ("temperature", "top_p", "parallel_tool_calls", "user"):
        value = getattr(request, field, None)
        if value is not None:
            out[field] = value
    if request.max_output_tokens is not None:
        out["max_tokens"] = request.max_output_tokens
    if request.tools:
        out["tools"] = [responses_tool_to_cc(tool.model_dump(exclude_none=True)) for tool in request.tools]
    if request.tool_choice is not None:
        choice = request.tool_choice
        out["tool_choice"] = (
            choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
        )
    text = request.text
    if isinstance(text, Mapping) and isinstance(text.get("format"), Mapping):
        out["response_format"] = responses_format_to_cc(text["format"])
    out.update(request.custom_inputs or {})
    return out


def responses_tool_to_cc(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A Responses function tool (flat) -> a chat-completions tool (nested under ``function``)."""
    if tool.get("type") != "function":
        raise BadRequestError(f"only function tools can be passed to the engine, got type {tool.get('type')!r}")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def responses_format_to_cc(fmt: Mapping[str, Any]) -> dict[str, Any]:
    """Responses ``text.format`` -> chat-completions ``response_format``."""
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return {"type": fmt.get("type", "text")}


# ------------------------------------------------------------------------------------------ conversions
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
    """A ResponsesAgent response from an engine completion (a dict, or the openai SDK's model)."""
    response = as_dict(response)
    choice = response["choices"][0]
    message = choice.get("message") or {}
    item_id = response.get("id") or str(uuid.uuid4())
    return ResponsesAgentResponse(
        id=item_id,
        model=response.get("model"),
        output=_responses_output(item_id, message.get("content"), tool_calls_of(message)),
        usage=_responses_usage(usage_dict(response.get("usage"))),
        custom_outputs={"finish_reason": choice.get("finish_reason")},
        **_status(choice.get("finish_reason")),
    )


def stream_to_responses(chunks: Iterable[Any]) -> Iterator[ResponsesAgentStreamEvent]:
    """Responses events: a text delta per engine text chunk, then the output items and ``response.completed``.
    One pass per engine chunk (a dict; the openai SDK's models are dumped first)."""
    item_id: str | None = None
    model = None
    text: list[str] = []
    tools = ToolCallAccumulator()
    finish: str | None = None
    usage: dict[str, int] | None = None
    for chunk in chunks:
        if not isinstance(chunk, dict):
            chunk = as_dict(chunk)
        if item_id is None:
            item_id = chunk.get("id") or str(uuid.uuid4())
        model = model or chunk.get("model")
        raw_usage = chunk.get("usage")
        if raw_usage:
            usage = usage_dict(raw_usage) or usage
        for choice in (chunk.get("choices") or ())[:1]:
            delta = choice.get("delta") or {}
            content = delta.get("content")
            if content:
                text.append(content)
                yield ResponsesAgentStreamEvent(**create_text_delta(content, item_id))
            if delta.get("tool_calls"):
                tools.add(delta["tool_calls"])
            finish = choice.get("finish_reason") or finish
    item_id = item_id or str(uuid.uuid4())
    output = _responses_output(item_id, "".join(text), tools.result())
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


# ------------------------------------------------------------------------------------------ the class
class _ResponsesAgentMethods(EngineBacked):
    """``predict`` / ``predict_stream`` of :class:`SGLangResponsesAgent`, defined outside the MLflow class so
    that MLflow does not wrap them in ``@mlflow.trace`` (they trace themselves, after the call)."""

    def predict(self, request: ResponsesAgentRequest) -> ResponsesAgentResponse:
        request = _responses_request(request)

        def call() -> ResponsesAgentResponse:
            params = responses_params(request)
            messages = to_chat_completions_input(request.input)
            return completion_to_responses(self._engine().chat_json(cc_messages(messages), params))

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
            single_choice(params, "ResponsesAgent.predict_stream")
            messages = to_chat_completions_input(request.input)
            yield from stream_to_responses(self._engine().stream_json(cc_messages(messages), params))

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


if executed_by_mlflow(__package__):  # the models-from-code entry (see executed_by_mlflow)
    set_model(SGLangResponsesAgent())
