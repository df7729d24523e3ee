"""What the grammar compile budget costs ordinary schemas, and what it saves the engine on costly ones.

For a set of ordinary JSON schemas (the shapes agent frameworks and structured-output clients send: flat and nested
objects, enums, bounded integers, arrays, optional fields, strings bounded as pydantic writes them, held by the
gateway's pattern rewrite as the engine gets them) and a set of costly ones (ten string properties of ten different
``maxLength`` bounds under 128, the attack), each is checked by :class:`engine_guard.compile_budget.GrammarBudget` with
the real probe (:mod:`launch.grammar_cost`: xgrammar and the model's tokenizer, in a process of its own) at the budget.
Printed: per set, how many pass, the added latency of the first check (measured: the probe compiles it) and of a check
once remembered (no compile), the probe's CPU per schema, and for the costly set the CPU the engine would have spent
(each compiled to its end once, without a budget) against what the gateway spent refusing it.

Run: ``python -m benchmarks.grammar_budget [--model .cache/smollm2-instruct] [--budget 2]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from engine_guard.compile_budget import GrammarBudget, compiled_grammars
from engine_guard.refusal import Refused
from engine_guard.tool_calls import guard_tools
from launch.grammar_cost import CompileCostProbe
from launch.model_info import vocab_size


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required if required is not None else list(properties),
            "additionalProperties": False}  # fmt: skip


ORDINARY: list[dict[str, Any]] = [
    _obj({"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}),
    _obj({"query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1, "maximum": 50}}),
    _obj({"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"}}),
    _obj({"items": {"type": "array", "items": _obj({"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}})}}),
    _obj({"sentiment": {"enum": ["positive", "negative", "neutral"]}, "confidence": {"type": "number"}}),
    _obj({"title": {"type": "string", "maxLength": 80}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5}}),
    _obj({"answer": {"type": "string"}, "sources": {"type": "array", "items": {"type": "string"}}}),
    _obj({"a": {"type": "boolean"}, "b": {"type": "null"}, "c": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}),
    _obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}, "amount": {"type": "number"}}),
    _obj({"user": _obj({"id": {"type": "integer"}, "role": {"enum": ["admin", "user", "guest"]}}), "note": {"type": "string", "maxLength": 200}}),
    _obj({"steps": {"type": "array", "items": _obj({"action": {"type": "string"}, "target": {"type": "string"}}), "maxItems": 10}}),
    _obj({"code": {"type": "string", "minLength": 1, "maxLength": 32}, "lang": {"enum": ["python", "go", "rust", "js"]}}),
    {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x"]},
    _obj({"summary": {"type": "string", "maxLength": 500}, "keywords": {"type": "array", "items": {"type": "string", "maxLength": 20}}}),
    _obj({"rating": {"type": "integer", "minimum": 1, "maximum": 5}, "review": {"type": "string"}}),
    _obj({"lat": {"type": "number"}, "lon": {"type": "number"}, "label": {"type": "string"}}),
]
COSTLY: list[dict[str, Any]] = [
    _obj({f"p{i}": {"type": "string", "maxLength": 100 + 2 * salt + i} for i in range(10)}, ["p0"]) for salt in range(6)
]


def _body(schema: dict[str, Any]) -> dict[str, Any]:
    """The chat body as the engine gets it: a response format, its strings held by the guard's rewrite."""
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    guard_tools("/v1/chat/completions", body, "m", None, parser_known=False)
    return body


def run(schemas: list[dict[str, Any]], budget: GrammarBudget, budget_s: float) -> dict[str, Any]:
    """Check each schema twice (measured, then remembered); the outcomes and the latencies in ms."""
    first, again, passed, cpu = [], [], 0, []
    for schema in schemas:
        grammars = compiled_grammars(_body(schema))
        for latencies in (first, again):
            started = time.perf_counter()
            try:
                spent = budget.check(grammars, budget_s, "request_bounds")
                ok = True
            except Refused:
                spent, ok = budget_s, False
            latencies.append((time.perf_counter() - started) * 1000)
        passed += ok
        cpu.append(spent)
    return {"schemas": len(schemas), "passed": passed, "first_ms": first, "again_ms": again, "cpu_s": cpu}


def engine_cost(schemas: list[dict[str, Any]], probe: CompileCostProbe) -> list[float]:
    """What each schema costs to compile to its end (as the engine would, with no budget), in CPU seconds."""
    return [probe.measure("json_schema", compiled_grammars(_body(schema))[0].text, 600.0).cpu_s for schema in schemas]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=".cache/smollm2-instruct", help="Model (tokenizer) directory.")
    parser.add_argument("--budget", type=float, default=2.0, help="request_bounds.max_grammar_compile_s")
    args = parser.parse_args(argv)
    with CompileCostProbe(args.model, vocab_size(args.model)) as probe:
        started = time.perf_counter()
        probe.start()
        print(f"probe start: {time.perf_counter() - started:.1f} s (once per tokenizer; again after each refusal's kill)")
        budget = GrammarBudget(probe, any_whitespace=False)
        for name, schemas in (("ordinary", ORDINARY), ("costly", COSTLY)):
            result = run(schemas, budget, args.budget)
            first, again = result["first_ms"], result["again_ms"]
            print(
                f"{name:9s} {result['passed']}/{result['schemas']} pass at {args.budget:g} s | first check ms: median "
                f"{statistics.median(first):.1f}, max {max(first):.1f} | remembered ms: median {statistics.median(again):.3f}, "
                f"max {max(again):.3f} | probe CPU s/schema: median {statistics.median(result['cpu_s']):.3f}, max {max(result['cpu_s']):.3f}"
            )
        full = engine_cost(COSTLY, probe)
        print(f"costly    engine CPU to compile each to its end: median {statistics.median(full):.1f} s, total {sum(full):.1f} s "
              f"(refused at {args.budget:g} s each: at most {args.budget * len(COSTLY):g} s of the probe's CPU, none of the engine's)")


if __name__ == "__main__":
    main()
