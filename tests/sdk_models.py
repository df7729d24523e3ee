"""An answer checked against the official SDKs' own response models (``openai``, ``anthropic``), as strictly as the
clients that validate them: agent frameworks such as pydantic-ai call ``ChatCompletion.model_validate`` on every
answer, and the SDKs themselves warn when they dump an object whose typed field holds something else.

:func:`assert_sdk_valid` checks one parsed JSON object (a plain answer, a streamed chunk or event, a batch line's
body) three ways:

1. **Strict validation** of the parsed JSON (``TypeAdapter(model).validate_python(obj, strict=True)``): no coercion
   at all (a number in a string, a string in a number field fail). The SDKs' models use ``Literal`` for their enums,
   which strict mode takes as strings, so strict is the strictest check that a correct answer passes; it is stricter
   than pydantic-ai (lax ``model_validate``) and than the SDK (no validation).
2. **The SDK's own path**: the object built as the SDK builds it (``model_construct``, no validation), dumped with
   serialization warnings as errors (the ``PydanticSerializationUnexpectedValue`` the SDK prints), then validated
   from that dump (pydantic-ai's ``Model.model_validate(response.model_dump())``).
3. **Extra keys**: the SDKs' models keep keys they do not declare (``extra="allow"``), so an SGLang field an older
   SDK does not declare passes 1 and 2 whatever it holds, and fails in the SDK release that declares it. So every
   undeclared key must be one of :data:`TOLERATED` (SGLang's additions that no SDK types otherwise, docs/serving.md),
   and a ``metadata`` object, declared or not, must be OpenAI's ``Metadata`` (a map of strings: newer openai releases
   declare it on ``ChatCompletion``, where SGLang's ``weight_versions`` list fails pydantic-ai).

One exception, OpenAI's own: a streamed text completion's chunks carry ``"finish_reason": null`` until the last,
and the SDK types them with ``Completion``, whose ``finish_reason`` is not optional (it builds them unvalidated).
``allow_null_finish`` passes exactly that error.
"""

from __future__ import annotations

import warnings
from typing import Any

from openai.types.shared import Metadata
from pydantic import BaseModel, TypeAdapter, ValidationError

# SGLang's additions the SDKs' models leave undeclared, and that hold nothing a model would type otherwise
# (docs/serving.md, SGLang extensions in answers). By name, wherever they appear.
TOLERATED = frozenset(
    {
        "matched_stop",  # chat/completion choices: the stop string or token id that ended the answer
        "index",  # a plain chat message's tool_calls: each call's place (as in a stream's deltas)
        "reasoning_content",  # chat messages and deltas: a reasoning parser's text (read by pydantic-ai, LangChain...)
        "reasoning_tokens",  # usage: SGLang's own count (OpenAI's is completion_tokens_details.reasoning_tokens)
        "completion_tokens",
        "completion_tokens_details",
        "prompt_tokens_details",  # an embeddings answer's usage: the chat usage's fields (0, null, null)
        "metadata",  # chat/text completions, where the SDK does not declare it: checked as OpenAI's Metadata below
        "store",  # Responses: whether the engine stored it
        "phase",  # Responses message items (newer openai releases declare it)
        "cache_write_tokens",  # Responses usage.input_tokens_details
        "tools",
        "format",
        "defer_loading",  # Responses function tools echoed back with SGLang's own optional fields (null)
    }
)
_METADATA = TypeAdapter(Metadata)
_ADAPTERS: dict[Any, TypeAdapter[Any]] = {}


def assert_sdk_valid(model: Any, obj: Any, *, allow_null_finish: bool = False) -> BaseModel:
    """``obj`` (parsed JSON) passes ``model`` (an SDK model class, or a union of them: a stream's events) the three
    ways above; the validated object."""
    adapter = _ADAPTERS.get(model) or _ADAPTERS.setdefault(model, TypeAdapter(model))
    try:
        validated = adapter.validate_python(obj, strict=True)
    except ValidationError as error:
        if not (allow_null_finish and _only_null_finish_reasons(error)):
            raise AssertionError(f"{_name(model)} refuses the answer (strict): {error}\n{obj}") from None
        obj = _with_finish(obj)  # (the rest is checked as the last chunk's would be)
        validated = adapter.validate_python(obj, strict=True)
    built = type(validated).model_construct(**obj)  # as the SDK builds it: unvalidated
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            dumped = built.model_dump()
        except Warning as warning:
            raise AssertionError(f"{type(validated).__name__}.model_dump() warns: {warning}\n{obj}") from None
    type(validated).model_validate(dumped)  # pydantic-ai's check
    extras = sorted(_extras(validated))
    unknown = [path for path in extras if path.rsplit(".", 1)[-1].split("[")[0] not in TOLERATED]
    assert not unknown, f"{_name(model)}: keys it does not declare, not known as SGLang's harmless additions: {unknown}\n{obj}"
    for path, value in _metadata(obj):
        try:
            _METADATA.validate_python(value, strict=True)
        except ValidationError as error:
            raise AssertionError(f"{path or '.'}metadata is not OpenAI's Metadata (a map of strings): {error}\n{obj}") from None
    return validated


def _name(model: Any) -> str:
    return getattr(model, "__name__", None) or str(model)


def _extras(model: Any, path: str = "") -> list[str]:
    """The undeclared keys in a validated object, as paths (``.choices[].matched_stop``)."""
    found: list[str] = []
    if isinstance(model, BaseModel):
        found += [f"{path}.{key}" for key in model.model_extra or {}]
        for name in type(model).model_fields:
            found += _extras(getattr(model, name), f"{path}.{name}")
    elif isinstance(model, list):
        for item in model:
            found += _extras(item, f"{path}[]")
    return found


def _metadata(obj: Any) -> list[tuple[str, Any]]:
    """The answer's ``metadata`` (and a Responses event's ``response.metadata``), with where it is; not any key of that
    name deeper down (a tool's parameters echoed back may well have a property called so)."""
    holders = [("", obj)] + [(f"{key}.", obj.get(key)) for key in ("response",)] if isinstance(obj, dict) else []
    return [(path, holder["metadata"]) for path, holder in holders if isinstance(holder, dict) and holder.get("metadata") is not None]


def _only_null_finish_reasons(error: ValidationError) -> bool:
    return all(
        issue["type"] == "literal_error" and issue["input"] is None and len(issue["loc"]) == 3 and issue["loc"][0] == "choices"
        and issue["loc"][2] == "finish_reason"
        for issue in error.errors()
    )  # fmt: skip


def _with_finish(obj: dict[str, Any]) -> dict[str, Any]:
    """A text completion chunk with each null ``finish_reason`` as the last chunk's would be, for the rest's check."""
    choices = [{**choice, "finish_reason": choice.get("finish_reason") or "length"} for choice in obj.get("choices", [])]
    return {**obj, "choices": choices}
