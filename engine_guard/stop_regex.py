"""Which ``stop_regex`` patterns Python's backtracking ``re`` searches in time linear in the text.

SGLang 0.5.23 searches each ``stop_regex`` with ``re.search`` on the scheduler thread at every decode step, over the
output's last ``get_max_seq_length(pattern) + 1`` tokens: a fixed tail when every quantifier is bounded, the whole
output when one is not (``*``, ``+``, ``{n,}``). A pattern that backtracks badly there freezes every request on the
engine: ``(x+x+)+y`` is exponential, ``x+y`` and ``\\s*$`` are quadratic in the text (each start position rescans
the same run). Two kinds of pattern are accepted:

**Bounded** (no unbounded quantifier): no quantifier inside another, at most ``STOP_REGEX_MAX_MATCH`` characters
matched (the tail the engine searches) and at most ``STOP_REGEX_MAX_WORK`` ways to match at one start position (the
product of the quantifiers' choices).

**Linear** (unbounded quantifiers): the pattern is a sequence (or, at its end, an alternation of sequences) of
bounded *pieces* and *runs*, a run being an unbounded quantifier over one character (a literal, a class, ``.``), and
every run but a final one is *separated*: between it and the previous run (or the pattern's start) stands a piece
that consumes at least one character and only characters the run cannot match (or ``^``/``\\A`` without MULTILINE).
``[.!?]\\s*$`` is linear: ``[.!?]`` separates ``\\s*``.

Why that is linear. A run is scanned from where its separator ends, through the characters it matches, to the first
one it cannot. Separator occurrences consist of characters outside the run's set, so scans begun after two
occurrences further apart than the pieces between them never overlap: every character of the text is scanned by a
run a bounded number of times, however many start positions and backtracking paths reach it (the count is the
product below). Backtracking into a run tries each position of its scan once, and from each the rest of the pattern
up to the next run's separator is bounded work, since that run's scan is counted where it begins. A final run (the
pattern's last item) needs no separator: reaching it either matches (the search ends) or fails within its minimum
count. Without a separator the count is unbounded: in ``x+x+y`` the second run rescans what the first gave back; in
``\\s*$`` every start inside a run of spaces rescans its rest.

The bounded work per character of text is ``W x prod(1 + G_j) x (m + 1)``: ``W`` the product of the pieces' choices,
``G_j`` the longest text of the pieces between run ``j`` and the run before it (how many backtracking paths can end on
one separator), ``m`` a final run's minimum count; an alternation costs the sum of its branches. It must stay within
``STOP_REGEX_MAX_LINEAR_WORK``, smaller than the bounded budget because the whole output is searched, at every
decode step (linear per step, as SGLang's own stop strings are over the decoded text).

Refused whatever the bounds: backreferences and conditionals (matching them is not a regular language), a quantifier
inside a quantifier, an unbounded quantifier over more than one character or inside a repeated group, a lookaround
or an alternation that is not the pattern's end. An atomic group ``(?>...)`` is costed as a plain group (atomicity
only removes backtracking), never as one character: ``(?>(x+x+)+y)`` is exponential inside it. Character sets are computed with ``re``'s own categories; under
IGNORECASE a set holding a cased character is widened to every cased character (case folding stays among them).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

try:  # re's parser (stable since 3.11 as re._parser; sre_parse before)
    from re import _constants as _sre  # type: ignore[attr-defined]
    from re import _parser as _sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - Python < 3.11
    import sre_constants as _sre  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]

STOP_REGEX_MAX_MATCH = 256  # longest text a bounded stop_regex may match (the engine searches a tail this long)
STOP_REGEX_MAX_WORK = 4096  # ways a bounded stop_regex may match at one start (product of the quantifiers' choices)
STOP_REGEX_MAX_LINEAR_WORK = 32  # backtracking work per character of text for a pattern with unbounded quantifiers

_UNBOUNDED = _sre.MAXREPEAT
_REPEATS = (_sre.MAX_REPEAT, _sre.MIN_REPEAT, getattr(_sre, "POSSESSIVE_REPEAT", _sre.MAX_REPEAT))
_ATOMIC = getattr(_sre, "ATOMIC_GROUP", None)
_GROUPS = (_sre.SUBPATTERN, _ATOMIC)
_CHARACTER = (_sre.LITERAL, _sre.NOT_LITERAL, _sre.IN, _sre.ANY, _sre.CATEGORY)
_REFUSED_OPS = {_sre.GROUPREF: "a backreference", _sre.GROUPREF_EXISTS: "a conditional group"}
_START = (_sre.AT_BEGINNING, _sre.AT_BEGINNING_STRING)
_LAST = 0x10FFFF
_UNBOUNDED_WHERE = (
    "an unbounded quantifier (*, +, {n,}) in a stop_regex may only repeat one character (a literal, a class, '.'), "
    "outside repeated groups, lookarounds and alternations other than the pattern's end"
)

Ranges = tuple[tuple[int, int], ...]  # sorted, disjoint, inclusive code point ranges
_ALL: Ranges = ((0, _LAST),)


class _Refused(Exception):
    """Why a pattern is refused (its message is the client's)."""


def stop_regex_problem(pattern: str) -> str | None:
    """Why ``pattern`` would backtrack badly in the engine's ``re.search`` (the module doc), or None if it is safe."""
    try:
        parsed = _sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError) as error:
        return f"invalid regular expression: {error}"
    try:
        _check(parsed, parsed.state.flags)
    except _Refused as refused:
        return str(refused)
    except RecursionError:
        return "nested too deeply"
    return None


def _check(parsed: Any, flags: int) -> None:
    if _has_unbounded(parsed):
        _linear_work([(op, value, flags) for op, value in parsed], _State())
        return
    longest, work = _bounded_cost(parsed, inside_repeat=False)
    if longest > STOP_REGEX_MAX_MATCH:
        raise _Refused(
            f"matches up to {longest} characters; a stop_regex must match at most {STOP_REGEX_MAX_MATCH} "
            "(it is searched at every decode step by a backtracking engine)"
        )
    if work > STOP_REGEX_MAX_WORK:
        raise _Refused(
            f"its quantifiers allow {work} ways to match; at most {STOP_REGEX_MAX_WORK} (use smaller bounds)"
        )


@dataclass(frozen=True)
class _Piece:
    """A bounded item of the top-level sequence."""

    longest: int
    work: int
    shortest: int
    chars: Ranges  # every character it can consume
    start_anchor: bool


@dataclass(frozen=True)
class _State:
    """The walk of a sequence so far: its work per character, and what lies since its last run."""

    work: int = 1
    between: int = 0  # the longest text of the pieces since the last run
    consuming: tuple[Ranges, ...] = ()  # the characters of each piece since the last run that consumes one or more
    anchored: bool = False  # ^ or \A since the last run


def _linear_work(elements: list[tuple[int, Any, int]], state: _State) -> int:
    """Backtracking steps per character of text searched, for a sequence of (op, value, flags) after ``state`` (the
    module doc); _Refused where a run is not separated or the work is over budget. Groups are opened into the
    sequence; an alternation at its end costs the sum of its branches (searching ``A(B|C)`` costs at most searching
    ``AB`` and ``AC``)."""
    pending = elements[::-1]
    while pending:
        op, value, flags = pending.pop()
        if op in _GROUPS:  # an unquantified group: its items belong to this sequence
            inner = (flags | value[1]) & ~value[2] if op == _sre.SUBPATTERN else flags
            pending.extend((item, argument, inner) for item, argument in reversed(_subpatterns(op, value)[0]))
        elif op == _sre.BRANCH and not pending:
            return _within_budget(sum(_linear_work([(o, v, flags) for o, v in branch], state) for branch in value[1]))
        elif op in _REPEATS and value[1] == _UNBOUNDED:
            character = _one_character(value[2], flags)
            if character is None:
                raise _Refused(_UNBOUNDED_WHERE)
            chars = _charset(*character)
            if not pending:  # a final run: it matches, or fails within its minimum count
                return _within_budget(state.work * (value[0] + 1))
            work = _within_budget(state.work * (1 + state.between))
            if not state.anchored and all(_intersects(before, chars) for before in state.consuming):
                raise _Refused(
                    "an unbounded quantifier in a stop_regex must follow a character it cannot match (as in "
                    r"'[.!?]\s*$'), after any unbounded one before it: otherwise matching rescans the same text "
                    "(quadratic or worse)"
                )
            state = _State(work)
        else:
            piece = _piece(op, value, flags)
            work = _within_budget(state.work * piece.work)
            between = state.between + piece.longest
            consuming = state.consuming
            if piece.shortest >= 1 and between <= STOP_REGEX_MAX_LINEAR_WORK:  # past the budget no run may follow
                consuming += (piece.chars,)
            state = _State(work, between, consuming, state.anchored or piece.start_anchor)
    return state.work


def _within_budget(work: int) -> int:
    if work > STOP_REGEX_MAX_LINEAR_WORK:
        raise _Refused(
            f"its backtracking costs over {STOP_REGEX_MAX_LINEAR_WORK} steps per character of output, the most allowed "
            "with an unbounded quantifier (the whole output is searched at every decode step): use smaller bounds"
        )
    return work


def _has_unbounded(pattern: Iterable[tuple[int, Any]]) -> bool:
    for op, value in pattern:
        if op in _REPEATS and (value[1] == _UNBOUNDED or _has_unbounded(value[2])):
            return True
        if any(_has_unbounded(part) for part in _subpatterns(op, value)):
            return True
    return False


def _subpatterns(op: int, value: Any) -> list[Any]:
    """The subpatterns directly inside one parsed item."""
    if op == _sre.SUBPATTERN:
        return [value[-1]]
    if op == _ATOMIC:
        return [value]
    if op == _sre.BRANCH:
        return list(value[1])
    if op in (_sre.ASSERT, _sre.ASSERT_NOT):
        return [value[1]]
    if op == _sre.GROUPREF_EXISTS:
        return [part for part in value[1:] if part is not None]
    return []


def _piece(op: int, value: Any, flags: int) -> _Piece:
    longest, work = _bounded_cost([(op, value)], inside_repeat=False)
    shortest, chars = _consumed([(op, value)], flags)
    start = op == _sre.AT and value in _START and not flags & re.MULTILINE
    return _Piece(longest, work, shortest, chars, start)


def _bounded_cost(pattern: Any, *, inside_repeat: bool) -> tuple[int, int]:
    """(longest match, product of quantifier choices) of a parsed pattern with no unbounded quantifier; _Refused for
    what is refused."""
    longest, work = 0, 1
    for op, value in pattern:
        if op in _REFUSED_OPS:
            raise _Refused(f"{_REFUSED_OPS[op]} is not allowed in a stop_regex (it makes matching backtrack)")
        if op in _REPEATS:
            low, high, body = value
            if high == _UNBOUNDED:
                raise _Refused(_UNBOUNDED_WHERE)
            if inside_repeat and high > 1:
                raise _Refused(
                    "a quantifier inside another quantifier is not allowed in a stop_regex (exponential backtracking)"
                )
            body_longest, body_work = _bounded_cost(body, inside_repeat=True)
            longest += high * body_longest
            work *= (high - low + 1) * body_work
        elif op in _GROUPS:
            inner_longest, inner_work = _bounded_cost(_subpatterns(op, value)[0], inside_repeat=inside_repeat)
            longest += inner_longest
            work *= inner_work
        elif op == _sre.BRANCH:
            costs = [_bounded_cost(branch, inside_repeat=inside_repeat) for branch in value[1]]
            longest += max(cost[0] for cost in costs)
            work *= sum(cost[1] for cost in costs)
        elif op in (_sre.ASSERT, _sre.ASSERT_NOT):
            _, inner_work = _bounded_cost(value[1], inside_repeat=True)
            work *= inner_work
        elif op == _sre.AT:
            continue
        elif op in _CHARACTER:
            longest += 1
        else:  # an operator this check does not know cannot be costed
            raise _Refused(f"{op} is not supported in a stop_regex")
        work = min(work, STOP_REGEX_MAX_WORK + 1)  # enough to refuse; no huge integers
    return longest, work


def _consumed(pattern: Any, flags: int) -> tuple[int, Ranges]:
    """(shortest match, every character a match can consume) of a bounded parsed pattern."""
    shortest, chars = 0, ()
    for op, value in pattern:
        if op in _CHARACTER:
            shortest += 1
            chars = _union(chars, _charset(op, value, flags))
        elif op in _REPEATS:
            low, high, body = value
            body_shortest, body_chars = _consumed(body, flags)
            shortest += low * body_shortest
            chars = _union(chars, body_chars if high > 0 else ())
        elif op == _sre.SUBPATTERN:
            inner_shortest, inner_chars = _consumed(value[-1], (flags | value[1]) & ~value[2])
            shortest += inner_shortest
            chars = _union(chars, inner_chars)
        elif op == _ATOMIC:
            inner_shortest, inner_chars = _consumed(value, flags)
            shortest += inner_shortest
            chars = _union(chars, inner_chars)
        elif op == _sre.BRANCH:
            branches = [_consumed(branch, flags) for branch in value[1]]
            shortest += min(branch[0] for branch in branches)
            for _, branch_chars in branches:
                chars = _union(chars, branch_chars)
        # AT and lookarounds consume nothing
    return shortest, chars


def _one_character(body: Any, flags: int) -> tuple[int, Any, int] | None:
    """(op, value, flags) when ``body`` is one character, possibly in groups; else None."""
    while len(body) == 1 and body[0][0] in _GROUPS:
        op, value = body[0]
        if op == _sre.SUBPATTERN:
            flags = (flags | value[1]) & ~value[2]
        body = _subpatterns(op, value)[0]
    if len(body) == 1 and body[0][0] in _CHARACTER:
        return body[0][0], body[0][1], flags
    return None


# Character sets as ranges of code points.


def _charset(op: int, value: Any, flags: int) -> Ranges:
    """Every character one character item matches (a superset under IGNORECASE)."""
    if op == _sre.LITERAL:
        chars: Ranges = ((value, value),)
    elif op == _sre.NOT_LITERAL:
        chars = _complement(((value, value),))
    elif op == _sre.ANY:
        chars = _ALL if flags & re.DOTALL else _complement(((10, 10),))
    elif op == _sre.CATEGORY:
        chars = _category(value, bool(flags & re.ASCII))
    else:
        chars = _class(value, flags)
    if flags & re.IGNORECASE and _intersects(chars, _cased()):
        chars = _union(chars, _cased())  # a cased character folds only to cased ones
    return chars


def _class(items: Any, flags: int) -> Ranges:
    """A ``[...]`` class: the union of its items, complemented when it opens with ``^``."""
    negate = bool(items) and items[0][0] == _sre.NEGATE
    ranges: list[tuple[int, int]] = []
    for op, value in items[1:] if negate else items:
        if op == _sre.LITERAL:
            ranges.append((value, value))
        elif op == _sre.RANGE:
            ranges.append(value)
        elif op == _sre.CATEGORY:
            ranges.extend(_category(value, bool(flags & re.ASCII)))
        else:  # unknown to this check: the class may match anything
            return _ALL
    chars = _union(tuple(ranges), ())
    return _complement(chars) if negate else chars


_CATEGORIES = {_sre.CATEGORY_DIGIT: r"\d", _sre.CATEGORY_SPACE: r"\s", _sre.CATEGORY_WORD: r"\w"}
_NOT = {
    _sre.CATEGORY_NOT_DIGIT: _sre.CATEGORY_DIGIT,
    _sre.CATEGORY_NOT_SPACE: _sre.CATEGORY_SPACE,
    _sre.CATEGORY_NOT_WORD: _sre.CATEGORY_WORD,
}


def _category(category: Any, ascii_only: bool) -> Ranges:
    """``\\d``, ``\\s``, ``\\w`` and their complements, as ``re`` itself matches them."""
    if category in _NOT:
        return _complement(_categories(ascii_only)[_NOT[category]])
    return _categories(ascii_only).get(category, _ALL)


@functools.cache
def _categories(ascii_only: bool) -> dict[Any, Ranges]:
    """The characters of each category, found by ``re`` over every code point (once, about 0.1 s)."""
    every = "".join(map(chr, range(_LAST + 1)))
    flags = re.ASCII if ascii_only else 0
    return {
        category: tuple((match.start(), match.end() - 1) for match in re.finditer(escape + "+", every, flags))
        for category, escape in _CATEGORIES.items()
    }


@functools.cache
def _cased() -> Ranges:
    """Every character that has a case, as ``re`` decides it (the only ones IGNORECASE can match in place of
    another); once, about 0.1 s."""
    import _sre as sre_module

    iscased = getattr(sre_module, "unicode_iscased", None) or (
        lambda point: chr(point).lower() != chr(point) or chr(point).upper() != chr(point)
    )
    ranges: list[tuple[int, int]] = []
    for point in filter(iscased, range(_LAST + 1)):
        if ranges and ranges[-1][1] == point - 1:
            ranges[-1] = (ranges[-1][0], point)
        else:
            ranges.append((point, point))
    return tuple(ranges)


def _union(first: Ranges, second: Ranges) -> Ranges:
    merged: list[tuple[int, int]] = []
    for low, high in sorted(first + second):
        if merged and low <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], high))
        else:
            merged.append((low, high))
    return tuple(merged)


def _complement(chars: Ranges) -> Ranges:
    result, next_point = [], 0
    for low, high in chars:
        if low > next_point:
            result.append((next_point, low - 1))
        next_point = high + 1
    if next_point <= _LAST:
        result.append((next_point, _LAST))
    return tuple(result)


def _intersects(first: Ranges, second: Ranges) -> bool:
    i = j = 0
    while i < len(first) and j < len(second):
        if first[i][1] < second[j][0]:
            i += 1
        elif second[j][1] < first[i][0]:
            j += 1
        else:
            return True
    return False
