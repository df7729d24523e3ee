"""Generation parameters: from where each MLflow interface puts them to ``openai`` ``chat.completions`` kwargs.

- ChatAgent: everything in ``custom_inputs`` (MLflow drops top-level generation fields).
- ChatModel: the ``ChatParams`` fields (``temperature``, ``max_tokens``, ``stop``, ``n``, ``top_p``,
  ``top_k``, penalties, ``tools``) plus anything in ``custom_inputs`` (``response_format``, ``json_schema``,
  SGLang extras): ``ChatParams`` has no ``response_format``.
- ResponsesAgent: request fields (``temperature``, ``top_p``, ``max_output_tokens``, ``tools``,
  ``tool_choice``, ``parallel_tool_calls``, ``text.format``) plus ``custom_inputs``.

Accepted keys (anything else is a :class:`BadRequestError` that lists them):
OpenAI ones are passed as is; SGLang sampling extras (``top_k``, ``min_p``, ``repetition_penalty``,
``regex``, ``ebnf``, ...) go in ``extra_body``; ``json_schema`` (a dict or JSON string, as batch users
already pass it) becomes ``response_format={"type": "json_schema", ...}``; ``extra_body`` is merged verbatim.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from model_code.errors import BadRequestError

OPENAI_PARAMS = frozenset(
    {
        "temperature",
        "top_p",
        "max_tokens",
        "max_completion_tokens",
        "stop",
        "n",
        "seed",
        "frequency_penalty",
        "presence_penalty",
        "logprobs",
        "top_logprobs",
        "logit_bias",
        "response_format",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "user",
    }
)
SGLANG_EXTRA_PARAMS = frozenset(
    {
        "top_k",
        "min_p",
        "repetition_penalty",
        "min_tokens",
        "regex",
        "ebnf",
        "ignore_eos",
        "no_stop_trim",
        "skip_special_tokens",
        "separate_reasoning",
        "stream_reasoning",
        "chat_template_kwargs",
        "continue_final_message",
        "lora_path",
        "rid",
    }
)
CONVENIENCE_PARAMS = frozenset({"json_schema", "extra_body"})
ACCEPTED_PARAMS = OPENAI_PARAMS | SGLANG_EXTRA_PARAMS | CONVENIENCE_PARAMS


def build_request(params: Mapping[str, Any] | None, defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Validated ``chat.completions.create`` kwargs (without ``model``, ``messages``, ``stream``)."""
    merged: dict[str, Any] = {**(defaults or {}), **{k: v for k, v in (params or {}).items() if v is not None}}
    unknown = sorted(set(merged) - ACCEPTED_PARAMS)
    if unknown:
        raise BadRequestError(
            f"unknown generation parameter(s) {', '.join(map(repr, unknown))}; accepted: "
            f"{', '.join(sorted(ACCEPTED_PARAMS))} (anything else can go in 'extra_body')"
        )
    kwargs: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in merged.items():
        if key in OPENAI_PARAMS:
            kwargs[key] = value
        elif key in SGLANG_EXTRA_PARAMS:
            extra[key] = value
    if isinstance(kwargs.get("stop"), str):
        kwargs["stop"] = [kwargs["stop"]]
    if "json_schema" in merged:
        if "response_format" in kwargs:
            raise BadRequestError("give either 'json_schema' or 'response_format', not both")
        kwargs["response_format"] = json_schema_format(merged["json_schema"])
    if "response_format" in kwargs:
        kwargs["response_format"] = _check_response_format(kwargs["response_format"])
    if merged.get("extra_body") is not None:
        if not isinstance(merged["extra_body"], Mapping):
            raise BadRequestError("'extra_body' must be a mapping")
        extra.update(merged["extra_body"])
    if extra:
        kwargs["extra_body"] = extra
    return kwargs


def json_schema_format(schema: Any, name: str = "output") -> dict[str, Any]:
    """``response_format`` for a JSON schema given as a dict, a JSON string, or a pydantic model class."""
    if hasattr(schema, "model_json_schema"):
        name = getattr(schema, "__name__", name)
        schema = schema.model_json_schema()
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise BadRequestError(f"'json_schema' is not valid JSON: {error}") from None
    if not isinstance(schema, Mapping):
        raise BadRequestError(f"'json_schema' must be a JSON object, got {type(schema).__name__}")
    schema = dict(schema)
    name = str(schema.get("title") or name)
    return {"type": "json_schema", "json_schema": {"name": _safe_name(name), "schema": schema, "strict": True}}


def _check_response_format(value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = {"type": value}
    if not isinstance(value, Mapping) or "type" not in value:
        raise BadRequestError("'response_format' must be an object with a 'type' (text, json_object or json_schema)")
    value = dict(value)
    if value["type"] == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema"), Mapping):
            raise BadRequestError("'response_format.json_schema' must be an object with a 'schema' object")
        value["json_schema"] = {"name": "output", **spec}
    elif value["type"] not in ("text", "json_object"):
        raise BadRequestError(f"'response_format.type' must be text, json_object or json_schema, got {value['type']!r}")
    return value


def _safe_name(name: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "_-" else "_" for c in name)[:64]
    return cleaned or "output"


# ----------------------------------------------------------------------------------- per interface
def chat_agent_params(custom_inputs: Mapping[str, Any] | None) -> dict[str, Any]:
    """ChatAgent: generation parameters travel in ``custom_inputs``."""
    return dict(custom_inputs or {})


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
