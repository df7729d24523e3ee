"""Tool calls as the client asked for them: refused where the engine cannot return them, held where they are forced.

SGLang 0.5.23 turns a model's tool-call text into ``tool_calls`` (``function_call`` items, ``tool_use`` blocks) only
when the engine runs a ``--tool-call-parser``. Without one, a forced call still comes back, as JSON text in the
answer's content, with a 200 and no word of why: an agent loop never sees a call. A request that offers tools
(and does not turn them off) to such an engine is refused here, naming the setting.

With a parser, the engine forces a call (``required``, a named function; Anthropic's ``any`` and ``tool``) by a
structural tag that lists *every* offered tool and leaves the arguments free unless the tool is ``strict``: a named
function can come back as another, and arguments as a bare number. :func:`hold_forced_calls` rewrites such a
request before it is sent: only the named tool is offered, and each forced tool is marked strict, so that the
engine's grammar holds the name and the parameters' JSON schema (the guard has checked that schema compiles:
:func:`engine_guard.bounds.grammar_inputs`). A tool the client marked ``strict`` is held by the engine as it is.

The grammar holds the call but, as SGLang 0.5.23 builds it, does not end the answer: after the call's closing marker
it lets the model write on (text its parser drops) until ``max_tokens``, so a complete call came back cut short
(``finish_reason: "length"``, Responses ``status: "incomplete"``, Messages ``stop_reason: "max_tokens"``). Where one
call is all the answer may hold (a named function; ``required`` with ``parallel_tool_calls: false``), an engine the
gateway launches runs its SGLang plugin, whose grammar ends the answer right after the call on every route and with
every parser (``launch/engine_plugin/.../forced_calls_end.py``; parallel calls keep SGLang's grammar and the plugin's
scheduler hook ends the turn where text that is no call begins: ``parallel_calls_end.py``). For an engine without it (one given by URL), on chat completions, :func:`end_forced_call` adds the parser's end-of-call text
(:data:`CALL_ENDS`) as a stop string, kept in the output (``no_stop_trim``) so the parser still reads the call: the
engine stops right after it and answers ``tool_calls``. SGLang's Responses and Messages requests have no
``no_stop_trim`` (a trimmed marker leaves the parser no call): there, only the plugin ends the call.

One table says, per route, where the tools, their schemas and the choice live (:data:`TOOL_DIALECTS`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError

from engine_guard.grammar_checks import schema_nodes
from engine_guard.json_strings import hold_json_strings, hold_string_lengths
from engine_guard.refusal import Refused


@dataclass(frozen=True)
class ToolDialect:
    """Where one route's request keeps its tools: ``function_key`` is the key of each tool's function (None: the
    tool itself), ``schema_key`` its parameters' schema; the choice values that turn tools off and force a call."""

    function_key: str | None
    schema_key: str
    none_choices: tuple[str, ...]  # tool_choice (or its "type") that turns tools off
    forced_choices: tuple[str, ...]  # tool_choice (or its "type") that forces some call
    named_type: str  # the "type" of a tool_choice that names one function

    def choice(self, body: dict[str, Any]) -> tuple[str, str | None]:
        """(kind, named function): kind is "none", "auto", "forced" or "named"."""
        choice = body.get("tool_choice")
        kind = choice.get("type") if isinstance(choice, dict) else choice
        if kind is None:
            return "auto", None
        if kind in self.none_choices:
            return "none", None
        if kind in self.forced_choices:
            return "forced", None
        if kind == self.named_type and isinstance(choice, dict):
            function = choice.get("function") if isinstance(choice.get("function"), dict) else choice
            name = function.get("name")
            return ("named", name) if isinstance(name, str) else ("auto", None)
        return "auto", None

    def functions(self, body: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """(tool, its function) for each function tool of ``body`` (built-in tools of other types left out). A list,
        built in one comprehension: the guard walks an agent's tools five times, and a generator's resumption per tool
        cost more than the walk."""
        tools = body.get("tools")
        if not isinstance(tools, list):
            return []
        key = self.function_key
        if key is None:
            return [
                (tool, tool) for tool in tools
                if isinstance(tool, dict) and tool.get("type") in (None, "function", "custom") and isinstance(tool.get("name"), str)
            ]  # fmt: skip
        return [(tool, tool[key]) for tool in tools if isinstance(tool, dict) and isinstance(tool.get(key), dict)]


TOOL_DIALECTS: dict[str, ToolDialect] = {
    "/v1/chat/completions": ToolDialect("function", "parameters", ("none",), ("required",), "function"),
    "/v1/responses": ToolDialect(None, "parameters", ("none",), ("required",), "function"),
    "/v1/messages": ToolDialect(None, "input_schema", ("none",), ("any",), "tool"),
}
"""Every route that takes tools, and how its requests spell them."""

TOOL_PARSER_SETTING = "tool_call_parser"

CALL_ENDS: dict[str, str] = {
    "qwen25": "\n</tool_call>",  # Qwen25Detector.eot_token; its grammar closes each call with '}\n</tool_call>'
    "qwen": "\n</tool_call>",  # the same detector: the name an engine started with qwen25 reports (/get_server_info)
    "trinity": "\n</tool_call>",  # TrinityDetector: the same format
}
"""Per ``--tool-call-parser``, the text that closes one call in its format (the detector's ``eot_token``, ending
its grammar's end of a call), for every parser SGLang 0.5.23 ships whose marker cannot occur earlier in a
grammar-held call: it holds a newline, which a JSON string cannot hold raw (tests check the table against SGLang's
detectors). Others' markers (``</tool_call>``, ``<|END_ACTION|>``, ``}``, ``]``...) could be written inside an
argument's string, where a stop would cut the call: their requests are left as they are (the plugin ends them)."""
ENDS_ON_STOP_PATHS = ("/v1/chat/completions",)
"""Routes whose engine request can keep a matched stop string (``no_stop_trim``): SGLang's Responses and Messages
requests have no such field, and a trimmed marker would leave the parser no call to read (there, the engine plugin's
grammar ends the call)."""

ENFORCED_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "enum", "const", "anyOf",
    "$ref", "$defs", "definitions", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength",
    "maxLength", "pattern", "minItems", "maxItems",
})  # fmt: skip
"""The JSON-schema keywords the engine's grammar (xgrammar) holds a value to: a strict tool's schema may use only
these (and annotations). Others are compiled loosely or not at all (``multipleOf`` is ignored, ``oneOf`` read as
``anyOf``, ``not``/``if``/``uniqueItems`` unknown), so the arguments could break them."""
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly", "writeOnly",
    "strict", "format",
})  # fmt: skip
"""Keywords that describe and do not constrain (``format`` is an annotation by the JSON Schema spec)."""

TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
"""A tool's name as OpenAI and Anthropic require it: the engine's tool-call grammar writes it raw, so a quote, a
backslash or a newline in it breaks the call's JSON (the call then vanishes), and an empty one matches nothing."""

_LAX_BOOL: TypeAdapter[bool] = TypeAdapter(bool)


def is_strict(function: dict[str, Any]) -> bool:
    """Whether the engine reads ``function``'s ``strict`` as true: SGLang's pydantic models take it laxly (``true``,
    ``"true"``, ``1``, ``"yes"``...), so the guard reads it the same way, not as the JSON value ``true`` alone."""
    value = function.get("strict")
    if value is None or value is False:
        return False
    try:
        return _LAX_BOOL.validate_python(value)
    except ValidationError:
        return False  # not a boolean the engine takes: its own 400


def offers_tools(path: str, body: dict[str, Any]) -> bool:
    """Whether ``body`` offers the model function tools it may call (tools given, and not turned off)."""
    dialect = TOOL_DIALECTS.get(path)
    if dialect is None or dialect.choice(body)[0] == "none":
        return False
    return bool(dialect.functions(body))


def check_tool_parser(path: str, body: dict[str, Any], model: str, parser: str | None) -> None:
    """Refuse tools for a model whose engine runs no tool-call parser (``parser`` None): its calls would come back
    as text. Call only where the engine's parser is known."""
    if parser is None and offers_tools(path, body):
        raise Refused(
            f"tools: model {model!r} cannot return tool calls: its engine runs no tool-call parser (set "
            f"engine.{TOOL_PARSER_SETTING} for it in the deployment file, e.g. qwen25, llama3, hermes), so a call would "
            "come back as plain text; send tool_choice \"none\" or no tools",
            code="tools_unsupported", param="tools",
        )


def check_strict_schemas(path: str, body: dict[str, Any]) -> None:
    """Refuse a strict tool whose parameters' schema uses a keyword the engine's grammar does not hold (naming it):
    strict promises arguments that validate, and only :data:`ENFORCED_KEYWORDS` are kept by constrained decoding."""
    dialect = TOOL_DIALECTS.get(path)
    if dialect is None:
        return
    for index, (_, function) in enumerate(dialect.functions(body)):
        schema = function.get(dialect.schema_key)
        if not is_strict(function) or not isinstance(schema, dict):
            continue
        for node, _ in schema_nodes(schema):
            unknown = sorted(set(node) - ENFORCED_KEYWORDS - ANNOTATIONS)
            if not unknown and "pattern" in node:  # xgrammar drops a string's length bounds beside a pattern
                unknown = [key for key in ("minLength", "maxLength") if key in node]
            if unknown:
                field = f"tools[{index}]" + (f".{dialect.function_key}" if dialect.function_key else "") + f".{dialect.schema_key}"
                raise Refused(
                    f"{field}: keyword {unknown[0]!r}{' beside pattern' if 'pattern' in node and unknown[0] in ('minLength', 'maxLength') else ''} "
                    f"is not enforced by the engine's grammar, so a strict tool's arguments could break it (strict tools may "
                    f"use {', '.join(sorted(ENFORCED_KEYWORDS))}, and a pattern without length bounds); drop it or strict",
                    code="invalid_grammar", param="tools",
                )


def check_tool_names(path: str, body: dict[str, Any]) -> None:
    """Refuse a function tool whose name is not :data:`TOOL_NAME` (naming the tool): the engine would write it raw into
    the call, and a forced call of it would vanish (a name that is not a string is the engine's own 400)."""
    dialect = TOOL_DIALECTS.get(path)
    if dialect is None:
        return
    for index, (_, function) in enumerate(dialect.functions(body)):
        name = function.get("name")
        if isinstance(name, str) and not TOOL_NAME.fullmatch(name):
            field = f"tools[{index}]" + (f".{dialect.function_key}" if dialect.function_key else "") + ".name"
            raise Refused(
                f"{field}: {name[:80]!r} is not a valid tool name: use 1 to 64 letters, digits, '_' or '-' (as OpenAI and "
                "Anthropic require; the engine writes the name into the call as it is)",
                code="invalid_tool_name", param="tools",
            )  # fmt: skip


def hold_strict_strings(path: str, body: dict[str, Any]) -> None:
    """Rewrite ``body`` in place so that every schema the engine compiles holds its strings to JSON content
    (:func:`engine_guard.json_strings.hold_string_lengths`): the answer format's and each strict tool's parameters
    (after :func:`hold_forced_calls`, which marks forced tools strict). Changed tools are copies."""
    hold_json_strings(body)
    dialect = TOOL_DIALECTS.get(path)
    if dialect is None or not isinstance(body.get("tools"), list):
        return
    held: dict[int, dict[str, Any]] = {}
    for tool, function in dialect.functions(body):
        schema = function.get(dialect.schema_key)
        if is_strict(function) and (rewritten := hold_string_lengths(schema)) is not schema:
            new_function = {**function, dialect.schema_key: rewritten}
            held[id(tool)] = new_function if dialect.function_key is None else {**tool, dialect.function_key: new_function}
    if held:
        body["tools"] = [held.get(id(tool), tool) for tool in body["tools"]]


def hold_forced_calls(path: str, body: dict[str, Any]) -> None:
    """Rewrite ``body`` in place so that a forced call is held by the engine's grammar: a named function alone
    among the tools offered, and every forced tool strict (its parameters' schema enforced). Other requests are
    left as they are."""
    dialect = TOOL_DIALECTS.get(path)
    if dialect is None:
        return
    kind, name = dialect.choice(body)
    if kind not in ("forced", "named") or not isinstance(body.get("tools"), list):
        return  # no tools to hold: the engine refuses a forced choice without them, in its own words
    pairs = dialect.functions(body)
    if kind == "named":
        pairs = [(tool, function) for tool, function in pairs if function.get("name") == name]
    if not pairs:
        return  # the engine refuses a choice naming no offered tool, in its own words
    held = {id(tool): _strict(tool, dialect) for tool, _ in pairs}  # copies: the caller's tools stay as they were
    body["tools"] = [held.get(id(tool), tool) for tool in body["tools"] if kind != "named" or id(tool) in held]


def _strict(tool: dict[str, Any], dialect: ToolDialect) -> dict[str, Any]:
    if dialect.function_key is None:
        return {**tool, "strict": True}
    return {**tool, dialect.function_key: {**tool[dialect.function_key], "strict": True}}


def end_forced_call(path: str, body: dict[str, Any], parser: str | None) -> None:
    """Rewrite ``body`` in place so that the engine stops right after a forced call when only one call may come (a
    named function, or ``required`` with ``parallel_tool_calls`` false): the parser's end-of-call text
    (:data:`CALL_ENDS`) added to the caller's stop strings, and the matched stop kept in the output
    (``no_stop_trim``) for the parser to read the call whole. Other requests, routes and parsers are left as they are."""
    marker = CALL_ENDS.get(parser or "")
    if marker is None or path not in ENDS_ON_STOP_PATHS:
        return
    dialect = TOOL_DIALECTS[path]
    kind, name = dialect.choice(body)
    if kind == "forced" and body.get("parallel_tool_calls") is not False:
        return  # several calls may come: a stop after the first would cut the others off
    if kind not in ("forced", "named") or not isinstance(body.get("tools"), list):
        return
    if not any(kind == "forced" or function.get("name") == name for _, function in dialect.functions(body)):
        return  # no tool to call: the engine refuses it, in its own words
    stop = body.get("stop")
    if stop is None:
        stops = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list):
        stops = list(stop)
    else:
        return  # not a stop the engine takes: its own 400
    body["stop"] = stops if marker in stops else [*stops, marker]
    body["no_stop_trim"] = True


def guard_tools(path: str, body: dict[str, Any], model: str, parser: str | None, *, parser_known: bool) -> None:
    """What both paths (the gateway, the MLflow wrapper) do with a request's tools and answer format, in order: refused
    for an engine known to run no tool-call parser, a tool name the call cannot carry refused, a forced call held
    (:func:`hold_forced_calls`: it marks forced tools strict), then the check of strict schemas on what is sent (a
    keyword the grammar cannot hold refused, forced tools included), every compiled schema's strings held to JSON
    content (:func:`hold_strict_strings`), and a call that must come alone ended after it (:func:`end_forced_call`)."""
    if parser_known:
        check_tool_parser(path, body, model, parser)
    check_tool_names(path, body)
    hold_forced_calls(path, body)
    check_strict_schemas(path, body)
    hold_strict_strings(path, body)
    end_forced_call(path, body, parser)


def forced_call_problem(path: str, body: dict[str, Any], answer: Any) -> str | None:
    """Why ``answer`` (the engine's plain answer to ``body``, parsed) fails a forced tool choice: it holds no call
    (the engine's parser dropped a call it could not read, or the answer was cut at its token limit before the call
    ended), or None. A forced choice promises a call: a 200 with nothing would leave an agent loop with no step. An
    answer the caller's own stop string ended is what the caller asked for, call or not."""
    dialect = TOOL_DIALECTS.get(path)
    if dialect is None or dialect.choice(body)[0] not in ("forced", "named") or not isinstance(answer, dict):
        return None
    if not dialect.functions(body):
        return None  # no tool to call: the engine's own answer stands
    cut = False
    if path == "/v1/chat/completions":
        choices = answer.get("choices") if isinstance(answer.get("choices"), list) else []
        missing = [c for c in choices if isinstance(c, dict) and not ((c.get("message") or {}).get("tool_calls")) and not _callers_stop(c)]
        cut = any(choice.get("finish_reason") == "length" for choice in missing)
        if not missing:
            return None
    elif path == "/v1/responses":
        output = answer.get("output") if isinstance(answer.get("output"), list) else []
        if any(isinstance(item, dict) and item.get("type") == "function_call" for item in output):
            return None
        cut = answer.get("status") == "incomplete"
    else:
        content = answer.get("content") if isinstance(answer.get("content"), list) else []
        if any(isinstance(block, dict) and block.get("type") == "tool_use" for block in content):
            return None
        if answer.get("stop_reason") == "stop_sequence":
            return None  # the caller's own stop sequence ended it: what it asked for
        cut = answer.get("stop_reason") == "max_tokens"
    if cut:
        return "the answer reached its token limit before the forced tool call ended: no complete call to return (raise the limit)"
    return "the engine returned no tool call for the forced tool choice (the model's call could not be read as JSON)"


def _callers_stop(choice: dict[str, Any]) -> bool:
    """Whether a chat choice was ended by one of the caller's stop strings (not the end-of-call marker the gateway adds)."""
    matched = choice.get("matched_stop")
    return choice.get("finish_reason") == "stop" and isinstance(matched, str) and matched not in CALL_ENDS.values()
