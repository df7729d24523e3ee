"""EBNF rules that match no text: the engine fails when its matcher reaches one.

SGLang 0.5.23 masks each token with the grammar's matcher. A rule that can neither begin with a character nor be
empty (``root ::= root``, ``a ::= a "y"``: it only refers to itself before any text) allows no token where it is
expected: the engine samples from a fully masked distribution, fails with ``Grammar accept_token failed: Tokens not
accepted`` and answers 500 (an error event after the 200 when streaming): at the first token when it is the root,
after the text before it otherwise (``root ::= "x" a``). A rule that never ends but always allows a next character
(``root ::= "x" root``) is served: it generates until ``max_tokens``.

:func:`dead_rule` reads the grammar as the backend normalises it (``str(xgrammar.Grammar.from_ebnf(...))``: rules of
choices of sequences, helper rules for ``*``/``+``/``?``, ``{m, n}`` repeats, lookaheads, ``TagDispatch``) and
computes, for each rule, whether it can be empty and whether it can begin with a character (two least fixed points:
no compilation, no vocabulary). A construct it does not know leaves the grammar to the engine.
"""

from __future__ import annotations

import re
from typing import Any

_TOKEN = re.compile(
    r"""(?P<space>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<cls>\[(?:[^\]\\]|\\.)*\](?P<star>\*)?)
  | (?P<repeat>\{\s*(?P<low>\d+)\s*,\s*(?P<high>-?\d+)\s*\})
  | (?P<look>\(=)
  | (?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)
  | (?P<define>::=)
  | (?P<punct>[()|])
  | (?P<other>.)""",
    re.X | re.S,
)
# An expression is a tuple: ("t",) begins with a character, ("e",) the empty string, ("s",) a class repeated (empty, or
# begins with a character), ("l",) a lookahead (consumes nothing), ("r", name), ("a", [[expression...]...]) choices of
# sequences, ("p", low, high, expression) a repeat (high -1: unbounded).
_TERMINAL, _EMPTY, _STAR, _LOOK = ("t",), ("e",), ("s",), ("l",)
Expression = tuple[Any, ...]


class _Unknown(ValueError):
    """The normalised grammar holds something this reading does not know."""


def _rules(text: str) -> dict[str, Expression]:
    """Each rule's body, read in one pass: a stack of open groups, each a list of alternatives (lists of expressions).
    The contents of lookaheads and of ``TagDispatch(...)`` are skipped."""
    rules: dict[str, Expression] = {}
    name: str | None = None
    stack: list[list[list[Expression]]] = [[[]]]
    skipping, opens_skip = 0, False
    for match in _TOKEN.finditer(text):
        kind = match.lastgroup
        if kind == "space":
            continue
        token = match.group()
        if opens_skip:  # TagDispatch's own "(" comes next
            if token != "(":
                raise _Unknown(token)
            skipping, opens_skip = 1, False
            continue
        if skipping:
            skipping += 1 if token == "(" or kind == "look" else -1 if token == ")" else 0
            continue
        sequence = stack[-1][-1]
        if kind in ("string", "cls", "star"):
            sequence.append(_EMPTY if token == '""' else _STAR if token.endswith("*") else _TERMINAL)
        elif kind == "name":
            if token == "TagDispatch":  # dispatches on non-empty tags, free text meanwhile: it begins with a character
                sequence.append(_TERMINAL)
                opens_skip = True
            else:
                sequence.append(("r", token))
        elif kind == "define":  # the name just read was the next rule's: the rule before it ends
            if len(stack) != 1 or not sequence or sequence[-1][0] != "r":
                raise _Unknown("::=")
            new_name = sequence.pop()[1]
            if name is not None:
                rules[name] = _choices(stack.pop())
            elif stack[0] != [[]]:
                raise _Unknown("text before the first rule")
            name, stack = new_name, [[[]]]
        elif kind == "look":
            sequence.append(_LOOK)
            skipping = 1
        elif token == "(":
            stack.append([[]])
        elif token == ")":
            if len(stack) == 1:
                raise _Unknown(")")
            group = _choices(stack.pop())
            stack[-1][-1].append(group)
        elif token == "|":
            stack[-1].append([])
        elif kind in ("repeat", "low", "high"):
            if not sequence:
                raise _Unknown(token)
            sequence.append(("p", int(match.group("low")), int(match.group("high")), sequence.pop()))
        else:
            raise _Unknown(token)
    if name is None or len(stack) != 1 or skipping or opens_skip:
        raise _Unknown("an unfinished grammar")
    rules[name] = _choices(stack.pop())
    return rules


def _choices(alternatives: list[list[Expression]]) -> Expression:
    if any(not sequence for sequence in alternatives):
        raise _Unknown("an empty alternative")
    return ("a", alternatives)


def _can_be_empty(expression: Expression, nullable: set[str]) -> bool:
    kind = expression[0]
    if kind in ("e", "s", "l"):
        return True
    if kind == "t":
        return False
    if kind == "r":
        return expression[1] in nullable
    if kind == "a":
        return any(all(_can_be_empty(item, nullable) for item in sequence) for sequence in expression[1])
    return expression[1] == 0 or _can_be_empty(expression[3], nullable)  # a repeat


def _can_begin(expression: Expression, nullable: set[str], begins: set[str]) -> bool:
    kind = expression[0]
    if kind in ("t", "s"):
        return True
    if kind in ("e", "l"):
        return False
    if kind == "r":
        return expression[1] in begins
    if kind == "a":
        for sequence in expression[1]:
            for item in sequence:
                if _can_begin(item, nullable, begins):
                    return True
                if not _can_be_empty(item, nullable):
                    break
        return False
    return expression[2] != 0 and _can_begin(expression[3], nullable, begins)  # a repeat


def _refs(expression: Expression) -> set[str]:
    """The rules an expression refers to."""
    names: set[str] = set()
    pending = [expression]
    while pending:
        expression = pending.pop()
        kind = expression[0]
        if kind == "r":
            names.add(expression[1])
        elif kind == "a":
            pending.extend(item for sequence in expression[1] for item in sequence)
        elif kind == "p":
            pending.append(expression[3])
    return names


def _analyse(rules: dict[str, Expression], refs: dict[str, set[str]]) -> tuple[set[str], set[str]]:
    """(rules that can be empty, rules that can begin with a character): least fixed points, a rule tested again only
    when a rule it refers to joined the set."""
    referrers: dict[str, set[str]] = {name: set() for name in rules}
    for name, names in refs.items():
        for ref in names:
            referrers[ref].add(name)
    nullable: set[str] = set()
    begins: set[str] = set()
    for found in (nullable, begins):
        pending = list(rules)
        while pending:
            name = pending.pop()
            if name in found:
                continue
            body = rules[name]
            if _can_be_empty(body, nullable) if found is nullable else _can_begin(body, nullable, begins):
                found.add(name)
                pending.extend(referrers[name])
    return nullable, begins


def dead_rule(normalized: str, root: str = "root") -> str | None:
    """The first rule reachable from ``root`` (``root`` itself first) that matches no text at all, in the grammar
    ``normalized`` (``str()`` of an ``xgrammar.Grammar``): it can neither begin with a character nor be empty. None when
    every rule can match, or when unsure."""
    try:
        rules = _rules(normalized)
        refs = {name: _refs(body) for name, body in rules.items()}
        if root not in rules or any(not names <= rules.keys() for names in refs.values()):
            return None
        nullable, begins = _analyse(rules, refs)
    except (_Unknown, RecursionError):
        return None
    seen, pending = {root}, [root]
    for name in pending:  # breadth first from root: the rule named is the one nearest to it
        if name not in nullable and name not in begins:
            return name
        for ref in sorted(refs[name] - seen):
            seen.add(ref)
            pending.append(ref)
    return None
