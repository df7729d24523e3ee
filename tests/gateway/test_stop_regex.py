"""The stop_regex rule (engine_guard.stop_regex): unbounded quantifiers are accepted where ``re.search`` stays linear in
the text, refused where it backtracks over the same text again (quadratic) or worse.

Decisions are checked on fixed patterns known either way, and on generated ones with a deterministic oracle: the step
count of a backtracking matcher (tests/regex_steps.py) on each accepted pattern's attack texts grows linearly with the
text (4x the text, at most 5x the steps; a quadratic search grows ~16x). Timing ``re`` itself would be flaky on a
loaded machine: ``python -m benchmarks.stop_regex`` reports the wall of it instead.
"""

from __future__ import annotations

import bisect
import random
import re

import pytest

from benchmarks.stop_regex import attack_texts, patterns
from engine_guard.grammar_checks import GrammarProblem, check_stop_regex
from engine_guard.stop_regex import _charset, _sre_parse, stop_regex_problem
from tests.fuzz_seed import SEED, replay
from tests.regex_steps import Budget, Matcher

LINEAR = [
    r"[.!?]\s*$",  # SGLang's own test of stop_regex (test/kits/matched_stop_kit.py)
    r"and|or",  # ... and its other one
    r"</answer>\s*$",
    r"\.\s+[A-Z]",
    r"Answer:\s*\d+",  # a final run: matching it ends the search
    r"\n[^\n]*$",
    r"^\s*x",  # anchored at the text's start: one start position
    r"(?i)end\s*$",  # 'd' folds among cased characters only; \s has none
    r"a\s*x|b\s*y",  # an alternation at the end: each branch linear
    r"a\s*\s+",  # the second run is final
    r"x+",
    r"\bfoo\b.*",
    r"(?:\d{1,3}\.)\s*$",
]
BACKTRACKING = [
    r"(x+x+)+y",  # nested: exponential
    r"(a|a)*b",  # a repeated group with overlapping branches: exponential
    r"(a*)*b",
    r"x+x+y",  # overlapping runs: each start gives back what the other takes
    r".*.*=.*",
    r"x+y",  # each start rescans the run: quadratic
    r"\s*$",
    r"[.!?]\s*\s*$",  # the second run is not separated from the first
    r"[.!?]\s*x.*y",  # 'x' is a character '.*' can match: its scans from each '.' overlap
    r"c[ab]*c*d",  # 'c' separates [ab]* but not c*
    r"(?m)^\s*x",  # ^ at every line start
    r"\n\s*x",  # '\n' is in \s
    r"(?>x+)y",  # atomic: still one rescan per start
    r"(?>(x+x+)+y)",  # atomic groups are looked into
    r"(?>(x{1,3}){1,3})",
    r"(?=x*)y",  # a lookaround may not hold an unbounded quantifier
    r"a(b\s*|c)d",  # nor an alternation that is not the pattern's end
    r"(ab)*c",  # an unbounded quantifier over more than one character
    r"(a)\1",
    r"\d{0,7}\d{0,7}\.\s*$",  # separated, but 64 ways to match before each run: over the per-character budget
]


@pytest.mark.parametrize("pattern", LINEAR)
def test_patterns_whose_search_is_linear_pass(pattern: str) -> None:
    check_stop_regex(pattern)


@pytest.mark.parametrize("pattern", BACKTRACKING)
def test_patterns_that_backtrack_over_the_same_text_are_refused(pattern: str) -> None:
    with pytest.raises(GrammarProblem):
        check_stop_regex(pattern)


def test_a_refusal_names_the_fix() -> None:
    assert "[.!?]" in (stop_regex_problem(r"x+y") or "")
    assert "one character" in (stop_regex_problem(r"(ab)*c") or "")
    assert "per character" in (stop_regex_problem(r"\d{0,7}\d{0,7}\.\s*$") or "")


def _growth(pattern: str, short: int = 100) -> tuple[float, int, str]:
    """The largest steps(4x text) / steps(text) over ``pattern``'s attack texts (and that text's steps and head)."""
    worst = (0.0, 0, "")
    for small, large in zip(attack_texts(pattern, short), attack_texts(pattern, 4 * short), strict=True):
        try:
            large_steps = Matcher(pattern, budget=2_000_000).search(large)
        except Budget as budget:
            large_steps = budget.args[0]
        small_steps = Matcher(pattern).search(small)
        worst = max(worst, (large_steps / max(small_steps, 1), large_steps, large[:40]))
    return worst


def test_the_step_matcher_finds_what_re_finds() -> None:
    """The oracle matches like ``re`` (so its steps are those of the same search) on the generated patterns it runs
    (those accepted) and random texts."""
    rng = random.Random(SEED)
    for source in [source for source in patterns(SEED, 400) if stop_regex_problem(source) is None]:
        for _ in range(4):
            text = "".join(rng.choice("ab x.\n1!#_") for _ in range(rng.randint(0, 12)))
            assert Matcher(source).found(text) == bool(re.search(source, text)), (source, text, replay())


@pytest.mark.parametrize("pattern", [r"x+y", r"\s*$", r"[.!?]\s*x.*y", r"c[ab]*c*d", r"(?>x+)y", r"\n\s*x"])
def test_the_oracle_sees_quadratic_searches(pattern: str) -> None:
    """The fuzz's oracle can fail: on refused quadratic patterns the steps grow well past 5x."""
    growth, _, _ = _growth(pattern)
    assert growth > 8, (pattern, growth)


def test_generated_patterns_accepted_with_unbounded_quantifiers_search_in_linear_steps() -> None:
    generated = patterns(SEED, 400)
    accepted = [source for source in generated if stop_regex_problem(source) is None]
    unbounded = [source for source in accepted if re.search(r"[*+]|\{\d+,\}", source)]
    print(
        f"\nstop_regex fuzz: {len(generated)} patterns, {len(accepted)} accepted, {len(unbounded)} unbounded ({replay()})"
    )
    assert len(unbounded) >= 20, "the generator should reach unbounded quantifiers"
    for source in unbounded:
        growth, steps, text = _growth(source)
        assert growth <= 5, (
            f"{source!r}: {growth:.1f}x the steps on 4x the text ({steps} steps, {text!r}...; {replay()})"
        )


@pytest.mark.parametrize(
    "atom", [r"\s", r"\d", r"[.!?]", r"\.", r"[ \t]", r"\w", r"\W", r"[^a]", "a", "[a-z]", r"\S", "k", "s"]
)
def test_ignorecase_sets_hold_every_character_re_folds_into_them(atom: str) -> None:
    """Under IGNORECASE the rule's set of an atom holds every character ``re`` matches with it (whole Unicode)."""
    every = "".join(map(chr, range(0x110000)))
    matched = {match.start() for match in re.finditer(atom, every, re.IGNORECASE)}
    ((op, value),) = _sre_parse.parse(atom)
    ranges = _charset(op, value, re.IGNORECASE | re.UNICODE)
    starts = [low for low, _ in ranges]
    outside = [
        point
        for point in sorted(matched)
        if (at := bisect.bisect_right(starts, point) - 1) < 0 or point > ranges[at][1]
    ]
    assert outside == [], (atom, [chr(point) for point in outside[:5]])
