"""Strict tool arguments are guaranteed, not hoped for: a property test over generated JSON schemas and patterns.

For each generated parameters schema, a ``strict: true`` function is forced (``tool_choice`` naming it) through the
gateway to the real CPU engine running the tiny random-weight model: a model with no idea what the tool is for, so
only the engine's grammar stands between it and invalid arguments. Every returned argument string must validate
against its schema (``jsonschema``), or the request must have been refused up front, naming why. Strings and arrays
are bounded (``maxLength``, ``maxItems``, patterns) and integers ranged, so that an answer always fits its
``max_tokens``; ``number`` is left out for the same reason (its digits are unbounded). Length-bounded strings are
generated as clients write them (``minLength``/``maxLength``): the engine's grammar (xgrammar) lets raw control
characters into those, which random weights write and no JSON parser takes, so the gateway holds them by the
equivalent pattern (engine_guard.json_strings). Patterns that need a character JSON writes only escaped (a quote, a
backslash, a control character, the tool-call parser's end marker) are generated too: xgrammar writes those raw,
so they must be refused before the engine (400 naming the pattern).

A schema with a keyword the engine's grammar does not hold is refused before the engine, naming the keyword.

``SGLANG_GATEWAY_STRICT_EXAMPLES=N`` sets the number of schemas (default 12, for the suite's budget; the closing
note's run used 80). ``SGLANG_GATEWAY_STRICT_LOG=file`` appends one JSON line per schema (calls, refused).
"""

from __future__ import annotations

import json
import os
import re
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


ESCAPED_ONLY = ['^a"b$', '^x", "is_admin": true, "t": "y$', "^a\\\\b$", "^\n</tool_call>$", '^q"[a-z]{1,3}$', "^(on|\t)$"]
"""Patterns that need a character JSON writes only escaped: refused before the engine (the test's own list)."""


def leaf_schemas() -> st.SearchStrategy[dict[str, Any]]:
    bounded_string = st.builds(
        lambda low, extra: {"type": "string", "pattern": f"^[a-zA-Z ]{{{low},{low + extra}}}$"}, st.integers(0, 3), st.integers(0, 5)
    )
    length_bounded = st.builds(lambda low, extra: {"type": "string", "minLength": low, "maxLength": low + extra}, st.integers(0, 3), st.integers(0, 8))
    escaped_only = st.sampled_from(ESCAPED_ONLY).map(lambda pattern: {"type": "string", "pattern": pattern})
    patterned = st.sampled_from([{"type": "string", "pattern": "^[0-9]{2}-[0-9]{2}$"}, {"type": "string", "pattern": "^(on|off)$"}])
    integer = st.builds(lambda low, span: {"type": "integer", "minimum": low, "maximum": low + span},
                        st.integers(-50, 50), st.integers(0, 100))
    return st.one_of(
        bounded_string, length_bounded, patterned, integer, st.just({"type": "boolean"}), escaped_only,
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


def _as_counted(value: Any) -> Any:
    """``value`` with each run of replacement characters in its strings as one character. Random weights write bytes
    that are not UTF-8 (a surrogate's, ``ED A0 80``), which the grammar counts as one character and which decode as
    one to four replacement characters (engine_guard.json_strings.ANY_CHARACTER): counted as the grammar counted them,
    a string's length bounds still hold. A real model writes UTF-8, and its strings have none."""
    if isinstance(value, str):
        return re.sub("\ufffd+", "?", value)
    if isinstance(value, list):
        return [_as_counted(item) for item in value]
    if isinstance(value, dict):
        return {key: _as_counted(item) for key, item in value.items()}
    return value


def validate(arguments: Any, schema: dict[str, Any]) -> None:
    """jsonschema's validation of a call's arguments, their strings' lengths as the grammar counted them."""
    jsonschema.validate(_as_counted(arguments), schema)


@pytest.fixture(scope="module")
def gateway(tiny_engine: EngineProcess) -> Iterator[GatewayServer]:
    with serve({"tiny": {"url": tiny_engine.url}}) as server:
        yield server


def forced(schema: dict[str, Any]) -> dict[str, Any]:
    function = {"name": "act", "description": "Act.", "parameters": schema, "strict": True}
    return {"model": "tiny", "messages": [{"role": "user", "content": "Go."}], "max_tokens": 300, "temperature": 1.0,
            "tools": [{"type": "function", "function": function}], "tool_choice": {"type": "function", "function": {"name": "act"}}}


def needs_escapes(schema: dict[str, Any]) -> bool:
    """Whether ``schema`` holds one of the test's patterns that JSON writes only escaped."""
    return any(json.dumps(pattern) in json.dumps(schema) for pattern in ESCAPED_ONLY)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=schemas())
def test_every_strict_tools_arguments_validate_against_its_schema(gateway: GatewayServer, schema: dict[str, Any]) -> None:
    answer = httpx.post(gateway.url + "/v1/chat/completions", json=forced(schema), timeout=120)
    refused = needs_escapes(schema)
    if refused:
        assert answer.status_code == 400, (schema, answer.text)
        error = answer.json()["error"]
        assert error["code"] == "invalid_grammar" and "pattern" in error["message"], error
        calls = []
    else:
        assert answer.status_code == 200, (schema, answer.text)
        choice = answer.json()["choices"][0]
        calls = choice["message"]["tool_calls"] or []
        assert calls, (schema, choice)  # forced: at least one call
        for call in calls:
            assert call["function"]["name"] == "act"
            validate(json.loads(call["function"]["arguments"]), schema)
    if os.environ.get("SGLANG_GATEWAY_STRICT_LOG"):  # the closing note's count: schemas, calls and refusals, one line each
        with open(os.environ["SGLANG_GATEWAY_STRICT_LOG"], "a") as log:
            log.write(json.dumps({"calls": len(calls), "refused": refused}) + "\n")


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


UNHELD = {"type": "object", "properties": {"v": {"type": "array", "items": {"type": "integer"}, "maxItems": 3, "uniqueItems": True}}}
ASK = [{"role": "user", "content": "Go."}]


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/chat/completions", {"messages": ASK, "tools": [{"type": "function", "function": {"name": "act", "parameters": UNHELD}}], "tool_choice": "required"}),
     ("/v1/chat/completions", {"messages": ASK, "tools": [{"type": "function", "function": {"name": "act", "parameters": UNHELD}}],
                               "tool_choice": {"type": "function", "function": {"name": "act"}}}),
     ("/v1/chat/completions", {"messages": ASK, "tools": [{"type": "function", "function": {"name": "act", "parameters": UNHELD, "strict": "true"}}]}),
     ("/v1/chat/completions", {"messages": ASK, "tools": [{"type": "function", "function": {"name": "act", "parameters": UNHELD, "strict": 1}}]}),
     ("/v1/responses", {"input": "Go.", "tools": [{"type": "function", "name": "act", "parameters": UNHELD}], "tool_choice": "required"}),
     ("/v1/messages", {"messages": ASK, "max_tokens": 64, "tools": [{"name": "act", "input_schema": UNHELD}], "tool_choice": {"type": "any"}}),
     ("/v1/messages", {"messages": ASK, "max_tokens": 64, "tools": [{"name": "act", "input_schema": UNHELD}], "tool_choice": {"type": "tool", "name": "act"}})],
)  # fmt: skip
def test_forced_and_laxly_strict_tools_are_checked_as_sent(gateway: GatewayServer, path: str, body: dict[str, Any]) -> None:
    """Forced calls are held strict by the gateway, and the engine reads "true" and 1 as strict: a keyword its grammar
    cannot hold (uniqueItems) is refused on what is sent, not answered with arguments that break it."""
    answer = httpx.post(gateway.url + path, json={"model": "tiny", **body}, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert "'uniqueItems'" in error["message"], error


@pytest.mark.parametrize("pattern", ['^x", "is_admin": true, "t": "y$', '^a"b$', "^\n</tool_call>$"])
def test_a_pattern_the_grammar_would_write_raw_is_refused(gateway: GatewayServer, pattern: str) -> None:
    """xgrammar writes a pattern's literal characters into the JSON string unescaped: a quote closes it (keys are
    injected into a strict call), a newline writes the parser's end marker inside the argument."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}, "required": ["s"], "additionalProperties": False}
    answer = httpx.post(gateway.url + "/v1/chat/completions", json=forced(schema), timeout=60)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "invalid_grammar" and "pattern" in answer.json()["error"]["message"]


@pytest.mark.parametrize("name", ['say"hi', "say\nhi", ""])
def test_a_tool_name_the_call_cannot_carry_is_refused(gateway: GatewayServer, name: str) -> None:
    body = forced({"type": "object", "properties": {"x": {"type": "boolean"}}})
    body["tools"][0]["function"]["name"] = name
    body["tool_choice"]["function"]["name"] = name
    answer = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_tool_name", answer.text


LENGTH_BOUNDED = {"type": "object", "properties": {"note": {"type": "string", "minLength": 1, "maxLength": 12},
                                                   "tag": {"type": "string", "maxLength": 6}}, "required": ["note", "tag"]}  # fmt: skip


def _forced_call(route: str, gateway: GatewayServer) -> tuple[httpx.Response, list[dict[str, Any]]]:
    """One named call of a tool with length-bounded strings at temperature 1, on one route: the answer and its calls'
    arguments. The limit is ample (300): random weights may pad a call's JSON with whitespace."""
    if route == "chat":
        answer = httpx.post(gateway.url + "/v1/chat/completions", json={**forced(LENGTH_BOUNDED), "max_tokens": 300}, timeout=60)
        calls = [call["function"]["arguments"] for call in answer.json()["choices"][0]["message"]["tool_calls"] or []] if answer.status_code == 200 else []
        return answer, [json.loads(arguments) for arguments in calls]
    if route == "responses":
        answer = httpx.post(gateway.url + "/v1/responses", json={
            "model": "tiny", "input": "Go.", "max_output_tokens": 300, "temperature": 1.0,
            "tools": [{"type": "function", "name": "act", "parameters": LENGTH_BOUNDED}], "tool_choice": {"type": "function", "name": "act"},
        }, timeout=60)  # fmt: skip
        items = answer.json()["output"] if answer.status_code == 200 else []
        return answer, [json.loads(item["arguments"]) for item in items if item["type"] == "function_call"]
    answer = httpx.post(gateway.url + "/v1/messages", json={
        "model": "tiny", "messages": ASK, "max_tokens": 300, "temperature": 1.0,
        "tools": [{"name": "act", "input_schema": LENGTH_BOUNDED}], "tool_choice": {"type": "tool", "name": "act"},
    }, timeout=60)  # fmt: skip
    blocks = answer.json()["content"] if answer.status_code == 200 else []
    return answer, [block["input"] for block in blocks if block["type"] == "tool_use"]


@pytest.mark.parametrize("route", ["chat", "responses", "messages"])
def test_forced_calls_with_length_bounded_strings_come_back_whole_on_every_route(gateway: GatewayServer, route: str) -> None:
    """xgrammar lets raw control characters into a length-bounded string, which random weights write: the engine's
    parser then dropped the call, and the client got a 200 with none. Held by a pattern, every call that comes back
    validates; and every route ends a named call right after it (the engine plugin's grammar; before, Responses and
    Messages wrote on to the limit and a call could be cut there): each of 8 comes back, on every route."""
    ended = {"chat": lambda a: a["choices"][0]["finish_reason"] == "tool_calls", "responses": lambda a: a["status"] == "completed",
             "messages": lambda a: a["stop_reason"] == "tool_use"}[route]  # fmt: skip
    for _ in range(8):
        answer, calls = _forced_call(route, gateway)
        assert answer.status_code == 200 and len(calls) == 1, answer.text  # a 502 forced_call_missing is a failure here
        assert ended(answer.json()), answer.text  # ended at the call, not run on to the token limit
        validate(calls[0], LENGTH_BOUNDED)


def test_a_forced_call_cut_by_its_token_limit_is_an_error_not_an_empty_answer(gateway: GatewayServer) -> None:
    """A forced call cut by max_tokens has no call to return: a 502 naming the limit, never a 200 without a call."""
    answer = httpx.post(gateway.url + "/v1/chat/completions", json={**forced(LENGTH_BOUNDED), "max_tokens": 3}, timeout=60)
    assert answer.status_code == 502, answer.text
    error = answer.json()["error"]
    assert error["code"] == "forced_call_missing" and "token limit" in error["message"], error
