"""Strict tool arguments are guaranteed, not hoped for: a property test over generated JSON schemas.

For each generated parameters schema, a ``strict: true`` function is forced (``tool_choice`` naming it) through the
gateway to the real CPU engine running the tiny random-weight model: a model with no idea what the tool is for, so
only the engine's grammar stands between it and invalid arguments. Every returned argument string must validate
against its schema (``jsonschema``). Strings and arrays are bounded (``maxLength``, ``maxItems``) and integers ranged,
so that an answer always fits its ``max_tokens``; ``number`` is left out for the same reason (its digits are unbounded).
Strings are bounded by patterns, not ``minLength``/``maxLength``: the engine's grammar (xgrammar) lets a free string
carry raw control characters, which random weights write and no JSON parser takes (the call is then lost), and it
drops length bounds beside a pattern (the guard refuses that pair). A real model writes neither.

A schema with a keyword the engine's grammar does not hold is refused before the engine, naming the keyword.

``SGLANG_GATEWAY_STRICT_EXAMPLES=N`` sets the number of schemas (default 12, for the suite's budget: after its call a
forced answer runs on to ``max_tokens``; the closing note's run used 80).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_guard.tool_calls import ENFORCED_KEYWORDS
from launch.process import EngineProcess
from tests.gateway_server import GatewayServer, serve

EXAMPLES = int(os.environ.get("SGLANG_GATEWAY_STRICT_EXAMPLES", "12"))
NAMES = st.sampled_from(["city", "count", "tags", "ok", "mode", "item", "when", "x"])


def leaf_schemas() -> st.SearchStrategy[dict[str, Any]]:
    bounded_string = st.builds(
        lambda low, extra: {"type": "string", "pattern": f"^[a-zA-Z ]{{{low},{low + extra}}}$"}, st.integers(0, 3), st.integers(0, 5)
    )
    patterned = st.sampled_from([{"type": "string", "pattern": "^[0-9]{2}-[0-9]{2}$"}, {"type": "string", "pattern": "^(on|off)$"}])
    integer = st.builds(lambda low, span: {"type": "integer", "minimum": low, "maximum": low + span},
                        st.integers(-50, 50), st.integers(0, 100))
    return st.one_of(
        bounded_string, patterned, integer, st.just({"type": "boolean"}),
        st.lists(st.sampled_from(["red", "green", "blue", "grey"]), min_size=1, max_size=4, unique=True).map(lambda v: {"enum": v}),
        st.sampled_from([{"const": "fixed"}, {"const": 3}, {"type": "null"}]),
    )


def schemas() -> st.SearchStrategy[dict[str, Any]]:
    def extend(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
        array = st.builds(lambda item, top: {"type": "array", "items": item, "maxItems": top}, children, st.integers(0, 3))
        any_of = st.lists(children, min_size=2, max_size=3).map(lambda options: {"anyOf": options})
        return st.one_of(array, any_of, objects(children))

    return objects(st.recursive(leaf_schemas(), extend, max_leaves=6))


def objects(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    def build(properties: dict[str, Any], required: list[str], closed: bool) -> dict[str, Any]:
        schema = {"type": "object", "properties": properties, "required": sorted(set(required) & set(properties))}
        return {**schema, "additionalProperties": False} if closed else schema

    return st.builds(build, st.dictionaries(NAMES, children, min_size=1, max_size=3), st.lists(NAMES), st.booleans())


@pytest.fixture(scope="module")
def gateway(tiny_engine: EngineProcess) -> Iterator[GatewayServer]:
    with serve({"tiny": {"url": tiny_engine.url}}) as server:
        yield server


def forced(schema: dict[str, Any]) -> dict[str, Any]:
    function = {"name": "act", "description": "Act.", "parameters": schema, "strict": True}
    return {"model": "tiny", "messages": [{"role": "user", "content": "Go."}], "max_tokens": 300, "temperature": 1.0,
            "tools": [{"type": "function", "function": function}], "tool_choice": {"type": "function", "function": {"name": "act"}}}


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=schemas())
def test_every_strict_tools_arguments_validate_against_its_schema(gateway: GatewayServer, schema: dict[str, Any]) -> None:
    answer = httpx.post(gateway.url + "/v1/chat/completions", json=forced(schema), timeout=120)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    calls = choice["message"]["tool_calls"] or []
    assert calls, (schema, choice)  # forced: at least one call, whatever the model goes on to write after it
    for call in calls:
        assert call["function"]["name"] == "act"
        jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
    if os.environ.get("SGLANG_GATEWAY_STRICT_LOG"):  # the closing note's count: schemas and calls, one line each
        with open(os.environ["SGLANG_GATEWAY_STRICT_LOG"], "a") as log:
            log.write(json.dumps({"calls": len(calls)}) + "\n")


@pytest.mark.parametrize(
    "keyword, schema",
    [
        ("multipleOf", {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 7}}}),
        ("oneOf", {"type": "object", "properties": {"v": {"oneOf": [{"type": "integer"}, {"minimum": 0}]}}}),
        ("not", {"type": "object", "properties": {"v": {"not": {"type": "string"}}}}),
        ("uniqueItems", {"type": "object", "properties": {"v": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}),
        ("if", {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}),
        ("maxLength", {"type": "object", "properties": {"v": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}}}),
    ],
)
def test_a_strict_schema_the_engine_cannot_hold_is_refused_naming_the_keyword(gateway: GatewayServer, keyword: str, schema: dict[str, Any]) -> None:
    assert keyword not in ENFORCED_KEYWORDS or "pattern" in json.dumps(schema)
    answer = httpx.post(gateway.url + "/v1/chat/completions", json=forced(schema), timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert repr(keyword) in error["message"] and error["code"] == "invalid_grammar" and error["param"] == "tools", error
    loose = forced(schema)
    loose["tools"][0]["function"].pop("strict")
    loose["tool_choice"] = "none"
    loose["max_tokens"] = 4
    assert httpx.post(gateway.url + "/v1/chat/completions", json=loose, timeout=60).status_code == 200  # not strict: not refused
