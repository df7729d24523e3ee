"""engine_guard.tool_calls on its own: which requests are held and how, and malformed tools left to the engine's own
400 (the gateway fuzz found a forced choice with no tool list answered 500 by the rewrite)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from engine_guard.bounds import RequestBounds, check_bounds, grammar_bytes
from engine_guard.json_strings import ANY_CHARACTER
from engine_guard.tool_calls import (
    CALL_ENDS,
    check_strict_schemas,
    end_forced_call,
    forced_call_problem,
    guard_tools,
    hold_forced_calls,
    offers_tools,
)  # fmt: skip

CHAT = "/v1/chat/completions"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}


def _chat_tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": SCHEMA}}


@pytest.mark.parametrize("tools", [None, "x", 5, [1, "a"], {}, []])
def test_a_forced_choice_with_no_usable_tools_is_left_to_the_engine(tools: Any) -> None:
    body = {"tool_choice": "required", "tools": tools}
    before = copy.deepcopy(body)
    hold_forced_calls(CHAT, body)
    assert body == before


def test_a_named_choice_offers_that_tool_alone_strict_and_the_callers_tools_are_untouched() -> None:
    tools = [_chat_tool("a"), _chat_tool("b")]
    body = {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "b"}}}
    hold_forced_calls(CHAT, body)
    assert body["tools"] == [{"type": "function", "function": {"name": "b", "parameters": SCHEMA, "strict": True}}]
    assert tools == [_chat_tool("a"), _chat_tool("b")]  # copies were changed, not the caller's


def test_required_marks_every_tool_strict_and_auto_or_none_change_nothing() -> None:
    body = {"tools": [_chat_tool("a"), _chat_tool("b")], "tool_choice": "required"}
    hold_forced_calls(CHAT, body)
    assert [tool["function"]["strict"] for tool in body["tools"]] == [True, True]
    for choice in ("auto", "none", None):
        body = {"tools": [_chat_tool("a")], **({"tool_choice": choice} if choice else {})}
        hold_forced_calls(CHAT, body)
        assert "strict" not in body["tools"][0]["function"]


def test_anthropic_and_responses_spellings() -> None:
    body = {"tools": [{"name": "a", "input_schema": SCHEMA}, {"name": "b", "input_schema": SCHEMA}], "tool_choice": {"type": "tool", "name": "a"}}
    hold_forced_calls("/v1/messages", body)
    assert body["tools"] == [{"name": "a", "input_schema": SCHEMA, "strict": True}]
    body = {"tools": [{"type": "function", "name": "a", "parameters": SCHEMA}], "tool_choice": "required"}
    hold_forced_calls("/v1/responses", body)
    assert body["tools"][0]["strict"] is True
    assert not offers_tools("/v1/messages", {"tools": [{"name": "a"}], "tool_choice": {"type": "none"}})
    assert offers_tools("/v1/messages", {"tools": [{"name": "a"}]})


def test_a_strict_schema_is_checked_only_when_strict() -> None:
    loose = {"tools": [{"type": "function", "function": {"name": "a", "parameters": {"type": "integer", "multipleOf": 3}}}]}
    check_strict_schemas(CHAT, loose)  # not strict: not refused
    loose["tools"][0]["function"]["strict"] = True
    with pytest.raises(ValueError, match="'multipleOf'"):
        check_strict_schemas(CHAT, loose)


def test_a_grammar_with_an_integer_past_64_bits_is_measured_not_crashed_on() -> None:
    """orjson writes no integer past 64 bits; a Python caller (the MLflow path) can pass one (the MLflow fuzz found it)."""
    body = {"response_format": {"type": "structural_tag", "structures": [-(2**63) - 1], "triggers": []}}
    assert grammar_bytes(body) > 0


NAMED = {"type": "function", "function": {"name": "a"}}
END = CALL_ENDS["qwen25"]


@pytest.mark.parametrize(
    ("extra", "stop"),
    [({"tool_choice": NAMED}, [END]), ({"tool_choice": NAMED, "stop": "x"}, ["x", END]),
     ({"tool_choice": NAMED, "stop": ["x", END]}, ["x", END]),
     ({"tool_choice": "required", "parallel_tool_calls": False, "stop": ["x", "y"]}, ["x", "y", END])],
)  # fmt: skip
def test_a_call_that_must_come_alone_stops_after_its_end_marker_kept_for_the_parser(
    extra: dict[str, Any], stop: list[str]
) -> None:
    """Named, or required with one call allowed: the engine stops on the parser's end-of-call text, left in the
    output (no_stop_trim) so the parser reads the call; the caller's own stop strings kept, first."""
    body = {"tools": [_chat_tool("a"), _chat_tool("b")], **extra}
    guard_tools(CHAT, body, "m", "qwen25", parser_known=True)
    assert body["stop"] == stop and body["no_stop_trim"] is True


@pytest.mark.parametrize(
    ("path", "parser", "extra"),
    [(CHAT, "qwen25", {"tool_choice": "required"}),  # several calls may come: a stop would cut them off
     (CHAT, "qwen25", {"tool_choice": "required", "parallel_tool_calls": True}),
     (CHAT, "qwen25", {"tool_choice": "auto"}), (CHAT, "qwen25", {}), (CHAT, "qwen25", {"tool_choice": "none"}),
     (CHAT, "qwen25", {"tool_choice": {"type": "function", "function": {"name": "missing"}}}),  # the engine's own 400
     (CHAT, "qwen25", {"tool_choice": NAMED, "stop": 5}),
     (CHAT, "hermes", {"tool_choice": NAMED}), (CHAT, None, {"tool_choice": NAMED}),  # parsers not verified: unchanged
     ("/v1/responses", "qwen25", {"tool_choice": {"type": "function", "name": "a"}}),  # no no_stop_trim on the route
     ("/v1/messages", "qwen25", {"tool_choice": {"type": "tool", "name": "a"}})],
)  # fmt: skip
def test_other_requests_keep_their_stops(path: str, parser: str | None, extra: dict[str, Any]) -> None:
    body = {"tools": [_chat_tool("a")], **extra}
    before = copy.deepcopy(body)
    end_forced_call(path, body, parser)
    assert body == before


UNHELD = {"type": "object", "properties": {"v": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}


@pytest.mark.parametrize(
    ("path", "body"),
    [(CHAT, {"tools": [{"type": "function", "function": {"name": "a", "parameters": UNHELD}}], "tool_choice": "required"}),
     (CHAT, {"tools": [{"type": "function", "function": {"name": "a", "parameters": UNHELD}}], "tool_choice": NAMED}),
     (CHAT, {"tools": [{"type": "function", "function": {"name": "a", "parameters": UNHELD, "strict": "true"}}]}),
     (CHAT, {"tools": [{"type": "function", "function": {"name": "a", "parameters": UNHELD, "strict": 1}}]}),
     ("/v1/responses", {"tools": [{"type": "function", "name": "a", "parameters": UNHELD}], "tool_choice": "required"}),
     ("/v1/messages", {"tools": [{"name": "a", "input_schema": UNHELD}], "tool_choice": {"type": "any"}}),
     ("/v1/messages", {"tools": [{"name": "a", "input_schema": UNHELD}], "tool_choice": {"type": "tool", "name": "a"}})],
)  # fmt: skip
def test_what_is_sent_strict_is_checked_forced_and_laxly_strict_tools_included(path: str, body: dict[str, Any]) -> None:
    """A forced call is made strict by the guard, and SGLang reads ``"true"`` and ``1`` as strict: each is held to
    its schema by the grammar, so a keyword the grammar cannot hold is refused on what is sent."""
    with pytest.raises(ValueError, match="'uniqueItems'"):
        guard_tools(path, body, "m", "qwen25", parser_known=True)


@pytest.mark.parametrize("strict", [False, "false", 0, None])
def test_a_tool_the_engine_reads_as_not_strict_is_not_checked(strict: Any) -> None:
    body = {"tools": [{"type": "function", "function": {"name": "a", "parameters": UNHELD, "strict": strict}}]}
    guard_tools(CHAT, body, "m", "qwen25", parser_known=True)


@pytest.mark.parametrize("name", ['a"b', "a\\b", "a\nb", "", "x" * 65, "get weather", "ça"])
@pytest.mark.parametrize("path", [CHAT, "/v1/responses", "/v1/messages"])
def test_a_tool_name_the_call_cannot_carry_is_refused_naming_it(path: str, name: str) -> None:
    def tool(called: str) -> dict[str, Any]:
        if path == "/v1/messages":
            return {"name": called, "input_schema": SCHEMA}
        return {"type": "function", "name": called, "parameters": SCHEMA} if path == "/v1/responses" else _chat_tool(called)

    with pytest.raises(ValueError, match="not a valid tool name") as refused:
        guard_tools(path, {"tools": [tool(name)]}, "m", "qwen25", parser_known=True)
    assert refused.value.code == "invalid_tool_name"  # type: ignore[attr-defined]
    guard_tools(path, {"tools": [tool("get_weather-2")]}, "m", "qwen25", parser_known=True)


def test_length_bounded_strings_of_what_is_compiled_are_held_by_a_pattern_on_copies() -> None:
    """xgrammar lets raw control characters into a length-bounded string: its bounds become ``^.{min,max}$``,
    which it holds to JSON string content, in every schema the engine compiles (and in those only)."""
    bounded = {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 9}, "t": {"type": "string", "maxLength": 4}}}
    held = {"type": "object", "properties": {"s": {"type": "string", "pattern": f"^{ANY_CHARACTER}{{2,9}}$"}, "t": {"type": "string", "pattern": f"^{ANY_CHARACTER}{{0,4}}$"}}}
    tools = [{"type": "function", "function": {"name": "a", "parameters": bounded}}, {"type": "function", "function": {"name": "b", "parameters": bounded}}]
    original = copy.deepcopy(tools)
    body = {"tools": tools, "tool_choice": NAMED, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": bounded}}}
    guard_tools(CHAT, body, "m", "qwen25", parser_known=True)
    assert body["tools"][0]["function"]["parameters"] == held and body["response_format"]["json_schema"]["schema"] == held
    assert tools == original  # the caller's objects are left as they were
    auto = {"tools": copy.deepcopy(original)}  # offered, not forced and not strict: not compiled, not changed
    guard_tools(CHAT, auto, "m", "qwen25", parser_known=True)
    assert auto["tools"] == original
    for untouched in ({"type": "string", "maxLength": 3, "enum": ["ab"]}, {"type": "string", "pattern": "^a$"}, {"type": "integer", "maximum": 3}):
        body = {"json_schema": json.dumps(untouched)}
        guard_tools("/v1/completions", body, "m", None, parser_known=False)
        assert json.loads(body["json_schema"]) == untouched
    body = {"json_schema": json.dumps({"type": "string", "maxLength": 3})}
    guard_tools("/v1/completions", body, "m", None, parser_known=False)
    assert json.loads(body["json_schema"]) == {"type": "string", "pattern": f"^{ANY_CHARACTER}{{0,3}}$"}
    body = {"text": {"format": {"type": "json_schema", "name": "x", "schema": bounded}}}
    guard_tools("/v1/responses", body, "m", None, parser_known=False)
    assert body["text"]["format"]["schema"] == held


@pytest.mark.parametrize(
    ("pattern", "refused"),
    [('^x", "is_admin": true, "t": "y$', True), ('^a"b$', True), ("^\n</tool_call>$", True), ("^a\\\\b$", True),
     ('^q"[a-z]{1,3}$', True), ("^(ab|\\t)$", True), ('["]', True),
     ("^[a-z]{1,8}$", False), ('^[^"]{1,8}$', False), ("^\\s\\w$", False), ("^(on|off)$", False), ("^[0-9]{2}-[0-9]{2}$", False)],
)  # fmt: skip
def test_a_pattern_that_needs_a_character_json_escapes_is_refused(pattern: str, refused: bool) -> None:
    """The engine's grammar writes a pattern's literal characters raw into the JSON string (a quote closes it)."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}, "additionalProperties": False}
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    if refused:
        with pytest.raises(ValueError, match="pattern") as problem:
            check_bounds(CHAT, body, RequestBounds())
        assert problem.value.code == "invalid_grammar"  # type: ignore[attr-defined]
    else:
        check_bounds(CHAT, body, RequestBounds())


@pytest.mark.parametrize(
    ("path", "body", "answer", "problem"),
    [(CHAT, {"tool_choice": "required"}, {"choices": [{"message": {"content": "x"}, "finish_reason": "stop"}]}, "no tool call"),
     (CHAT, {"tool_choice": NAMED}, {"choices": [{"message": {"tool_calls": None}, "finish_reason": "length"}]}, "token limit"),
     (CHAT, {"tool_choice": NAMED}, {"choices": [{"message": {"tool_calls": [{"id": "1"}]}, "finish_reason": "tool_calls"}]}, None),
     (CHAT, {"tool_choice": "auto"}, {"choices": [{"message": {"content": "x"}, "finish_reason": "stop"}]}, None),
     (CHAT, {"tool_choice": NAMED}, {"choices": [{"message": {"content": "x"}, "finish_reason": "stop", "matched_stop": "arguments"}]}, None),
     (CHAT, {"tool_choice": NAMED}, {"choices": [{"message": {"content": "x"}, "finish_reason": "stop", "matched_stop": END}]}, "no tool call"),
     ("/v1/messages", {"tool_choice": {"type": "any"}}, {"content": [{"type": "text"}], "stop_reason": "stop_sequence"}, None),
     ("/v1/responses", {"tool_choice": "required"}, {"output": [], "status": "completed"}, "no tool call"),
     ("/v1/responses", {"tool_choice": "required"}, {"output": [{"type": "message"}], "status": "incomplete"}, "token limit"),
     ("/v1/responses", {"tool_choice": "required"}, {"output": [{"type": "function_call"}], "status": "completed"}, None),
     ("/v1/messages", {"tool_choice": {"type": "any"}}, {"content": [{"type": "text"}], "stop_reason": "end_turn"}, "no tool call"),
     ("/v1/messages", {"tool_choice": {"type": "any"}}, {"content": [{"type": "tool_use"}], "stop_reason": "tool_use"}, None)],
)  # fmt: skip
def test_a_forced_choice_answered_without_a_call_is_named(path: str, body: dict[str, Any], answer: dict[str, Any], problem: str | None) -> None:
    tool = {"name": "a", "input_schema": SCHEMA} if path == "/v1/messages" else (
        {"type": "function", "name": "a", "parameters": SCHEMA} if path == "/v1/responses" else _chat_tool("a"))  # fmt: skip
    found = forced_call_problem(path, {**body, "tools": [tool]}, answer)
    assert (found is None) if problem is None else (found is not None and problem in found)


def test_the_call_ends_are_sglangs_own_markers_for_every_parser_whose_marker_no_held_call_can_write_early() -> None:
    """CALL_ENDS as SGLang's detectors define it: each shipped parser's ``eot_token`` where its grammar ends a call
    with it and it holds a newline (a JSON string cannot hold one raw, so the stop cannot cut a call early); every
    other parser (``</tool_call>``, ``<|action_end|>``... could be written inside an argument) absent."""
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    expected = {}
    for name, detector_class in FunctionCallParser.ToolCallParserEnum.items():
        try:
            detector = detector_class()
            info = detector.structure_info()("f")
        except Exception:  # noqa: BLE001 - no call grammar of its own (a JSON schema, a template's, a model's tag)
            continue
        marker = detector.eot_token
        if marker and "\n" in marker and info.end.endswith(marker) and marker not in info.begin:
            expected[name] = marker
    assert CALL_ENDS == expected


@pytest.mark.parametrize(("parser", "ends"), [("trinity", True), ("hermes", False), ("llama3", False), (None, False)])
def test_a_call_that_must_come_alone_stops_at_its_parsers_marker_where_it_has_a_safe_one(parser: str | None, ends: bool) -> None:
    """Trinity's calls end as Qwen's do ('\\n</tool_call>'); hermes' '</tool_call>' and llama3's '}' could come inside
    an argument, so no stop is added for them (the engine plugin's grammar ends their calls instead)."""
    body = {"tools": [_chat_tool("a")], "tool_choice": NAMED}
    guard_tools(CHAT, body, "m", parser, parser_known=False)
    assert ("stop" in body) == ends and body.get("no_stop_trim", False) == ends, body
    if ends:
        assert body["stop"] == ["\n</tool_call>"]
