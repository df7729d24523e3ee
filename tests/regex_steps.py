"""A backtracking regex matcher that counts its steps: the deterministic measure of how much work a search does.

It runs ``re``'s own parse tree the way ``re``'s engine does (leftmost start first, greedy / lazy / possessive
repeats, alternatives in order, no memo), minus ``re``'s shortcuts (a literal prefix scan, a check of the next
literal before backtracking), so its step count bounds the work of ``re.search`` up to a constant factor. One step:
one item tried at one position, or one character scanned by a repeat. Only what the stop_regex fuzz generates is
supported (no lookbehind, backreference or flag); anything else raises.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

try:
    from re import _constants as _sre  # type: ignore[attr-defined]
    from re import _parser as _sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - Python < 3.11
    import sre_constants as _sre  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]

_POSSESSIVE = getattr(_sre, "POSSESSIVE_REPEAT", None)
_ATOMIC = getattr(_sre, "ATOMIC_GROUP", None)
_REPEATS = (_sre.MAX_REPEAT, _sre.MIN_REPEAT, _POSSESSIVE)
_CHARACTER = (_sre.LITERAL, _sre.NOT_LITERAL, _sre.IN, _sre.ANY)
Then = Callable[[int], bool]


class Budget(Exception):
    """The search took more steps than allowed (the caller's sign of superlinear work)."""


def _category(category: Any, char: str) -> bool:
    name = str(category).removeprefix("CATEGORY_")
    negated = name.startswith("NOT_")
    test = {"DIGIT": str.isdecimal, "SPACE": str.isspace, "WORD": lambda c: c.isalnum() or c == "_"}[
        name.removeprefix("NOT_")
    ]
    return test(char) != negated


def _matches(op: int, value: Any, char: str) -> bool:
    """Whether one character item matches ``char`` (no flags: the fuzz generates none)."""
    if op == _sre.LITERAL:
        return ord(char) == value
    if op == _sre.NOT_LITERAL:
        return ord(char) != value
    if op == _sre.ANY:
        return char != "\n"
    negate = bool(value) and value[0][0] == _sre.NEGATE
    found = False
    for item, argument in value[1:] if negate else value:
        if item == _sre.LITERAL:
            found = ord(char) == argument
        elif item == _sre.RANGE:
            found = argument[0] <= ord(char) <= argument[1]
        elif item == _sre.CATEGORY:
            found = _category(argument, char)
        else:
            raise NotImplementedError(item)
        if found:
            break
    return found != negate


class Matcher:
    """``search`` counts the steps of one leftmost search of ``pattern`` in a text."""

    def __init__(self, pattern: str, *, budget: int = 10**7) -> None:
        self.parsed = _sre_parse.parse(pattern)
        self.budget = budget
        self.steps = 0
        self.text = ""

    def search(self, text: str) -> int:
        """The steps of ``re.search(pattern, text)``'s work (the search stops at the first match, as ``re``'s does)."""
        self.text, self.steps = text, 0
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, 20 * len(text) + 10_000))
        try:
            for start in range(len(text) + 1):
                if self._sequence(list(self.parsed), 0, start, lambda _: True):
                    break
        finally:
            sys.setrecursionlimit(limit)
        return self.steps

    def found(self, text: str) -> bool:
        """Whether the search finds a match (to check this matcher against ``re``)."""
        self.text = text
        return any(self._sequence(list(self.parsed), 0, start, lambda _: True) for start in range(len(text) + 1))

    def _step(self, count: int = 1) -> None:
        self.steps += count
        if self.steps > self.budget:
            raise Budget(self.steps)

    def _sequence(self, items: list[tuple[int, Any]], index: int, at: int, then: Then) -> bool:
        if index == len(items):
            return then(at)
        self._step()
        op, value = items[index]

        def rest(position: int) -> bool:
            return self._sequence(items, index + 1, position, then)

        if op in _CHARACTER:
            return at < len(self.text) and _matches(op, value, self.text[at]) and rest(at + 1)
        if op == _sre.AT:
            return self._anchor(value, at) and rest(at)
        if op == _sre.SUBPATTERN:
            return self._sequence(list(value[-1]), 0, at, rest)
        if op == _sre.BRANCH:
            return any(self._sequence(list(branch), 0, at, rest) for branch in value[1])
        if op in _REPEATS:
            return self._repeat(op, value, at, rest)
        if op == _ATOMIC:  # the body's first match only: no backtracking into it
            ends: list[int] = []
            return self._sequence(list(value), 0, at, lambda end: ends.append(end) is None) and rest(ends[0])
        raise NotImplementedError(op)

    def _anchor(self, where: Any, at: int) -> bool:
        text = self.text
        if where in (_sre.AT_BEGINNING, _sre.AT_BEGINNING_STRING):
            return at == 0
        if where == _sre.AT_END:
            return at == len(text) or (at == len(text) - 1 and text[-1] == "\n")
        if where == _sre.AT_END_STRING:
            return at == len(text)
        if where in (_sre.AT_BOUNDARY, _sre.AT_NON_BOUNDARY):
            before = at > 0 and _category(_sre.CATEGORY_WORD, text[at - 1])
            after = at < len(text) and _category(_sre.CATEGORY_WORD, text[at])
            return (before != after) == (where == _sre.AT_BOUNDARY)
        raise NotImplementedError(where)

    def _repeat(self, op: int, value: Any, at: int, then: Then) -> bool:
        low, high, body = value
        if len(body) == 1 and body[0][0] in _CHARACTER:  # re's REPEAT_ONE: scan, then give back one at a time
            count = 0
            while count < high and at + count < len(self.text) and _matches(*body[0], self.text[at + count]):
                count += 1
            self._step(count)
            if count < low:
                return False
            if op == _POSSESSIVE:
                return then(at + count)
            tries = range(low, count + 1) if op == _sre.MIN_REPEAT else range(count, low - 1, -1)
            return any(self._step() or then(at + taken) for taken in tries)
        return self._iterate(op, low, high, list(body), 0, at, then)

    def _iterate(
        self, op: int, low: int, high: int, body: list[tuple[int, Any]], done: int, at: int, then: Then
    ) -> bool:
        """A repeated group: one more iteration or stop (in the repeat's order); an empty iteration ends it."""

        def more(position: int) -> bool:
            if position == at and done >= low:  # an empty iteration: re stops repeating
                return False
            return self._iterate(op, low, high, body, done + 1, position, then)

        def another() -> bool:
            return done < high and self._sequence(body, 0, at, more)

        def stop() -> bool:
            return done >= low and then(at)

        if op == _POSSESSIVE:  # the greedy repeat's first match only, as an atomic group around it
            ends: list[int] = []
            found = self._iterate(_sre.MAX_REPEAT, low, high, body, done, at, lambda end: ends.append(end) is None)
            return found and then(ends[0])
        return (stop() or another()) if op == _sre.MIN_REPEAT else (another() or stop())
