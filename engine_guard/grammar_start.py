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
from dataclasses import dataclass

_TOKEN = re.compile(
    r"""(?P<space>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<cls>\[(?:[^\]\\]|\\.)*\](?P<star>\*)?)
  | (?P<repeat>\{\s*(?P<low>\d+)\s*,\s*(?P<high>-?\d+)\s*\})
  | (?P<look>\(=)
  | (?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)
  | (?P<define>::=)
  | (?P<punct>[()|,=])
  | (?P<other>.)""",
    re.X,
)


class _Unknown(ValueError):
    """The normalised grammar holds something this reading does not know."""


@dataclass(frozen=True)
class _Token:
    kind: str
    text: str
    low: int = 0
    high: int = 0


@dataclass
class _Node:
    """One expression: ``kind`` is terminal, empty, star (a class repeated, may be empty), ref, seq, alt, repeat, look."""

    kind: str
    children: list[_Node]
    name: str = ""
    low: int = 0
    high: int = 0


def _tokens(text: str) -> list[_Token]:
    tokens = []
    for match in _TOKEN.finditer(text):
        kind = match.lastgroup
        if kind == "space":
            continue
        if kind == "other":
            raise _Unknown(text[match.start() : match.start() + 20])
        if kind in ("star", "low", "high"):  # the last group of a class or a repeat: the whole token is its parent's
            kind = "cls" if kind == "star" else "repeat"
        value = match.group(kind)
        if kind == "string":
            tokens.append(_Token("empty" if value == '""' else "terminal", value))
        elif kind == "cls":
            tokens.append(_Token("star" if match.group("star") else "terminal", value))
        elif kind == "repeat":
            tokens.append(_Token("repeat", value, int(match.group("low")), int(match.group("high"))))
        else:
            tokens.append(_Token(kind, value))
    return tokens


class _Parser:
    """Recursive descent over one rule's body: alt := seq ('|' seq)*; seq := item+; item := atom repeat?."""

    def __init__(self, tokens: list[_Token]) -> None:
        self.tokens, self.at = tokens, 0

    def peek(self) -> _Token | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def take(self, text: str | None = None) -> _Token:
        token = self.peek()
        if token is None or (text is not None and token.text != text):
            raise _Unknown(f"expected {text!r}")
        self.at += 1
        return token

    def alt(self) -> _Node:
        options = [self.seq()]
        while (token := self.peek()) is not None and token.text == "|":
            self.take()
            options.append(self.seq())
        return options[0] if len(options) == 1 else _Node("alt", options)

    def seq(self) -> _Node:
        items = []
        while (token := self.peek()) is not None and token.text not in ("|", ")"):
            items.append(self.item())
        if not items:
            raise _Unknown("an empty sequence")
        return items[0] if len(items) == 1 else _Node("seq", items)

    def item(self) -> _Node:
        node = self.atom()
        while (token := self.peek()) is not None and token.kind == "repeat":
            self.take()
            node = _Node("repeat", [node], low=token.low, high=token.high)
        return node

    def atom(self) -> _Node:
        token = self.take()
        if token.kind in ("terminal", "empty", "star"):
            return _Node(token.kind, [])
        if token.kind == "name":
            if token.text == "TagDispatch":  # dispatches on non-empty tags, free text meanwhile: it begins with a character
                self.take("(")
                self._skip_group()
                return _Node("terminal", [])
            return _Node("ref", [], name=token.text)
        if token.kind == "look":  # a lookahead consumes nothing
            self._skip_group()
            return _Node("look", [])
        if token.text == "(":
            node = self.alt()
            self.take(")")
            return node
        raise _Unknown(token.text)

    def _skip_group(self) -> None:
        """Skip to the parenthesis that closes the one just taken (strings are whole tokens: theirs do not count)."""
        depth = 1
        while depth:
            token = self.take()
            depth += 1 if token.text == "(" or token.kind == "look" else -1 if token.text == ")" else 0


def _rules(text: str) -> dict[str, _Node]:
    tokens = _tokens(text)
    starts = [i for i in range(len(tokens) - 1) if tokens[i].kind == "name" and tokens[i + 1].kind == "define"]
    if not starts or starts[0] != 0:
        raise _Unknown("no rule")
    rules = {}
    for begin, end in zip(starts, [*starts[1:], len(tokens)], strict=True):
        parser = _Parser(tokens[begin + 2 : end])
        rules[tokens[begin].text] = parser.alt()
        if parser.peek() is not None:
            raise _Unknown(parser.tokens[parser.at].text)
    return rules


def _analyse(rules: dict[str, _Node]) -> tuple[set[str], set[str]]:
    """(rules that can be empty, rules that can begin with a character): least fixed points."""
    nullable: set[str] = set()
    begins: set[str] = set()

    def can_be_empty(node: _Node) -> bool:
        if node.kind in ("empty", "star", "look"):
            return True
        if node.kind == "terminal":
            return False
        if node.kind == "ref":
            return node.name in nullable
        if node.kind == "seq":
            return all(can_be_empty(child) for child in node.children)
        if node.kind == "alt":
            return any(can_be_empty(child) for child in node.children)
        return node.low == 0 or can_be_empty(node.children[0])  # repeat

    def can_begin(node: _Node) -> bool:
        if node.kind in ("terminal", "star"):
            return True
        if node.kind in ("empty", "look"):
            return False
        if node.kind == "ref":
            return node.name in begins
        if node.kind == "seq":
            for child in node.children:
                if can_begin(child):
                    return True
                if not can_be_empty(child):
                    return False
            return False
        if node.kind == "alt":
            return any(can_begin(child) for child in node.children)
        return node.high != 0 and can_begin(node.children[0])  # repeat (high -1: unbounded)

    referrers: dict[str, set[str]] = {name: set() for name in rules}
    for name, body in rules.items():
        for ref in _refs(body):
            referrers.setdefault(ref, set()).add(name)
    for found, test in ((nullable, can_be_empty), (begins, can_begin)):
        pending = list(rules)  # a rule is tested again only when a rule it refers to joined the set
        while pending:
            name = pending.pop()
            if name not in found and test(rules[name]):
                found.add(name)
                pending.extend(referrers.get(name, ()))
    return nullable, begins


def dead_rule(normalized: str, root: str = "root") -> str | None:
    """The first rule reachable from ``root`` (``root`` itself first) that matches no text at all, in the grammar
    ``normalized`` (``str()`` of an ``xgrammar.Grammar``): it can neither begin with a character nor be empty. None when
    every rule can match, or when unsure."""
    try:
        rules = _rules(normalized)
        if root not in rules or any(not _refs(body) <= rules.keys() for body in rules.values()):
            return None
        nullable, begins = _analyse(rules)
    except (_Unknown, RecursionError):
        return None
    seen, pending = {root}, [root]
    while pending:  # breadth first from root: the rule named is the one nearest to it
        name = pending.pop(0)
        if name not in nullable and name not in begins:
            return name
        for ref in sorted(_refs(rules[name]) - seen):
            seen.add(ref)
            pending.append(ref)
    return None


def _refs(node: _Node) -> set[str]:
    """The rules an expression refers to."""
    names: set[str] = set()
    pending = [node]
    while pending:
        node = pending.pop()
        if node.kind == "ref":
            names.add(node.name)
        pending.extend(node.children)
    return names
