"""Which generated ``stop_regex`` patterns the guard accepts, and how long ``re.search`` takes on each accepted one
over adversarial texts (as SGLang searches them, the whole output when the pattern is unbounded).

Patterns come from a small grammar (literals, classes, ``.``, quantifiers greedy / lazy / possessive, groups,
alternations, anchors); the texts from each pattern's own characters: long runs of each, runs ending in a near
miss, alternations of two, a sample match with a run pumped long and its end broken (the classic ReDoS shape).
Prints the counts (generated, accepted, with an unbounded quantifier, refused), the slowest accepted patterns on
``--length`` characters and their times, and two refused quadratic ones on the same length for scale. Timings are wall clock on this machine; the deterministic check of the same property is
``tests/gateway/test_stop_regex.py`` (step counts of a backtracking matcher).

Run: ``python -m benchmarks.stop_regex [--patterns 3000] [--length 10000] [--seed N]``.
"""

from __future__ import annotations

import argparse
import random
import re
import time
from typing import Any

from engine_guard.stop_regex import stop_regex_problem

try:
    from re import _constants as _sre  # type: ignore[attr-defined]
    from re import _parser as _sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - Python < 3.11
    import sre_constants as _sre  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]

_ATOMS = ["a", "b", "x", " ", r"\.", r"\n", "[ab]", "[^a]", r"\s", r"\d", r"\w", "[.!?]", ".", r"\S", "[a-c]"]
_QUANTIFIERS = ["", "", "", "?", "*", "+", "{1,3}", "{2,}", "*?", "+?", "*+", "{0,2}", "{0,8}", "{1,16}"]
_ANCHORS = ["^", "$", r"\b"]
_UNBOUNDED = re.compile(r"[*+]|\{\d+,\}")
BASELINE = r"[.!?]\s*$"  # SGLang's own test pattern: the reference time per search


def pattern(rng: random.Random, depth: int = 0) -> str:
    """One pattern of the grammar: a sequence of 1-4 elements, an alternation now and then."""
    if rng.random() < 0.15 and depth < 2:
        return pattern(rng, depth + 1) + "|" + pattern(rng, depth + 1)
    parts = []
    for _ in range(rng.randint(1, 4)):
        roll = rng.random()
        if roll < 0.08:
            parts.append(rng.choice(_ANCHORS))
            continue
        if roll < 0.2 and depth < 2:
            atom = rng.choice(["(", "(?:"]) + pattern(rng, depth + 1) + ")"
        else:
            atom = rng.choice(_ATOMS)
        parts.append(atom + rng.choice(_QUANTIFIERS))
    return "".join(parts)


def patterns(seed: int, count: int) -> list[str]:
    """``count`` distinct patterns that parse, drawn from ``seed``."""
    rng, found = random.Random(seed), dict[str, None]()
    while len(found) < count:
        candidate = pattern(rng)
        try:
            re.compile(candidate)
        except re.error:
            continue
        found[candidate] = None
    return list(found)


def _members(op: int, value: Any) -> list[str]:
    """A few characters one parsed character item matches, and one it does not."""
    if op == _sre.LITERAL:
        return [chr(value)]
    if op == _sre.NOT_LITERAL:
        return ["z" if value != ord("z") else "y", chr(value)]
    if op == _sre.ANY:
        return ["z", "\n"]
    if op == _sre.CATEGORY:
        return _members(_sre.IN, [(op, value)])
    chars: list[str] = []
    for item, argument in value:
        if item == _sre.LITERAL:
            chars.append(chr(argument))
        elif item == _sre.RANGE:
            chars += [chr(argument[0]), chr(argument[1])]
        elif item == _sre.CATEGORY:
            name = str(argument)
            chars += {"DIGIT": ["1"], "SPACE": [" ", "\n"], "WORD": ["a", "_"]}.get(name.split("_")[-1], ["z"])
            if "NOT" in name:
                chars += ["z", " ", "1"]
        elif item == _sre.NEGATE:
            chars += ["z", "#"]
    return chars


def _walk(parsed: Any) -> tuple[list[str], str]:
    """(the characters a pattern mentions, one text it matches with each repetition taken once or at its minimum)."""
    chars: list[str] = []
    sample = ""
    for op, value in parsed:
        if op in (_sre.LITERAL, _sre.NOT_LITERAL, _sre.IN, _sre.ANY, _sre.CATEGORY):
            members = _members(op, value)
            chars += members
            sample += members[0]
        elif op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT, getattr(_sre, "POSSESSIVE_REPEAT", -1)):
            inner_chars, inner = _walk(value[2])
            chars += inner_chars
            sample += inner * max(1, min(value[0], 3)) if value[1] else ""
        elif op in (_sre.SUBPATTERN, getattr(_sre, "ATOMIC_GROUP", -1)):
            inner_chars, inner = _walk(value[-1] if op == _sre.SUBPATTERN else value)
            chars += inner_chars
            sample += inner
        elif op == _sre.BRANCH:
            walked = [_walk(branch) for branch in value[1]]
            for branch_chars, _ in walked:
                chars += branch_chars
            sample += walked[0][1]
    return chars, sample


def attack_texts(source: str, length: int) -> list[str]:
    """Texts of about ``length`` characters that make a backtracking search of ``source`` do the most work it can."""
    chars, sample = _walk(_sre_parse.parse(source))
    alphabet = list(dict.fromkeys(chars + ["#"]))[:8]
    texts = []
    for index, char in enumerate(alphabet):
        other = alphabet[(index + 1) % len(alphabet)]
        texts += [char * length, char * (length - 1) + other, char * (length - 1) + "#", (char + other) * (length // 2)]
    if sample:
        broken = sample[:-1] or "#"
        texts.append((broken * (length // len(broken) + 1))[:length])
        for cut in range(len(sample) + 1):  # a run pumped at each point of a sample match, the end broken
            for char in alphabet[:4]:
                pumped = sample[:cut] + char * length + sample[cut:-1] + "#"
                texts.append(pumped[: length + len(sample)])
    return texts  # not deduplicated: the same families at every length, in the same order


def _seconds(compiled: re.Pattern[str], text: str) -> float:
    """CPU seconds of one search (this thread's: other processes on the machine do not count)."""
    started = time.thread_time()
    compiled.search(text)
    return time.thread_time() - started


def _slowest(source: str, length: int) -> tuple[float, int]:
    """(seconds, text length) of the slowest search of ``source`` over its attack texts."""
    compiled = re.compile(source)
    return max((_seconds(compiled, text), len(text)) for text in attack_texts(source, length))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--patterns", type=int, default=3000)
    parser.add_argument("--length", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    generated = patterns(args.seed, args.patterns)
    accepted = [source for source in generated if stop_regex_problem(source) is None]
    unbounded = [source for source in accepted if _UNBOUNDED.search(source)]
    searches = sum(len(attack_texts(source, args.length)) for source in accepted)
    baseline, _ = _slowest(BASELINE, args.length)
    timed = sorted(((*_slowest(source, args.length), source) for source in accepted), reverse=True)
    print(
        f"seed {args.seed}: {len(generated)} patterns, {len(accepted)} accepted ({len(unbounded)} with *, + or {{n,}}), "
        f"{len(generated) - len(accepted)} refused; {searches} searches of ~{args.length} characters (CPU time)"
    )
    print(f"  baseline {BASELINE!r}: {baseline * 1000:.2f} ms")
    for label, rows in (
        ("unbounded", [row for row in timed if row[2] in unbounded]),
        (
            "bounded (SGLang searches these on a tail of <= 257 tokens)",
            [row for row in timed if row[2] not in unbounded],
        ),
    ):
        for seconds, size, source in rows[:3]:
            print(
                f"  slowest accepted, {label}: {seconds * 1000:7.2f} ms ({seconds / baseline:5.1f}x baseline)  {source!r} on {size} characters"
            )
    for source in ("x+y", r"\s*$"):  # refused (quadratic), for the scale
        seconds, size = _slowest(source, args.length)
        print(
            f"  refused, for scale: {seconds * 1000:7.2f} ms ({seconds / baseline:5.1f}x baseline)  {source!r} on {size} characters"
        )


if __name__ == "__main__":
    main()
