"""The few request fields the gateway must understand, validated before anything goes upstream.

Bodies are *not* re-serialized from these models: the client's JSON goes upstream with every field it
sent (SGLang extensions included), only ``model`` rewritten. Validation exists so that malformed or
type-confused requests get a clean 400 here instead of a traceback-laden error (or worse) from the
engine. Unknown fields are allowed and passed through.
"""

from __future__ import annotations

from typing import Annotated, Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, model_validator

from gateway.errors import GatewayError

_Number = Annotated[float, Field(allow_inf_nan=False)]
_TokenIds = list[StrictInt]
# Integers SGLang puts into int32/int64 tensors: one out of range (top_k=2**63) crashes its scheduler.
_Int32 = Annotated[StrictInt, Field(ge=-(2**31), lt=2**31)]
_Int64 = Annotated[StrictInt, Field(ge=-(2**63), lt=2**63)]


class Loose(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(Loose):
    include_usage: StrictBool | None = None


_ModelName = Annotated[StrictStr, Field(min_length=1, max_length=256)]


class _Sampling(Loose):
    """Fields every generation route shares, and SGLang's extensions whose range it does not check fully."""

    model: _ModelName
    stream: StrictBool | None = None
    temperature: _Number | None = Field(None, ge=0)
    top_p: _Number | None = Field(None, ge=0, le=1)
    top_k: _Int32 | None = Field(None, ge=-1)
    min_tokens: _Int32 | None = Field(None, ge=0)
    sampling_seed: _Int64 | None = None
    priority: _Int32 | None = None
    stop_token_ids: list[_Int32] | None = None
    rid: StrictStr | None = Field(None, max_length=256)  # SGLang's own request id: one string per request


class _Common(_Sampling):
    """OpenAI chat and text completions."""

    stream_options: StreamOptions | None = None
    n: StrictInt | None = Field(None, ge=1, le=128)
    max_tokens: _Int32 | None = Field(None, ge=0)
    seed: _Int64 | None = None
    stop: StrictStr | list[StrictStr] | None = None
    user: StrictStr | None = None


_GRAMMAR_FIELDS = ("regex", "ebnf", "json_schema", "structural_tag")
_GRAMMAR_FORMATS = ("json_schema", "json_object", "structural_tag")


def _check_min_tokens_without_grammar(body: Loose) -> None:
    """SGLang cannot honour ``min_tokens`` past the end of a grammar: it answers 500 ("Grammar accept_token
    failed") for a valid-looking request. Refuse the combination here, with the reason."""
    extra = body.model_extra or {}
    min_tokens = getattr(body, "min_tokens", None)
    if not min_tokens:
        return
    response_format = getattr(body, "response_format", None)
    constrained = [name for name in _GRAMMAR_FIELDS if extra.get(name)]
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
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None

    @model_validator(mode="after")
    def _grammar(self) -> ChatCompletionRequest:
        _check_min_tokens_without_grammar(self)
        return self


class InvocationsRequest(ChatCompletionRequest):
    """A chat request as Databricks custom LLM serving forwards it to ``POST /invocations``: its ``model``
    (absent, or the serving endpoint's name) does not route the request, so any value is accepted."""

    model: Any = None


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictStr] | _TokenIds | list[_TokenIds] = Field(min_length=1)
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: StrictBool | None = None
    suffix: StrictStr | None = None

    @model_validator(mode="after")
    def _grammar(self) -> CompletionRequest:
        _check_min_tokens_without_grammar(self)
        return self


class EmbeddingRequest(Loose):
    model: _ModelName
    input: StrictStr | list[StrictStr] | _TokenIds | list[_TokenIds] = Field(min_length=1)
    encoding_format: StrictStr | None = None
    dimensions: _Int32 | None = Field(None, ge=1)


class ResponsesRequest(_Sampling):
    """OpenAI Responses API (``input`` is a string or a list of input items)."""

    input: StrictStr | list[dict[str, Any]] = Field(min_length=1)
    instructions: StrictStr | None = None
    max_output_tokens: _Int32 | None = Field(None, ge=1)
    previous_response_id: StrictStr | None = Field(None, min_length=1, max_length=256)
    background: StrictBool | None = None
    store: StrictBool | None = None
    top_logprobs: _Int32 | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


class _AnthropicMessage(Loose):
    role: StrictStr
    content: StrictStr | list[dict[str, Any]]


class MessagesRequest(_Sampling):
    """Anthropic Messages (``max_tokens`` is required by Anthropic's API)."""

    messages: list[_AnthropicMessage] = Field(min_length=1)
    max_tokens: _Int32 = Field(ge=1)
    system: StrictStr | list[dict[str, Any]] | None = None
    stop_sequences: list[StrictStr] | None = None
    metadata: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None


class CountTokensRequest(Loose):
    model: _ModelName
    messages: list[_AnthropicMessage] = Field(min_length=1)
    system: StrictStr | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None


class TokenizeRequest(Loose):
    model: _ModelName | None = None
    prompt: StrictStr | list[StrictStr] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: StrictBool | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self


class DetokenizeRequest(Loose):
    model: _ModelName | None = None
    tokens: _TokenIds | list[_TokenIds] = Field(min_length=1)


class ScoreRequest(Loose):
    model: _ModelName | None = None
    query: StrictStr | _TokenIds | None = None
    items: StrictStr | list[StrictStr] | list[_TokenIds] | None = None
    label_token_ids: list[_Int32] | list[list[_Int32]] | None = None
    apply_softmax: StrictBool | None = None
    temperature: _Number | None = Field(None, gt=0)


class RerankRequest(Loose):
    model: _ModelName | None = None
    query: StrictStr | list[dict[str, Any]]
    documents: list[StrictStr | list[dict[str, Any]]] = Field(min_length=1)
    top_n: _Int32 | None = Field(None, ge=1)
    return_documents: StrictBool | None = None


class ClassifyRequest(Loose):
    model: _ModelName | None = None
    input: StrictStr | list[StrictStr] | _TokenIds | list[_TokenIds] = Field(min_length=1)


MAX_NESTING = 64
"""Deepest nesting of arrays/objects accepted in a body (the gateway re-serialises bodies, and deep
recursion in an engine's validators is a way to crash it); real requests, JSON schemas included, stay far below."""


def parse_body(raw: bytes, schema: type[Loose]) -> dict[str, Any]:
    """The JSON object in ``raw``, checked against ``schema``; GatewayError(400) otherwise."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        raise GatewayError(400, f"request body is not valid JSON: {error}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise GatewayError(400, f"request body must be a JSON object, got {_json_type(data)}", code="invalid_json")
    if raw.count(b"[") + raw.count(b"{") > MAX_NESTING and _depth(data) > MAX_NESTING:
        raise GatewayError(400, f"request body is nested deeper than {MAX_NESTING} levels", code="invalid_json")
    try:
        schema.model_validate(data)
    except ValidationError as error:
        problem = error.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(part) for part in problem["loc"]) or None
        # Union errors name each alternative; the first segment is the field the client got wrong.
        field = str(problem["loc"][0]) if problem["loc"] else None
        more = f" (and {error.error_count() - 1} more problem(s))" if error.error_count() > 1 else ""
        message = problem["msg"].removeprefix("Value error, ")
        raise GatewayError(400, f"{where}: {message}{more}" if where else message + more, param=field) from None
    return data


def _depth(value: Any) -> int:
    """Nesting depth of arrays and objects in a parsed JSON value (iterative: no recursion limit)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_NESTING:
            return deepest
        stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def _json_type(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}.get(type(value), "null")
