"""Engine failures caused by the client's input, told apart from the engine's own (SGLang 0.5.23).

SGLang answers some client mistakes with a 500, as if it had failed (a 500 becomes the gateway's 502
"engine failed", an engine error in the metrics and the log). Each rule here names one such answer, as
the real engine gives it, and the request field that caused it; a 5xx matching none stays an engine
failure. The first line of defence is the request validation (:mod:`engine_guard.schemas`); this is the
backstop for what reaches the engine anyway.

=================================================  ==========================================================
request                                            what SGLang 0.5.23 answers
=================================================  ==========================================================
``stop_regex: "("`` (chat, completions)            500 ``Internal server error: missing ), unterminated
                                                   subpattern at position 0`` (Python's ``re.error``)
``ebnf: "root ::= root"``, a JSON schema that      500 ``Grammar accept_token failed: Tokens not accepted: 0
only refers to itself (``{"$ref": "#"}``)          ...`` (a stream: that error as an event after the 200)
``chat_template_kwargs: {"tools": 5}`` (or         500 ``Internal server error: 'tools'`` (the chat template's
``messages``, ``tokenize``, ...)                   ``KeyError``)
=================================================  ==========================================================
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

GRAMMAR_FIELDS = ("regex", "ebnf", "json_schema", "response_format", "structural_tag")
_INTERNAL = "Internal server error: "
_REGEX_ERROR = re.compile(r"^(.+) at position (\d+)(?: \(line \d+, column \d+\))?$")
_KEY_ERROR = re.compile(r"^'([^'\n]{1,200})'$")


def client_mistake(message: str, request: Mapping[str, Any] | None) -> tuple[str, str] | None:
    """``(message, param)`` for the client when the engine's 5xx ``message`` (sanitized) is about ``request``'s
    input, else None. Each rule needs the field it blames in the request, so an engine failure that happens to
    read alike is not taken for the client's mistake."""
    if not request:
        return None
    text = message.strip()
    if text.startswith("Grammar accept_token failed"):
        field = next((name for name in GRAMMAR_FIELDS if request.get(name) is not None), None)
        if field is not None:
            return f"{field}: the grammar accepts no token (it is empty, or a rule or $ref refers only to itself)", field
    inner = text.removeprefix(_INTERNAL) if text.startswith(_INTERNAL) else None
    if inner is None:
        return None
    if request.get("stop_regex") is not None:
        match = _REGEX_ERROR.match(inner)
        if match:
            return f"stop_regex: invalid regular expression: {match.group(1)} at position {match.group(2)}", "stop_regex"
    kwargs = request.get("chat_template_kwargs")
    match = _KEY_ERROR.match(inner)
    if match and isinstance(kwargs, Mapping) and match.group(1) in kwargs:
        key = match.group(1)
        return f"chat_template_kwargs.{key}: the model's chat template cannot take this value for {key!r}", f"chat_template_kwargs.{key}"
    return None
