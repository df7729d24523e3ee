"""The allowlist without an engine: every field SGLang reads is classified, unknown ones are refused, extension
fields need the deployment's consent, bounds and grammar checks refuse what would hurt the engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from engine_guard.bounds import RequestBounds, check_bounds, grammar_bytes
from engine_guard.empty_inputs import check_inputs
from engine_guard.fields import DROPPED, EXTENSIONS, REFUSED, extension_table, extensions_for
from engine_guard.grammar_checks import GrammarProblem, check_ebnf, check_json_schema, check_stop_regex
from engine_guard.refusal import Refused
from engine_guard.schemas import check_extensions, parse_body
from gateway.core.endpoints import PROXIED_BY_PATH

EXTENSIONS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "security.md"  # holds the extension table
HELLO = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"


def _parse(path: str, body: dict[str, Any]) -> dict[str, Any]:
    return parse_body(orjson.dumps(body), PROXIED_BY_PATH[path].schema, path)


def _sglang_models() -> dict[str, Any]:
    protocol = pytest.importorskip("sglang.srt.entrypoints.openai.protocol")
    anthropic = pytest.importorskip("sglang.srt.entrypoints.anthropic.protocol")
    return {
        CHAT: protocol.ChatCompletionRequest,
        "/v1/completions": protocol.CompletionRequest,
        "/v1/responses": protocol.ResponsesRequest,
        "/v1/embeddings": protocol.EmbeddingRequest,
        "/v1/score": protocol.ScoringRequest,
        "/v1/classify": protocol.ClassifyRequest,
        "/v1/detokenize": protocol.DetokenizeRequest,
        "/v1/tokenize": protocol.TokenizeRequest,
        "/v1/messages": anthropic.AnthropicMessagesRequest,
        "/v1/messages/count_tokens": anthropic.AnthropicCountTokensRequest,
    }


def test_every_field_sglang_reads_is_classified() -> None:
    """A new SGLang version's new field is refused as unknown until it is classified here: allowed (in the
    route's schema), an extension, dropped or refused."""
    unclassified = {}
    for path, model in _sglang_models().items():
        known = set(PROXIED_BY_PATH[path].schema.model_fields) | extensions_for(path) | DROPPED.get(path, set()) | set(REFUSED.get(path, {}))
        missing = sorted(set(model.model_fields) - known)
        if missing:
            unclassified[path] = missing
    assert not unclassified, unclassified


def test_docs_list_the_extension_fields() -> None:
    assert extension_table() in EXTENSIONS_PAGE.read_text(), (
        "docs/security.md's extension table differs from engine_guard.fields: paste extension_table()"
    )


def test_unknown_fields_are_refused_by_name_and_service_options_dropped() -> None:
    with pytest.raises(Refused) as refused:
        _parse(CHAT, {"model": "m", "messages": HELLO, "max_tokenz": 5})
    assert refused.value.status == 400 and refused.value.param == "max_tokenz" and refused.value.code == "unknown_field"
    body = _parse(CHAT, {"model": "m", "messages": HELLO, "store": True, "service_tier": "auto", "logprobs": "true"})
    assert "store" not in body and "service_tier" not in body and body["logprobs"] == "true"  # lax like SGLang's
    with pytest.raises(Refused) as chosen:
        _parse("/v1/responses", {"model": "m", "input": "hi", "request_id": "resp_x"})
    assert chosen.value.param == "request_id" and chosen.value.code == "unsupported_parameter"


def test_extension_fields_need_the_deployment_and_are_typed_when_on() -> None:
    body = _parse(CHAT, {"model": "m", "messages": HELLO, "input_ids": [1, 2]})
    with pytest.raises(Refused) as off:
        check_extensions(body, CHAT, frozenset(), "m")
    assert off.value.param == "input_ids" and off.value.code == "extension_field_disabled" and "extension_fields.m" in off.value.message
    check_extensions(body, CHAT, frozenset({"input_ids"}), "m")
    for bad in ({"input_ids": []}, {"input_ids": ["x"]}, {"rid": "../../flush_cache"}, {"custom_logit_processor": '{"callable": "AAAA"}'}):
        with pytest.raises(Refused) as typed:
            _parse(CHAT, {"model": "m", "messages": HELLO, **bad})
        assert typed.value.param == next(iter(bad)), bad
    assert set(EXTENSIONS) >= {"input_ids", "rid", "lora_path", "custom_logit_processor", "return_hidden_states"}


@pytest.mark.parametrize(
    "pattern",
    ["(x+x+)+y", "x+y", r"\s*$", "(a{1,3}){1,3}", r"(a)\1", "x{1,}y", "(", "[a-" , "a{1,300}"],
)
def test_stop_regexes_that_backtrack_or_do_not_parse_are_refused(pattern: str) -> None:
    with pytest.raises(GrammarProblem):
        check_stop_regex(pattern)


# bounded, or searched in linear time (engine_guard.stop_regex: a final run like "a*" matches or fails at once)
@pytest.mark.parametrize("pattern", ["END", r"\n\n", r"\d{1,3}\.", "(foo|bar)", "[A-Z]{2,4}!", "^Answer:", r"[.!?]\s*$", "a*", "x{1,}"])
def test_bounded_or_linear_stop_regexes_pass(pattern: str) -> None:
    check_stop_regex(pattern)


def test_json_schema_refs_and_patterns() -> None:
    check_json_schema({"type": "object", "properties": {"child": {"$ref": "#"}}}, max_depth=32, max_enum=10)  # a tree
    for bad in (
        {"$ref": "#"},
        {"$ref": "#/$defs/x", "$defs": {"x": {"$ref": "#/$defs/x"}}},
        {"$ref": "#/$defs/missing"},
        {"$ref": "https://example.invalid/schema.json"},
        {"type": "string", "pattern": "(["},
        {"enum": list(range(11))},
    ):
        with pytest.raises(GrammarProblem):
            check_json_schema(bad, max_depth=32, max_enum=10)


EMPTY_SCORE = {"label_token_ids": [1]}


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [  # each crashed SGLang 0.5.23's scheduler on the real tiny engine (a forward pass over no token)
        ("/v1/score", {**EMPTY_SCORE, "items": [""]}, "items"),
        ("/v1/score", {**EMPTY_SCORE, "query": None, "items": ["a", ""]}, "items"),
        ("/v1/score", {**EMPTY_SCORE, "items": [""], "item_first": True}, "items"),
        ("/v1/score", {**EMPTY_SCORE, "query": [], "items": [[]]}, "query"),  # the schema: empty token lists
        ("/v1/completions", {"prompt": ["", "x"]}, "prompt"),
        ("/v1/embeddings", {"input": [[1], []]}, "input"),
        ("/v1/classify", {"input": ["a", ""]}, "input"),
    ],
)
def test_inputs_that_become_a_forward_pass_over_no_token_are_refused(path: str, body: dict[str, Any], field: str) -> None:
    with pytest.raises(Refused) as refused:
        _parse(path, {"model": "m", **body})
    assert refused.value.status == 400 and refused.value.param == field, refused.value.message
    assert refused.value.message.startswith(field), refused.value.message


@pytest.mark.parametrize(
    ("path", "body"),
    [  # each answered by the real tiny engine (200, or its own 400), which lives on
        ("/v1/score", {**EMPTY_SCORE, "query": "a", "items": [""]}),  # the prompt is "a"
        ("/v1/score", {**EMPTY_SCORE, "items": ""}),  # no item: SGLang scores nothing
        ("/v1/score", {**EMPTY_SCORE, "items": [[1], [2]]}),  # no query, token ids: each item is a prompt
        ("/v1/score", {**EMPTY_SCORE, "query": None, "items": "a"}),
        ("/v1/tokenize", {"prompt": ""}),  # no forward pass
        (CHAT, {"messages": [{"role": "user", "content": ""}]}),  # the chat template's role markers are tokens
        ("/v1/messages", {"messages": [{"role": "user", "content": ""}], "max_tokens": 2}),
        ("/v1/responses", {"input": [{"role": "user", "content": []}]}),
    ],
)
def test_inputs_the_engine_runs_are_not_refused_as_empty(path: str, body: dict[str, Any]) -> None:
    _parse(path, {"model": "m", **body})
    check_inputs(path, {"model": "m", **body})


def test_the_empty_input_rule_holds_without_the_schemas_types() -> None:
    """:func:`check_inputs` is the rule itself: a body its schema would have let through is still refused."""
    for path, body, field in (
        ("/v1/completions", {"prompt": [[1], []]}, "prompt"),
        ("/v1/embeddings", {"input": ""}, "input"),
        ("/v1/score", {"query": [], "items": [[]]}, "items"),
        (CHAT, {"messages": HELLO, "input_ids": []}, "input_ids"),
    ):
        with pytest.raises(Refused) as refused:
            check_inputs(path, body)
        assert refused.value.param == field and refused.value.code == "empty_input", (path, refused.value.message)


@pytest.mark.parametrize(
    ("grammar", "rule"),
    [
        ("root ::= root", "root"),  # 500 "Grammar accept_token failed" at the first token
        ('root ::= a\na ::= a "y"', "root"),
        ('root ::= "x" a\na ::= a', "a"),  # 500 after the first token
        ('root ::= root "a" | root "b"', "root"),
        ("root ::= x{2,}\nx ::= x", "root"),
    ],
)
def test_ebnf_rules_that_match_no_text_are_refused(grammar: str, rule: str) -> None:
    pytest.importorskip("xgrammar")
    with pytest.raises(GrammarProblem, match=f"rule '{rule}'"):
        check_ebnf(grammar)


@pytest.mark.parametrize(
    "grammar",
    ['root ::= ""', 'root ::= "x" root', 'root ::= ("" | root)', 'root ::= [a-z]* root', 'root ::= "(" root ")" | "o"',
     'root ::= a (= "b")\na ::= "a"', 'root ::= TagDispatch(("<a>", b), ("<c>", b))\nb ::= "x"', 'root ::= "a"* [b-c]+ ("x" root)? "q"{2,5}'],
)  # fmt: skip
def test_ebnf_grammars_the_engine_serves_pass(grammar: str) -> None:
    """Each is served by the real engine (``root ::= "x" root`` until max_tokens)."""
    pytest.importorskip("xgrammar")
    check_ebnf(grammar)


def test_fan_out_and_grammar_bounds() -> None:
    bounds = RequestBounds(max_prompts=4, max_generations=8, max_inputs=3, max_grammar_bytes=256)
    cases = [
        ("/v1/completions", {"prompt": ["a"] * 5}, "prompt"),
        ("/v1/completions", {"prompt": ["a"] * 4, "n": 3}, "prompt"),
        (CHAT, {"messages": HELLO, "n": 9}, "n"),
        ("/v1/score", {"query": "q", "items": ["a"] * 4}, "items"),
        ("/v1/embeddings", {"input": ["a"] * 4}, "input"),
        (CHAT, {"messages": HELLO, "regex": "a" * 300}, "regex"),
        (CHAT, {"messages": HELLO, "stop_regex": "(x+x+)+y"}, "stop_regex"),
        (CHAT, {"messages": HELLO, "response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#"}}}}, "response_format"),
        (CHAT, {"messages": HELLO, "response_format": {"type": "structural_tag", "structures": [], "triggers": [""]}}, "response_format"),
        (CHAT, {"messages": HELLO, "response_format": {"type": "structural_tag", "format": {"type": "no_such_format"}}}, "response_format"),
    ]
    for path, body, field in cases:
        with pytest.raises(Refused) as refused:
            check_bounds(path, body, bounds)
        assert refused.value.status == 400 and refused.value.param == field, (path, body, refused.value.message)
    check_bounds("/v1/completions", {"prompt": ["a"] * 4, "n": 2}, bounds)
    check_bounds("/v1/score", {"query": "q", "items": ["a"] * 3}, bounds)


@pytest.mark.parametrize(
    ("field", "bound", "value", "what"),
    [
        ("messages", "max_messages", HELLO * 3, "3 messages or input items; at most 2"),
        ("tools", "max_tools", [{"type": "function", "function": {"name": "f"}}] * 3, "3 tools; at most 2"),
        ("stop", "max_stop", ["a", "b", "c"], "3 entries; at most 2"),
        ("stop_token_ids", "max_token_list", [1, 2, 3], "3 entries; at most 2"),
        ("logit_bias", "max_token_list", {"1": 1, "2": 1, "3": 1}, "3 entries; at most 2"),
        ("input_ids", "max_prompts", [[1], [2], [3]], "3 prompts; at most 2"),
    ],
)
def test_each_list_bound_holds_for_the_bounds_each_caller_gives(field: str, bound: str, value: Any, what: str) -> None:
    """Each list past its bound is refused naming it, by the bounds given with the request: a route checked against one
    set of bounds and then another (the gateway's and an MLflow model's) is held to each in turn."""
    tight, loose = RequestBounds(**{bound: 2}), RequestBounds()
    body = {"messages": HELLO, field: value}
    for _ in range(2):
        with pytest.raises(Refused) as refused:
            check_bounds(CHAT, body, tight, "the.setting")
        assert refused.value.param == field and refused.value.message == f"{field}: {what} (the.setting)"
        check_bounds(CHAT, body, loose)


def test_a_body_over_several_list_bounds_is_refused_naming_the_first_in_a_fixed_order() -> None:
    """The field named does not depend on the body's key order or on the process (string hashes differ between
    processes): messages before tools before stop before the token lists."""
    tight = RequestBounds(max_messages=1, max_tools=1, max_stop=1, max_token_list=1)
    over = {"messages": HELLO * 2, "tools": [{"type": "function", "function": {"name": "f"}}] * 2, "stop": ["a", "b"], "logit_bias": {"1": 1, "2": 1}}
    for names in (["logit_bias", "stop", "tools", "messages"], ["stop", "tools", "logit_bias"], ["logit_bias", "tools"]):
        with pytest.raises(Refused) as refused:
            check_bounds(CHAT, {name: over[name] for name in names}, tight)
        assert refused.value.param == min(names, key=["messages", "tools", "stop", "logit_bias"].index), (names, refused.value.message)


def test_structural_tags_the_engine_builds_pass_and_those_it_cannot_are_refused() -> None:
    """Built as SGLang builds them (with the xgrammar the engine runs): the legacy form and a ``format``, a missing
    schema filled in as the engine fills it; an empty trigger, or a tag that no trigger begins, refused with the
    backend's own words."""
    pytest.importorskip("xgrammar")
    tag = {"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}
    legacy = {"type": "structural_tag", "structures": [tag, {**tag, "begin": "<g>", "schema": None}], "triggers": ["<f", "<g"]}
    content = {"type": "tag", "begin": "<f>", "content": {"type": "json_schema"}, "end": "</f>"}  # no json_schema: {}
    formatted = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f"], "tags": [content]}}
    for accepted in (legacy, formatted):
        before = orjson.dumps(accepted)
        check_bounds(CHAT, {"messages": HELLO, "response_format": accepted}, RequestBounds())
        assert orjson.dumps(accepted) == before  # checked on a copy: the body sent is the client's
    for refused_format, words in (
        ({**legacy, "triggers": [""]}, "triggers must be non-empty strings"),
        ({**legacy, "triggers": ["<f"]}, "One tag does not match any trigger"),
    ):
        with pytest.raises(Refused) as refused:
            check_bounds(CHAT, {"messages": HELLO, "response_format": refused_format}, RequestBounds())
        assert refused.value.param == "response_format" and words in refused.value.message, refused.value.message
        assert refused.value.message.startswith("response_format: invalid structural tag: "), refused.value.message


def test_a_forced_tool_call_counts_its_schema_as_a_grammar() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}]
    assert grammar_bytes({"tools": tools, "tool_choice": "auto"}) == 0
    assert grammar_bytes({"tools": tools, "tool_choice": "required"}) > 0
