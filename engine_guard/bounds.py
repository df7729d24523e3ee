"""The configurable bounds of one request (``gateway.request_bounds``, or an MLflow model's ``request_bounds``): fan-out and grammar inputs.

A request holds one gateway slot, but a completions request with 20,000 prompts, or a score request with
20,000 items, is 20,000 requests for the engine; a 300 KB regex occupies one of its few grammar threads for
minutes. :func:`check_bounds` refuses such requests (400 naming the field and the bound) after the schema
has checked types, so it can trust them. :func:`grammar_inputs` names a request's grammars, which also
decides whether it takes a grammar slot (``limits.max_concurrent_grammars``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field

from engine_guard.grammar_checks import (
    GrammarProblem,
    check_ebnf,
    check_json_schema,
    check_regex,
    check_stop_regex,
    check_structural_tag,
)
from engine_guard.refusal import Refused
from engine_guard.tool_calls import is_strict


class RequestBounds(BaseModel):
    """What one request may ask of an engine: each list that fans out into engine work, and each grammar input.

    Every prompt, item and choice becomes engine work behind one gateway slot; every grammar is compiled on
    the engine's few grammar threads. The defaults fit OpenAI's own limits where it has them. The gateway reads
    them from ``gateway.request_bounds``, the MLflow wrapper from its ``model_config``'s ``request_bounds``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_prompts: int = Field(64, ge=1, description="Prompts in one completions request (each is one engine request).")
    max_generations: int = Field(128, ge=1, description="Generations per request: prompts x n (x best_of).")
    max_inputs: int = Field(2048, ge=1, description="Inputs of embeddings/classify/tokenize, score items, rerank documents.")
    max_messages: int = Field(2048, ge=1, description="Messages (or Responses input items) in one request.")
    max_tools: int = Field(128, ge=0, description="Tools in one request.")
    max_stop: int = Field(16, ge=0, description="Stop strings (stop, stop_sequences) and stop_regex patterns.")
    max_token_list: int = Field(1024, ge=1, description="stop_token_ids, logit_bias and label_token_ids entries.")
    max_grammar_bytes: int = Field(32768, ge=256, description="Bytes of each grammar input: regex, ebnf, JSON schema, structural tag.")
    max_schema_depth: int = Field(32, ge=1, description="Nesting of a JSON schema.")
    max_enum_values: int = Field(1024, ge=1, description="Values of one enum in a JSON schema.")
    max_grammar_compile_s: float | None = Field(
        2.0, gt=0, description="CPU seconds a request's grammars may cost the engine to compile, measured before it sees "
        "them with its grammar backend and tokenizer (400 grammar_too_costly past it; unset: not measured).",
    )  # fmt: skip


# path -> the fields whose list items each become engine work
_INPUT_LISTS: dict[str, tuple[str, ...]] = {
    "/v1/embeddings": ("input",),
    "/v1/classify": ("input",),
    "/v1/tokenize": ("prompt",),
    "/v1/detokenize": ("tokens",),
    "/v1/score": ("items", "label_token_ids"),
    "/v1/rerank": ("documents",),
}


def _refuse(field: str, message: str, code: str = "request_too_large") -> Refused:
    """400 naming ``field``: a bound it exceeds (``request_too_large``) or a grammar the engine must not get (``invalid_grammar``)."""
    return Refused(f"{field}: {message}", code=code, param=field)


def _prompt_count(prompt: Any) -> int:
    """How many engine requests a completions prompt makes (a list of strings or of token lists: one each)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1


def check_bounds(path: str, body: dict[str, Any], bounds: RequestBounds, setting: str = "gateway.request_bounds") -> int:
    """Raise Refused(400) when ``body`` (valid for route ``path``, the engine's path) exceeds a bound.

    Returns :func:`grammar_bytes` of ``body``, measured on the way (it decides the grammar slot)."""
    if path == "/v1/completions":
        prompts = _prompt_count(body.get("prompt"))
        if prompts > bounds.max_prompts:
            raise _refuse("prompt", f"{prompts} prompts; at most {bounds.max_prompts} ({setting}.max_prompts)")
    else:
        prompts = 1
    choices = max(body.get("n") or 1, body.get("best_of") or 1)
    if prompts * choices > bounds.max_generations:
        field = "n" if prompts == 1 else "prompt"
        raise _refuse(field, f"{prompts} prompt(s) x {choices} choices; at most {bounds.max_generations} generations ({setting}.max_generations)")
    limits = _list_limits(path, bounds)
    present = limits.keys() & body.keys()  # most bodies carry one or two of the lists: only those are looked at
    if present:
        for field in present if len(present) == 1 else [field for field in limits if field in present]:  # (in order)
            value = body[field]
            bound, what = limits[field]
            if isinstance(value, (list, dict)) and len(value) > bound:
                raise _refuse(field, f"{len(value)} {what}; at most {bound} ({setting})")
    input_ids = body.get("input_ids")
    if isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list) and len(input_ids) > bounds.max_prompts:
        raise _refuse("input_ids", f"{len(input_ids)} prompts; at most {bounds.max_prompts} ({setting})")
    return _check_grammars(body, bounds, setting)


# route path -> (the bounds they were read from, each list field's name -> (bound, what it counts), in the order
# checked); one entry per route of the table, replaced when other bounds are given
_LIMITS: dict[str, tuple[RequestBounds, dict[str, tuple[int, str]]]] = {}


def _list_limits(path: str, bounds: RequestBounds) -> dict[str, tuple[int, str]]:
    """The list fields of a body for ``path`` with their bounds, read once per route and bounds (every request looked
    each of them up, eight calls, though most requests carry one of these lists)."""
    known = _LIMITS.get(path)
    if known is not None and known[0] is bounds:
        return known[1]
    limits = [(field, bounds.max_inputs, "entries") for field in _INPUT_LISTS.get(path, ())]
    if path not in _INPUT_LISTS:
        limits += [(field, bounds.max_messages, "messages or input items") for field in ("messages", "input")]
    limits.append(("tools", bounds.max_tools, "tools"))
    limits += [(field, bounds.max_stop, "entries") for field in ("stop", "stop_sequences", "stop_regex")]
    limits += [(field, bounds.max_token_list, "entries") for field in ("stop_token_ids", "logit_bias")]
    checked = {field: (bound, what) for field, bound, what in limits}
    _LIMITS[path] = (bounds, checked)
    return checked


# Every field grammar_inputs looks into.
_GRAMMAR_FIELDS = frozenset({"regex", "ebnf", "json_schema", "stop_regex", "response_format", "text", "output_config", "tools"})


def grammar_inputs(body: dict[str, Any]) -> Iterator[tuple[str, str, Any]]:
    """(field, kind, value) of every grammar the engine would compile for ``body``: kind is ``regex``,
    ``ebnf``, ``json_schema``, ``structural_tag`` or ``stop_regex`` (matched by Python's re, not compiled)."""
    if _GRAMMAR_FIELDS.isdisjoint(body):  # most requests carry none: one set operation, not a look at each field
        return
    for field in ("regex", "ebnf"):
        if isinstance(body.get(field), str):
            yield field, field, body[field]
    if isinstance(body.get("json_schema"), str):
        yield "json_schema", "json_schema", body["json_schema"]
    stop_regex = body.get("stop_regex")
    for pattern in [stop_regex] if isinstance(stop_regex, str) else stop_regex if isinstance(stop_regex, list) else []:
        yield "stop_regex", "stop_regex", pattern
    formats = (
        ("response_format", body.get("response_format")),
        ("text.format", (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None),
        ("output_config.format", (body.get("output_config") or {}).get("format") if isinstance(body.get("output_config"), dict) else None),
    )
    for field, spec in formats:
        if not isinstance(spec, dict):
            continue
        kind = spec.get("type")
        if kind == "json_schema":
            inner = spec.get("json_schema") if isinstance(spec.get("json_schema"), dict) else spec
            yield field, "json_schema", inner.get("schema", {})
        elif kind == "json_object":
            yield field, "json_object", {}
        elif kind == "structural_tag":
            yield field, "structural_tag", spec
    tools = body.get("tools")
    if not isinstance(tools, list):
        return
    # A forced call is held to every tool's parameter schema (engine_guard.tool_calls marks them strict), a strict
    # tool's always: the engine compiles each into its grammar. (Comprehensions: an agent's request has many tools,
    # and this runs twice per request.)
    functions = [tool["function"] if isinstance(tool.get("function"), dict) else tool for tool in tools if isinstance(tool, dict)]
    if body.get("tool_choice") in (None, "auto", "none"):
        functions = [function for function in functions if is_strict(function)]
    for function in functions:
        schema = function.get("parameters", function.get("input_schema"))
        if isinstance(schema, dict):
            yield "tools", "json_schema", schema


def grammar_bytes(body: dict[str, Any]) -> int:
    """Bytes of the grammars the engine compiles for ``body`` (what decides if it takes a grammar slot)."""
    return sum(_size(value) for _, kind, value in grammar_inputs(body) if kind != "stop_regex")


def _size(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode())
    try:
        return len(orjson.dumps(value))
    except TypeError:  # an integer past 64 bits (a Python caller's, on the MLflow path): json writes it
        return len(json.dumps(value, default=str))


def _check_grammars(body: dict[str, Any], bounds: RequestBounds, setting: str) -> int:
    """Check every grammar of ``body``; returns the bytes of those the engine compiles (as :func:`grammar_bytes`)."""
    compiled = 0
    for field, kind, value in grammar_inputs(body):
        size = _size(value)
        if kind != "stop_regex":
            compiled += size
        if size > bounds.max_grammar_bytes:
            raise _refuse(field, f"a {kind} of {size} bytes; at most {bounds.max_grammar_bytes} ({setting}.max_grammar_bytes)")
        try:
            if kind == "stop_regex":
                check_stop_regex(value)
            elif kind == "regex":
                check_regex(value)
            elif kind == "ebnf":
                check_ebnf(value)
            elif kind == "json_schema":
                schema = value
                if isinstance(value, str):
                    try:
                        schema = orjson.loads(value)
                    except orjson.JSONDecodeError as error:
                        raise GrammarProblem(f"not valid JSON: {error}") from None
                check_json_schema(schema, max_depth=bounds.max_schema_depth, max_enum=bounds.max_enum_values)
            elif kind == "structural_tag":
                check_structural_tag(value)
        except GrammarProblem as problem:
            raise _refuse(field, str(problem), code="invalid_grammar") from None
    return compiled
