"""engine_guard.tool_calls on its own: which requests are held and how, and malformed tools left to the engine's own
400 (the gateway fuzz found a forced choice with no tool list answered 500 by the rewrite)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from engine_guard.bounds import grammar_bytes
from engine_guard.tool_calls import (
    CALL_ENDS,
    check_strict_schemas,
    end_forced_call,
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
