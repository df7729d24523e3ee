"""Generation parameters: one mapping (whatever the interface) -> validated ``openai`` ``chat.completions`` kwargs.

Each flavour module of :mod:`model_code.flavors` first gathers the parameters from where its interface puts them:

- ChatAgent: everything in ``custom_inputs`` (MLflow drops top-level generation fields).
- ChatModel: the ``ChatParams`` fields (``temperature``, ``max_tokens``, ``stop``, ``n``, ``top_p``,
  ``top_k``, penalties, ``tools``) plus anything in ``custom_inputs`` (``response_format``, ``json_schema``,
  SGLang extras): ``ChatParams`` has no ``response_format``.
- ResponsesAgent: request fields (``temperature``, ``top_p``, ``max_output_tokens``, ``tools``,
  ``tool_choice``, ``parallel_tool_calls``, ``text.format``) plus ``custom_inputs``.

Then :func:`build_request` (the engine client calls it) takes that mapping. Accepted keys (anything else is a
:class:`BadRequestError` that lists them):
OpenAI ones are passed as is; SGLang sampling extras (``top_k``, ``min_p``, ``repetition_penalty``,
``regex``, ``ebnf``, ...) go in ``extra_body``; ``json_schema`` (a dict or JSON string, as batch users
already pass it) becomes ``response_format={"type": "json_schema", ...}``; ``extra_body`` is merged verbatim (less the
keys the wrapper sets: ``model``, ``messages``, ``stream``, ``stream_options``) and the whole request then goes
through the request guard (:mod:`model_code.guard`) as a gateway request would;
``adapter`` selects one of the model's LoRA adapters (:func:`model_for`), in every flavour's ``custom_inputs``.
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
ADAPTER_PARAM = "adapter"
CONVENIENCE_PARAMS = frozenset({"json_schema", "extra_body", ADAPTER_PARAM})
ACCEPTED_PARAMS = OPENAI_PARAMS | SGLANG_EXTRA_PARAMS | CONVENIENCE_PARAMS
_SET_BY_THE_WRAPPER = frozenset({"model", "messages", "stream", "stream_options"})


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
        for name in _SET_BY_THE_WRAPPER.intersection(merged["extra_body"]):
            raise BadRequestError(f"extra_body.{name}: set by the wrapper itself (the call's messages, model and streaming)", param=name)
        extra.update(merged["extra_body"])
    if extra:
        kwargs["extra_body"] = extra
    return kwargs


def create_kwargs(
    served: str, adapters: tuple[str, ...] | None, params: Mapping[str, Any] | None, defaults: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Validated ``chat.completions.create`` kwargs, ``model`` included (:func:`model_for`), without ``messages`` and ``stream``."""
    return {"model": model_for(served, adapters, params, defaults), **build_request(params, defaults)}


def model_for(
    served: str, adapters: tuple[str, ...] | None, params: Mapping[str, Any] | None, defaults: Mapping[str, Any] | None = None
) -> str:
    """The request's ``model``: ``served``, or ``<served>:<adapter>`` (SGLang's selection) for the LoRA adapter named by
    the ``adapter`` parameter; ``adapters``: those the engine serves (None: a URL target, whose server checks)."""
    adapter = (params or {}).get(ADAPTER_PARAM)
    if adapter is None:
        adapter = (defaults or {}).get(ADAPTER_PARAM)
    if adapter is None:
        return served
    if adapters is not None and adapter not in adapters:
        served_ones = f"its adapters: {', '.join(adapters)}" if adapters else "it serves no LoRA adapter"
        raise BadRequestError(f"adapter {adapter!r}: not an adapter of model {served!r} ({served_ones})")
    if not isinstance(adapter, str) or not adapter:
        raise BadRequestError("'adapter' must name one of the model's LoRA adapters")
    return f"{served}:{adapter}"


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
