"""Grammar inputs checked before they reach an engine: client mistakes are a 400 here, and inputs that
would freeze the engine's scheduler are refused.

Two engines run a request's patterns, with different failure modes:

- ``stop_regex`` runs in Python's backtracking ``re`` on the scheduler thread, at every decode step, over the
  output's tail (the whole output when the pattern's match length is unbounded). A pattern such as ``(x+x+)+y``
  takes exponential time there, and ``x+y`` is quadratic in the output length at every step: the scheduler stops
  answering and every request on the engine fails. Accepted are bounded patterns and patterns whose search stays
  linear in the text (``[.!?]\\s*$``): :mod:`engine_guard.stop_regex` has the rule and why it holds.
- ``regex``, ``ebnf``, JSON schemas and structural tags are compiled by the grammar backend (xgrammar)
  into an automaton, which does not backtrack; their cost is compile time and memory, bounded by size
  (:mod:`engine_guard.bounds`) and by the per-model grammar concurrency limit. Here the gateway refuses what
  would fail to compile (a regex or a JSON-schema ``pattern`` that does not parse, a ``$ref`` that does
  not resolve or that refers to itself without consuming input, an EBNF that does not parse or has a rule that
  matches no text, a structural tag the backend cannot build), so it is the client's 400 rather than an engine failure.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Iterator
from typing import Any

from engine_guard.grammar_start import dead_rule
from engine_guard.stop_regex import stop_regex_problem

try:  # re's parser (stable since 3.11 as re._parser; sre_parse before)
    from re import _constants as _sre  # type: ignore[attr-defined]
    from re import _parser as _sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - Python < 3.11
    import sre_constants as _sre  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]


class GrammarProblem(ValueError):
    """Why a grammar input cannot go to the engine (the message names what to change)."""


def check_stop_regex(pattern: str) -> None:
    """Raise GrammarProblem unless Python's backtracking ``re`` searches ``pattern`` in linear time
    (:mod:`engine_guard.stop_regex`)."""
    problem = stop_regex_problem(pattern)
    if problem is not None:
        raise GrammarProblem(problem)


def check_regex(pattern: str) -> None:
    """A constrained-decoding regex (compiled by the grammar backend): it must at least parse."""
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as error:
        raise GrammarProblem(f"invalid regular expression: {error}") from None


_QUOTE, _BACKSLASH = ord('"'), ord("\\")


def _special(code: int) -> bool:
    """A character that JSON writes only escaped: the quote, the backslash, a control character."""
    return code in (_QUOTE, _BACKSLASH) or code < 0x20


def pattern_problem(pattern: str) -> str | None:
    """Why the engine cannot hold a JSON-schema string to ``pattern`` (it requires a character JSON writes only
    escaped: see :mod:`engine_guard.json_strings`), or None. A pattern that does not parse is :func:`check_regex`'s."""
    try:
        parsed = _sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError):
        return None
    pending = [parsed]
    while pending:
        for op, value in pending.pop():
            if op == _sre.LITERAL and _special(value):
                return f"it requires the character {chr(value)!r}, which the engine's grammar writes unescaped into the JSON string"
            if op == _sre.IN and value and all(kind == _sre.LITERAL and _special(code) for kind, code in value):
                return "a character class of only quotes, backslashes or control characters, which the engine's grammar cannot write in a JSON string"
            if op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT, getattr(_sre, "POSSESSIVE_REPEAT", _sre.MAX_REPEAT)):
                pending.append(value[2])
            elif op == _sre.SUBPATTERN:
                pending.append(value[-1])
            elif op == _sre.BRANCH:
                pending.extend(value[1])
            elif op in (_sre.ASSERT, _sre.ASSERT_NOT):
                pending.append(value[1])
    return None


def check_json_schema(schema: Any, *, max_depth: int, max_enum: int) -> None:
    """A JSON schema the grammar backend can compile: an object (or boolean), nested at most ``max_depth``
    deep, enums of at most ``max_enum`` values, ``pattern`` regexes that parse, local ``$ref``s that
    resolve and never refer back to themselves without going through a property or an item."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise GrammarProblem("a JSON schema must be an object")
    for node, depth in schema_nodes(schema):
        if depth > max_depth:
            raise GrammarProblem(f"nested deeper than {max_depth} levels")
        enum = node.get("enum")
        if isinstance(enum, list) and len(enum) > max_enum:
            raise GrammarProblem(f"an enum of {len(enum)} values; at most {max_enum}")
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            try:
                check_regex(pattern)
            except GrammarProblem as problem:
                raise GrammarProblem(f"pattern {pattern[:40]!r}: {problem}") from None
            problem = pattern_problem(pattern)
            if problem is not None:
                raise GrammarProblem(f"pattern {pattern[:40]!r}: {problem}; match it with a class such as [^a] or drop it")
        ref = node.get("$ref")
        if ref is not None:
            _check_ref(schema, node, ref)


# Keywords whose subschemas describe a *part* of the value (a property, an item): a $ref cycle through
# one of them consumes input at each turn (a tree), one without them never does (the schema is its own
# definition, which a grammar cannot compile into anything that ends).
_CONSUMING = ("properties", "patternProperties", "additionalProperties", "items", "prefixItems", "contains", "additionalItems")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames", "additionalItems")


def _children(node: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """(keyword, subschema) of every subschema directly inside ``node``."""
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            yield from ((key, child) for child in node[key])
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            yield from ((key, child) for child in node[key].values())
    for key in _SCHEMA_ONE:
        if key in node:
            yield key, node[key]


def schema_nodes(schema: dict[str, Any]) -> Iterator[tuple[dict[str, Any], int]]:
    """Every (sub)schema of ``schema`` with its depth (1: the root), through the keywords that hold subschemas."""
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        yield node, depth
        stack.extend((child, depth + 1) for _, child in _children(node) if isinstance(child, dict))


def _resolve(root: dict[str, Any], ref: Any) -> dict[str, Any] | bool:
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise GrammarProblem(f"$ref {str(ref)[:60]!r}: only local references ('#/...') can be resolved")
    node: Any = root
    for part in ref[1:].lstrip("/").split("/") if ref not in ("#", "#/") else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise GrammarProblem(f"$ref {ref[:60]!r} does not resolve")
    if not isinstance(node, (dict, bool)):
        raise GrammarProblem(f"$ref {ref[:60]!r} does not point to a schema")
    return node


def _check_ref(root: dict[str, Any], start: dict[str, Any], ref: Any) -> None:
    """Follow ``start``'s reference through combinators only; arriving back at ``start`` is a cycle that
    consumes nothing."""
    seen: set[int] = set()
    pending: list[Any] = [ref]
    while pending:
        target = _resolve(root, pending.pop())
        if isinstance(target, bool) or id(target) in seen:
            continue
        if target is start:
            raise GrammarProblem(f"$ref {str(ref)[:60]!r} refers back to itself without a property or item in between")
        seen.add(id(target))
        if "$ref" in target:
            pending.append(target["$ref"])
        pending.extend(
            child["$ref"]
            for key, child in _children(target)
            if key not in _CONSUMING and key not in ("$defs", "definitions") and isinstance(child, dict) and "$ref" in child
        )


def check_ebnf(grammar: str) -> None:
    """An EBNF grammar that parses (with the grammar backend's own parser, where it is installed) and whose every rule
    matches some text (:mod:`engine_guard.grammar_start`: ``root ::= root`` fails in the engine with a 500)."""
    problem = _ebnf_problem(grammar)
    if problem is not None:
        raise GrammarProblem(problem)


@functools.lru_cache(maxsize=64)
def _ebnf_problem(grammar: str) -> str | None:
    """Why ``grammar`` cannot go to the engine, or None (remembered: a batch's lines often share one grammar)."""
    try:
        import xgrammar
    except ImportError:  # a gateway installed without SGLang's stack: the engine reports it
        return None
    try:
        parsed = xgrammar.Grammar.from_ebnf(grammar)
    except (RuntimeError, ValueError) as error:
        text = str(error)
        return "invalid EBNF: " + (text.split("error at ", 1)[-1] if "error at " in text else text)[:300]
    dead = dead_rule(str(parsed))
    if dead is not None:
        return (
            f"the grammar accepts no token where rule {dead!r} is expected: it matches no text (it refers only to itself "
            "before any text), and the engine fails when it reaches it"
        )
    return None


def check_structural_tag(spec: dict[str, Any]) -> None:
    """A structural tag (``response_format`` of type ``structural_tag``) that the grammar backend can build, built as
    SGLang builds it: its legacy ``structures`` and ``triggers``, or a ``format``. The backend's own checks (an empty
    trigger, a tag no trigger begins, an unknown format type) fail in the engine with a 500 otherwise. Where xgrammar
    is not installed, or too old to build structural tags here, the engine reports it."""
    try:
        import xgrammar
    except ImportError:  # a gateway installed without SGLang's stack
        return
    if not hasattr(xgrammar, "StructuralTag") or not hasattr(xgrammar.StructuralTag, "from_legacy_structural_tag"):
        return
    try:
        if spec.get("structures") is not None:  # the legacy form (SGLang's is_legacy_structural_tag)
            tags = [
                xgrammar.StructuralTagItem(begin=item["begin"], schema=json.dumps(_or_empty(item.get("schema"))), end=item["end"])
                for item in spec["structures"]
            ]
            tag = xgrammar.StructuralTag.from_legacy_structural_tag(tags, spec.get("triggers"))
            tag.format.at_least_one = spec.get("at_least_one", False)
            xgrammar.Grammar.from_structural_tag(tag)
        else:
            xgrammar.Grammar.from_structural_tag(json.dumps(_empty_schemas_filled(spec)))
    except (RuntimeError, ValueError, TypeError, KeyError) as error:  # xgrammar's errors, pydantic's (a ValueError)
        text = " ".join(str(error).split()).removeprefix("Invalid structural tag error: ")
        raise GrammarProblem("invalid structural tag: " + text[:300]) from None


def _or_empty(schema: Any) -> Any:
    return {} if schema is None else schema


def _empty_schemas_filled(spec: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``spec`` whose formats without a ``json_schema`` have an empty one, as the engine fills them in
    (SGLang's ``_sanitize_structural_format``): what it accepts must pass here."""
    spec = copy.deepcopy(spec)
    pending = [spec.get("format")]
    while pending:
        node = pending.pop()
        if not isinstance(node, dict):
            continue
        kind = node.get("type")
        if kind in ("json_schema", "qwen_xml_parameter") and node.get("json_schema") is None:
            node["json_schema"] = {}
        if kind == "tag":
            pending.append(node.get("content"))
        elif kind in ("sequence", "or") and isinstance(node.get("elements"), list):
            pending.extend(node["elements"])
        elif kind in ("triggered_tags", "tags_with_separator") and isinstance(node.get("tags"), list):
            pending.extend(node["tags"])
    return spec
