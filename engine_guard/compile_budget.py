"""The CPU a request's grammars may cost the engine to compile: measured before the engine sees them, refused past a budget.

The engine compiles every grammar (a JSON schema, a regex, an EBNF, a structural tag; a strict or forced tool's
parameters) against the model's whole vocabulary, and some small inputs cost it minutes (see
:mod:`launch.grammar_cost`). :class:`GrammarBudget` measures what the request's grammars cost to compile with the
same grammar backend and tokenizer (a :class:`CompileProbe`, the engine's cost class), stops at the budget
(``request_bounds.max_grammar_compile_s``), and refuses the request (400 ``grammar_too_costly``, naming the setting)
when their sum goes past it: only grammars that compiled within the budget reach an engine. A grammar the backend
refuses outright is the client's 400 ``invalid_grammar`` here, as the engine would fail it.

What was measured is remembered by grammar text (the same schema sent again costs nothing to check), a refusal
included; so is the engine's own compile cache, so that a request whose grammars all passed before is checked
without a measurement. Grammars of one request are summed: the engine compiles a forced call's tools into one
grammar.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from engine_guard.bounds import grammar_inputs
from engine_guard.refusal import Refused

BUDGET_SETTING = "max_grammar_compile_s"
_NOT_COMPILED = ("stop_regex", "json_object")  # matched by Python's re / the engine's one built-in JSON grammar


class Measurement(Protocol):
    cpu_s: float
    finished: bool
    error: str | None
    stalled: bool


class CompileProbe(Protocol):
    """Compiles one grammar as the engine would and says what it cost (:class:`launch.grammar_cost.CompileCostProbe`)."""

    def measure(self, kind: str, text: str, budget_s: float, *, any_whitespace: bool = True) -> Measurement: ...


@dataclass(frozen=True)
class Grammar:
    """One grammar the engine compiles for a request: the field it came from, its kind and its text (as compiled)."""

    field: str
    kind: str
    text: str


def compiled_grammars(body: dict[str, Any]) -> list[Grammar]:
    """The grammars the engine compiles against the vocabulary for ``body`` (after the tool rewrite of
    :func:`engine_guard.tool_calls.guard_tools`: a forced call's tools are compiled), each once."""
    found: dict[tuple[str, str], Grammar] = {}
    for field, kind, value in grammar_inputs(body):
        if kind in _NOT_COMPILED:
            continue
        text = value if isinstance(value, str) else orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
        found.setdefault((kind, text), Grammar(field, kind, text))
    return list(found.values())


@dataclass(frozen=True)
class _Known:
    cpu_s: float  # what it cost; a lower bound when not finished (stopped at a budget)
    finished: bool
    error: str | None = None


class ProbeStalled(RuntimeError):
    """The machine was too busy to give a measurement the budget's CPU in time: retry later (not the grammar's fault)."""


class GrammarBudget:
    """Measures and remembers what grammars cost against one tokenizer (``any_whitespace`` as the engine compiles
    JSON schemas). Thread-safe; measurements run one at a time (the probe's lock)."""

    def __init__(self, probe: CompileProbe, *, any_whitespace: bool = True, remembered: int = 4096) -> None:
        self.probe = probe
        self.any_whitespace = any_whitespace
        self.remembered = remembered
        self._known: collections.OrderedDict[tuple[str, str], _Known] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.measured = 0  # grammars compiled by the probe (the rest were known)

    def decided(self, grammars: list[Grammar], budget_s: float) -> bool:
        """Whether :meth:`check` can decide ``grammars`` from what is known, without a measurement (cheap: no I/O)."""
        total = 0.0
        for grammar in grammars:
            known = self._lookup(grammar)
            if known is None:
                return False
            if known.error is not None:
                return True
            total += known.cpu_s
            if not known.finished and known.cpu_s < budget_s:
                return False  # stopped at a smaller budget than this one: measure again
            if total > budget_s:
                return True
        return True

    def check(self, grammars: list[Grammar], budget_s: float, setting: str) -> float:
        """Raise Refused when the grammars (summed) cost more than ``budget_s`` of CPU to compile (``setting``: the
        budget's key, named in the refusal) or the grammar backend refuses one; ProbeStalled when a measurement could
        not get its CPU in time; the probe's own error when it cannot measure. Returns the grammars' summed cost."""
        total = 0.0
        for grammar in grammars:
            known = self._lookup(grammar)
            if known is None or (not known.finished and known.cpu_s < budget_s - total and known.error is None):
                known = self._measure(grammar, budget_s - total)
            if known.error is not None:
                raise Refused(f"{grammar.field}: the grammar backend cannot compile this {grammar.kind}: {known.error}",
                              code="invalid_grammar", param=grammar.field)  # fmt: skip
            total += known.cpu_s
            if not known.finished or total > budget_s:
                raise Refused(
                    f"{grammar.field}: compiling this request's grammars costs the engine more than the {budget_s:g} s of CPU "
                    f"a request may use ({setting}.{BUDGET_SETTING}); simplify the schema (large or many different "
                    "maxLength / minLength / maxItems bounds, long patterns and big enums cost the most) or ask the operator",
                    code="grammar_too_costly", param=grammar.field,
                )  # fmt: skip
        return total

    def _lookup(self, grammar: Grammar) -> _Known | None:
        with self._lock:
            known = self._known.get((grammar.kind, grammar.text))
            if known is not None:
                self._known.move_to_end((grammar.kind, grammar.text))
            return known

    def _measure(self, grammar: Grammar, budget_s: float) -> _Known:
        cost = self.probe.measure(grammar.kind, grammar.text, max(budget_s, 0.0), any_whitespace=self.any_whitespace)
        self.measured += 1
        if cost.stalled:
            raise ProbeStalled("the machine is too busy to measure this request's grammar cost now; retry later")
        known = _Known(cost.cpu_s, cost.finished, cost.error)
        with self._lock:
            self._known[(grammar.kind, grammar.text)] = known
            while len(self._known) > self.remembered:
                self._known.popitem(last=False)
        return known
