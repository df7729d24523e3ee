"""What a proxied request may carry, validated before anything goes upstream: the allowlist's schemas.

Each route's schema declares every field that goes to the engine, with its type and static bounds
(:mod:`engine_guard.fields` lists the SGLang extensions that are off unless a deployment enables them per
model, and the service options that are dropped). Anything else is refused with a 400 naming the field.
Bodies are *not* re-serialized from these models: the client's JSON goes upstream as sent (less the
dropped fields, ``model`` rewritten). Configurable bounds (fan-out, grammar sizes) are
:mod:`engine_guard.bounds`; grammar inputs are checked by :mod:`engine_guard.grammar_checks`.

Booleans are lax, as SGLang's own models are (``"logprobs": "true"`` is accepted there), except
``stream``, which the gateway itself reads.
"""

from __future__ import annotations

import base64
import binascii
import functools
import pickletools
from typing import Annotated, Any

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from engine_guard.empty_inputs import check_inputs
from engine_guard.fields import DROPPED, REFUSED, extensions_for
from engine_guard.refusal import Refused

_Number = Annotated[float, Field(allow_inf_nan=False)]
_Bool = Annotated[bool, Field(strict=False)]  # lax, like SGLang's: "true", 1...
_TokenIds = list[StrictInt]
# Integers SGLang puts into int32/int64 tensors: one out of range (top_k=2**63) crashes its scheduler.
_Int32 = Annotated[StrictInt, Field(ge=-(2**31), lt=2**31)]
_Int64 = Annotated[StrictInt, Field(ge=-(2**63), lt=2**63)]
_Penalty = Annotated[_Number, Field(ge=-2, le=2)]
_JSONObject = dict[str, Any]
_Name = Annotated[StrictStr, Field(max_length=256)]
_Strings = StrictStr | list[StrictStr]
_NonEmptyIds = Annotated[_TokenIds, Field(min_length=1)]
_NonEmptyStr = Annotated[StrictStr, Field(min_length=1)]
# A prompt (or an input to embed or classify): text, texts, token ids or lists of them. An empty one has no
# token (the tokenizers of Qwen and others add none), and SGLang 0.5.23's forward pass crashes on it.
_Prompt = _NonEmptyStr | list[_NonEmptyStr] | _NonEmptyIds | list[_NonEmptyIds]


class Loose(BaseModel):
    """A schema whose unknown fields are looked at by :func:`parse_body` (allowlist), not by pydantic."""

    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(Loose):
    include_usage: StrictBool | None = None
    continuous_usage_stats: _Bool | None = None


_ModelName = Annotated[StrictStr, Field(min_length=1, max_length=256)]


class _Sampling(Loose):
    """Fields every generation route shares (SGLang's sampling extensions included)."""

    model: _ModelName
    stream: StrictBool | None = None
    temperature: _Number | None = Field(None, ge=0)
    top_p: _Number | None = Field(None, ge=0, le=1)
    top_k: _Int32 | None = Field(None, ge=-1)


class _Penalties(_Sampling):
    priority: _Int32 | None = None
    frequency_penalty: _Penalty | None = None
    presence_penalty: _Penalty | None = None
    repetition_penalty: _Number | None = Field(None, gt=0, le=2)
    min_p: _Number | None = Field(None, ge=0, le=1)
    stop: _Strings | None = None


class _Common(_Penalties):
    """OpenAI chat and text completions, and SGLang's decoding extensions they share."""

    stream_options: StreamOptions | None = None
    n: StrictInt | None = Field(None, ge=1, le=128)
    max_tokens: _Int32 | None = Field(None, ge=0)
    seed: _Int64 | None = None
    user: _Name | None = None
    logit_bias: dict[StrictStr, _Number] | None = None
    min_tokens: _Int32 | None = Field(None, ge=0)
    stop_token_ids: list[_Int32] | None = None
    stop_regex: _Strings | None = None
    regex: StrictStr | None = None
    ebnf: StrictStr | None = None
    response_format: _JSONObject | None = None
    ignore_eos: _Bool | None = None
    skip_special_tokens: _Bool | None = None
    no_stop_trim: _Bool | None = None


_GRAMMAR_FIELDS = ("regex", "ebnf", "json_schema", "structural_tag")
_GRAMMAR_FORMATS = ("json_schema", "json_object", "structural_tag")


def _check_min_tokens_without_grammar(body: Loose) -> None:
    """SGLang cannot honour ``min_tokens`` past the end of a grammar: it answers 500 ("Grammar accept_token
    failed") for a valid-looking request. Refuse the combination here, with the reason."""
    min_tokens = getattr(body, "min_tokens", None)
    if not min_tokens:
        return
    response_format = getattr(body, "response_format", None)
    constrained = [name for name in _GRAMMAR_FIELDS if getattr(body, name, None)]
    if isinstance(response_format, dict) and response_format.get("type") in _GRAMMAR_FORMATS:
        constrained.append(f"response_format {response_format['type']}")
    if constrained:
        raise ValueError(f"min_tokens cannot be combined with a constrained output ({constrained[0]}): the grammar may end first")


class ChatMessage(Loose):
    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: _Int32 | None = Field(None, ge=0)
    logprobs: _Bool | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    tools: list[_JSONObject] | None = None
    tool_choice: StrictStr | _JSONObject | None = None
    parallel_tool_calls: _Bool | None = None
    reasoning_effort: Annotated[StrictStr, Field(max_length=32)] | _Number | None = None
    thinking: _JSONObject | _Bool | None = None
    chat_template_kwargs: _JSONObject | None = None
    continue_final_message: _Bool | None = None
    separate_reasoning: _Bool | None = None
    stream_reasoning: _Bool | None = None

    @model_validator(mode="after")
    def _grammar(self) -> ChatCompletionRequest:
        _check_min_tokens_without_grammar(self)
        return self


class InvocationsRequest(ChatCompletionRequest):
    """A chat request as Databricks custom LLM serving forwards it to ``POST /invocations``: its ``model``
    (absent, or the serving endpoint's name) does not route the request, so any value is accepted."""

    model: Any = None


class CompletionRequest(_Common):
    prompt: _Prompt = Field(min_length=1)
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: _Bool | None = None
    suffix: StrictStr | None = None
    best_of: StrictInt | None = Field(None, ge=1, le=128)
    json_schema: StrictStr | None = None

    @model_validator(mode="after")
    def _grammar(self) -> CompletionRequest:
        _check_min_tokens_without_grammar(self)
        return self


class EmbeddingRequest(Loose):
    model: _ModelName
    input: _Prompt = Field(min_length=1)
    encoding_format: StrictStr | None = None
    dimensions: _Int32 | None = Field(None, ge=1)
    user: _Name | None = None
    priority: _Int32 | None = None


class ResponsesRequest(_Penalties):
    """OpenAI Responses API (``input`` is a string or a list of input items)."""

    input: StrictStr | list[dict[str, Any]] = Field(min_length=1)
    instructions: StrictStr | None = None
    max_output_tokens: _Int32 | None = Field(None, ge=1)
    max_tool_calls: _Int32 | None = Field(None, ge=0)
    previous_response_id: StrictStr | None = Field(None, min_length=1, max_length=256)
    background: _Bool | None = None
    store: _Bool | None = None
    top_logprobs: _Int32 | None = Field(None, ge=0, le=20)
    tools: list[_JSONObject] | None = None
    tool_choice: StrictStr | _JSONObject | None = None
    parallel_tool_calls: _Bool | None = None
    text: _JSONObject | None = None
    metadata: _JSONObject | None = None
    include: list[StrictStr] | None = None
    reasoning: _JSONObject | None = None
    truncation: StrictStr | None = None
    user: _Name | None = None
    chat_template_kwargs: _JSONObject | None = None


class _AnthropicBlock(Loose):
    """A content block: SGLang dispatches on its ``type`` (a type that is not a string is a 500 there)."""

    type: StrictStr


class _AnthropicTool(Loose):
    type: StrictStr | None = None
    name: StrictStr | None = None
    input_schema: _JSONObject | None = None


class _AnthropicMessage(Loose):
    role: StrictStr
    content: StrictStr | list[_AnthropicBlock]


class MessagesRequest(_Sampling):
    """Anthropic Messages (``max_tokens`` is required by Anthropic's API)."""

    messages: list[_AnthropicMessage] = Field(min_length=1)
    max_tokens: _Int32 = Field(ge=1)
    system: StrictStr | list[_AnthropicBlock] | None = None
    stop_sequences: list[StrictStr] | None = None
    metadata: _JSONObject | None = None
    tools: list[_AnthropicTool] | None = None
    tool_choice: _JSONObject | None = None
    thinking: _JSONObject | None = None
    output_config: _JSONObject | None = None
    betas: list[StrictStr] | None = None


class CountTokensRequest(Loose):
    model: _ModelName
    messages: list[_AnthropicMessage] = Field(min_length=1)
    system: StrictStr | list[_AnthropicBlock] | None = None
    tools: list[_AnthropicTool] | None = None
    tool_choice: _JSONObject | None = None
    thinking: _JSONObject | None = None
    output_config: _JSONObject | None = None
    betas: list[StrictStr] | None = None


class TokenizeRequest(Loose):
    model: _ModelName | None = None
    prompt: StrictStr | list[StrictStr] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: _Bool | None = None
    add_generation_prompt: _Bool | None = None
    continue_final_message: _Bool | None = None
    chat_template_kwargs: _JSONObject | None = None
    reasoning_effort: Annotated[StrictStr, Field(max_length=32)] | None = None
    tools: list[_JSONObject] | None = None
    tool_choice: StrictStr | _JSONObject | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self


class DetokenizeRequest(Loose):
    model: _ModelName | None = None
    tokens: _TokenIds | list[_TokenIds] = Field(min_length=1)
    skip_special_tokens: _Bool | None = None


class ScoreRequest(Loose):
    """SGLang's scoring. Empty token lists crash its scheduler (a tensor of 0 elements): refused."""

    model: _ModelName | None = None
    query: Annotated[StrictStr, Field(min_length=1)] | _NonEmptyIds | None = None
    items: StrictStr | Annotated[list[StrictStr], Field(min_length=1)] | Annotated[list[_NonEmptyIds], Field(min_length=1)] | None = None
    label_token_ids: Annotated[list[_Int32], Field(min_length=1)] | list[Annotated[list[_Int32], Field(min_length=1)]] | None = None
    apply_softmax: _Bool | None = None
    temperature: _Number | None = Field(None, gt=0)
    item_first: _Bool | None = None
    return_token_logprobs: _Bool | None = None


class RerankRequest(Loose):
    model: _ModelName | None = None
    query: StrictStr | list[dict[str, Any]]
    documents: list[StrictStr | list[dict[str, Any]]] = Field(min_length=1)
    top_n: _Int32 | None = Field(None, ge=1)
    return_documents: _Bool | None = None
    instruct: StrictStr | None = None


class ClassifyRequest(Loose):
    model: _ModelName | None = None
    input: _Prompt = Field(min_length=1)
    user: _Name | None = None
    priority: _Int32 | None = None


def _pickle_problem(value: str) -> str | None:
    """Why a custom logit processor (SGLang's ``{"callable": <base64 dill>}`` JSON) cannot reach the engine:
    one that fails to unpickle kills the scheduler. The pickle is only parsed (opcodes), never loaded."""
    try:
        envelope = orjson.loads(value)
        payload = base64.b64decode(envelope["callable"], validate=True)
        for _ in pickletools.genops(payload):
            pass
    except (orjson.JSONDecodeError, TypeError, KeyError, binascii.Error, ValueError) as error:
        return f"not a serialized logit processor ({type(error).__name__})"
    except Exception as error:  # noqa: BLE001 - pickletools raises several kinds on a broken stream
        return f"not a serialized logit processor ({type(error).__name__})"
    return None


_EngineId = Annotated[StrictStr, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")]
# Types of the extension fields when a deployment enables them (the rest take any JSON: the body size bounds them).
EXTENSION_TYPES: dict[str, TypeAdapter[Any]] = {
    "input_ids": TypeAdapter(_NonEmptyIds | Annotated[list[_NonEmptyIds], Field(min_length=1)]),
    "rid": TypeAdapter(_EngineId),
    "session_id": TypeAdapter(_EngineId),
    "lora_path": TypeAdapter(Annotated[StrictStr, Field(min_length=1, max_length=256)]),
    "custom_logit_processor": TypeAdapter(Annotated[StrictStr, Field(max_length=1 << 20)]),
    "embed_override_token_id": TypeAdapter(Annotated[StrictInt, Field(ge=0, lt=2**31)]),
    "data_parallel_rank": TypeAdapter(Annotated[StrictInt, Field(ge=0, lt=2**16)]),
    "return_hidden_states": TypeAdapter(_Bool),
}


MAX_NESTING = 64
"""Deepest nesting of arrays/objects accepted in a body (the gateway re-serialises bodies, and deep
recursion in an engine's validators is a way to crash it); real requests, JSON schemas included, stay far below."""


def parse_body(raw: bytes, schema: type[Loose], path: str) -> dict[str, Any]:
    """The JSON object in ``raw``, checked against ``schema`` and the allowlist of route ``path`` (the
    engine's path); its dropped fields removed. Refused otherwise, naming the field."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        raise Refused(f"request body is not valid JSON: {error}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise Refused(f"request body must be a JSON object, got {_json_type(data)}", code="invalid_json")
    if raw.count(b"[") + raw.count(b"{") > MAX_NESTING and deeper_than(data, MAX_NESTING):
        raise Refused(f"request body is nested deeper than {MAX_NESTING} levels", code="invalid_json")
    return check_body(data, schema, path)


def check_body(data: dict[str, Any], schema: type[Loose], path: str) -> dict[str, Any]:
    """:func:`parse_body` for a body already parsed (the MLflow wrapper's request): ``data`` checked against
    ``schema`` and the allowlist of ``path``, its dropped fields removed (in place). Refused otherwise."""
    dropped = DROPPED.get(path)
    if dropped is not None and not dropped.isdisjoint(data):  # (most bodies carry none: one test, not a pop per name)
        for name in dropped.intersection(data):
            del data[name]
    extensions = extensions_for(path)
    for name, why in REFUSED.get(path, {}).items():
        if name in data:
            raise Refused(f"Unsupported parameter: {name!r}: {why}", code="unsupported_parameter", param=name)
    known = _known_fields(schema, path)
    if not data.keys() <= known:
        name = next(name for name in data if name not in known)  # the first, as the client wrote them
        raise Refused(
            f"unknown field {name!r}: it is not part of this route's API (the gateway sends the engine only the fields it knows)",
            code="unknown_field", param=name,
        )  # fmt: skip
    try:
        schema.model_validate(data)
    except ValidationError as error:
        raise _first_problem(error) from None
    for name in extensions.intersection(data):
        adapter = EXTENSION_TYPES.get(name)
        try:
            if adapter is not None:
                adapter.validate_python(data[name])
        except ValidationError as error:
            raise _first_problem(error, name) from None
    if isinstance(data.get("custom_logit_processor"), str) and (problem := _pickle_problem(data["custom_logit_processor"])):
        raise Refused(f"custom_logit_processor: {problem}", param="custom_logit_processor")
    check_inputs(path, data)
    return data


@functools.cache
def _known_fields(schema: type[Loose], path: str) -> frozenset[str]:
    """The fields a body for ``schema`` at ``path`` may carry: the schema's and the route's extensions (once per
    pair: ``schema.model_fields`` costs ~1 µs a lookup, and every field of every request was looked up)."""
    return frozenset(schema.model_fields) | extensions_for(path)


def _first_problem(error: ValidationError, field: str | None = None) -> Refused:
    """The first problem pydantic found, as ``where: what`` naming the field the client got wrong."""
    problem = error.errors(include_url=False, include_input=False)[0]
    loc = ((field,) if field else ()) + tuple(problem["loc"])
    where = ".".join(str(part) for part in loc) or None
    more = f" (and {error.error_count() - 1} more problem(s))" if error.error_count() > 1 else ""
    message = problem["msg"].removeprefix("Value error, ")
    # Union errors name each alternative; the first segment is the field the client got wrong.
    return Refused(f"{where}: {message}{more}" if where else message + more, param=str(loc[0]) if loc else None)


def check_extensions(
    body: dict[str, Any], path: str, enabled: frozenset[str], model: str, switch: str | None = None
) -> None:
    """Refuse the SGLang extension fields of ``body`` that the deployment did not enable for ``model``
    (``switch``: the setting that enables them, named in the message; the gateway's by default)."""
    for name in extensions_for(path).intersection(body):
        if name not in enabled:
            switch = switch or f"gateway.extension_fields.{model}"
            raise Refused(
                f"{name!r} is an SGLang extension field that is off for model {model!r} (the operator can enable "
                f"it with {switch}: see docs/security.md, SGLang extension fields)",
                code="extension_field_disabled", param=name,
            )  # fmt: skip


def nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether arrays and objects nest more than ``limit`` levels in a parsed JSON value (the value itself is one).
    (The definition: the native walk, :data:`deeper_than`, gives the same answers, tests/engine_guard/test_native_walk.py.)"""
    return _depth(value, limit) > limit


def _depth(value: Any, limit: int = MAX_NESTING) -> int:
    """Nesting depth of arrays and objects in a parsed JSON value, up to the first level past ``limit`` (iterative: no
    recursion limit)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if deepest > limit:
            return deepest
        stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def _json_type(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}.get(type(value), "null")


try:  # the walk in C (engine_guard/_walk.c: ~50x faster on an agent's request); the definition above where not built
    from engine_guard._walk import deeper_than
except ImportError:
    deeper_than = nested_deeper_than
