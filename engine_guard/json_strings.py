"""JSON strings as the engine's grammar writes them: what a schema's string may hold, made to mean what it says.

xgrammar (SGLang's grammar backend) writes a JSON string's characters raw, and two of its string rules break JSON:

- a ``pattern`` made only of literal characters is written as those characters, unescaped: ``^x", "is_admin": true,
  "t": "y$`` closes the string and injects keys into a strict call's arguments, ``^a"b$`` yields JSON no parser
  takes, and ``^\\n</tool_call>$`` writes the tool-call parser's end marker inside an argument. (A pattern with a
  class or a quantifier is held to JSON string content: its classes never produce a quote, a backslash or a control
  character.) :func:`engine_guard.grammar_checks.pattern_problem` refuses a pattern that requires such a character: the engine cannot write it
  escaped, so it either breaks the JSON or can never be matched.
- a string with ``minLength``/``maxLength`` (and no pattern) lets raw control characters in (a tab, a NUL), which no
  JSON parser takes: the engine's tool-call parser drops the call, a client's ``json.loads`` fails.
  :func:`hold_string_lengths` rewrites such a string's bounds as the equivalent pattern ``^.{min,max}$``
  (:data:`ANY_CHARACTER`), which the grammar holds to JSON string content (no quote, backslash or control
  character; each character one of the length) and which costs no more to compile.

:func:`hold_json_strings` applies the rewrite to the JSON schema of a request's answer format, and
:func:`engine_guard.tool_calls.hold_strict_strings` to its strict (or forced) tools' parameters, on copies: the
caller's objects are left as they were.
"""

from __future__ import annotations

import copy
from typing import Any

import orjson

from engine_guard.grammar_checks import schema_nodes

ANY_CHARACTER = "."
"""One character of a JSON string, as the grammar holds it: xgrammar's ``.`` in a string's pattern is held to JSON
string content (no quote, backslash or control character). What it does not hold: bytes that are not UTF-8 (a
surrogate's, ``ED A0 80``), which random weights write and which decode as replacement characters, one to three per
character the grammar counted; a real model writes UTF-8. (A class that leaves surrogates out,
``[^\\ud800-\\udfff]``, dead-ends in xgrammar after the byte ``ED``: the engine answers 500.)"""


def _length_bounded(node: dict[str, Any]) -> bool:
    return (
        node.get("type") == "string" and ("minLength" in node or "maxLength" in node)
        and not any(key in node for key in ("pattern", "enum", "const", "format"))
        and all(isinstance(node.get(key, 0), int) and not isinstance(node.get(key, 0), bool) for key in ("minLength", "maxLength"))
    )  # fmt: skip


def hold_string_lengths(schema: Any) -> Any:
    """``schema`` with each length-bounded string (``minLength``/``maxLength``, no pattern) held by the equivalent
    pattern ``^.{min,max}$`` instead (a copy; ``schema`` itself when there is none)."""
    if not isinstance(schema, dict) or not any(_length_bounded(node) for node, _ in schema_nodes(schema)):
        return schema
    held = copy.deepcopy(schema)
    for node, _ in schema_nodes(held):
        if _length_bounded(node):
            low, high = node.pop("minLength", 0), node.pop("maxLength", None)
            node["pattern"] = f"^{ANY_CHARACTER}{{{low},{'' if high is None else high}}}$"
    return held


_FORMAT_FIELDS = frozenset({"response_format", "text", "output_config", "json_schema"})  # what hold_json_strings looks into


def hold_json_strings(body: dict[str, Any]) -> None:
    """Rewrite ``body`` in place so that the JSON schema of its answer's format holds its strings to JSON content
    (:func:`hold_string_lengths`): ``response_format``, ``text.format``, ``output_config.format``, a completions
    ``json_schema`` (strict and forced tools: :func:`engine_guard.tool_calls.hold_strict_strings`). Changed objects are
    copies; the caller's stay as they were."""
    if _FORMAT_FIELDS.isdisjoint(body):  # most requests ask for no format: one set operation
        return
    for field in ("response_format", "text", "output_config"):
        container = body.get(field)
        spec = container if field == "response_format" else container.get("format") if isinstance(container, dict) else None
        if not isinstance(spec, dict) or spec.get("type") != "json_schema":
            continue
        inner = spec.get("json_schema") if isinstance(spec.get("json_schema"), dict) else spec
        held = hold_string_lengths(inner.get("schema"))
        if held is inner.get("schema"):
            continue
        inner = {**inner, "schema": held}
        spec = {**spec, "json_schema": inner} if isinstance(spec.get("json_schema"), dict) else inner
        body[field] = spec if field == "response_format" else {**container, "format": spec}
    if isinstance(body.get("json_schema"), str):
        try:
            schema = orjson.loads(body["json_schema"])
        except orjson.JSONDecodeError:
            schema = None  # the guard's grammar checks refuse it
        held = hold_string_lengths(schema)
        if held is not schema:
            body["json_schema"] = orjson.dumps(held).decode()
