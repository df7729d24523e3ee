"""What a request's grammars may cost the engine to compile is measured before the engine sees them, and bounded.

The probe is the real one (:mod:`launch.grammar_cost`: xgrammar in a child process with the tiny model's tokenizer);
the gateway fronts the session's shared tiny engine. The tiny model's 512-token vocabulary makes every grammar cheap,
so the tests set a small budget (50 ms) and a schema that costs several times it here: the same ratio as the attack
on the 49k-token SmolLM2 at the default budget (tests/gateway/test_grammar_attack.py, the real model's tests).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from engine_guard.compile_budget import GrammarBudget, compiled_grammars
from engine_guard.refusal import Refused
from launch.grammar_cost import CompileCostProbe
from launch.model_info import vocab_size
from launch.process import EngineProcess
from model_code.errors import BadRequestError
from model_code.guard import RequestGuard, grammar_budget
from tests.gateway_server import GatewayServer, serve

BUDGET_S = 0.05


def costly_schema(salt: int = 0) -> dict[str, Any]:
    """Ten strings of ten different maxLength bounds (under 128: xgrammar unrolls those), as the gateway holds them
    (``^.{0,N}$``): about 0.14 s of compile CPU against the tiny tokenizer (three times the tests' budget); each
    ``salt`` a schema of its own (none is known from an earlier one)."""
    properties = {f"p{i}": {"type": "string", "maxLength": 100 + salt + i} for i in range(10)}
    return {"type": "object", "properties": properties, "required": ["p0"]}


ORDINARY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}, "days": {"type": "integer"}}, "required": ["city"]}


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


@pytest.fixture(scope="module")
def probe(tiny_engine: EngineProcess) -> Iterator[CompileCostProbe]:
    path = tiny_engine.config.model_path
    with CompileCostProbe(path, vocab_size(path)) as started:
        started.start()
        yield started


def test_a_grammar_past_the_budget_is_refused_and_its_compile_stopped(probe: CompileCostProbe) -> None:
    budget = GrammarBudget(probe)
    grammars = compiled_grammars({"response_format": schema_format(costly_schema(1))})
    kills, pid = probe.kills, probe.pid
    with pytest.raises(Refused) as refused:
        budget.check(grammars, BUDGET_S, "gateway.request_bounds")
    assert refused.value.code == "grammar_too_costly" and refused.value.param == "response_format"
    assert "gateway.request_bounds.max_grammar_compile_s" in refused.value.message
    assert probe.kills == kills + 1 and probe.pid != pid  # stopped at the budget: the child was killed
    measured = budget.measured
    with pytest.raises(Refused):  # the same schema again: refused from what is remembered, not compiled again
        budget.check(grammars, BUDGET_S, "gateway.request_bounds")
    assert budget.measured == measured and budget.decided(grammars, BUDGET_S)
    cost = budget.check(grammars, 30.0, "gateway.request_bounds")  # a larger budget measures it again, to its end
    assert BUDGET_S <= cost < 30.0 and budget.measured == measured + 1


def test_an_ordinary_schema_is_measured_once_then_known(probe: CompileCostProbe) -> None:
    budget = GrammarBudget(probe)
    grammars = compiled_grammars({"response_format": schema_format(ORDINARY)})
    assert not budget.decided(grammars, BUDGET_S)
    assert budget.check(grammars, BUDGET_S, "s") < BUDGET_S and budget.measured == 1
    assert budget.decided(grammars, BUDGET_S)
    budget.check(grammars, BUDGET_S, "s")
    assert budget.measured == 1


def test_the_grammars_of_one_request_are_summed(probe: CompileCostProbe) -> None:
    """Each tool alone fits the budget; the forced call compiles all of them into one grammar, which does not."""
    schemas = [{"type": "object", "properties": {"s": {"type": "string", "maxLength": 400 + i}}} for i in range(6)]
    budget = GrammarBudget(probe)
    each = [budget.check(compiled_grammars({"response_format": schema_format(schema)}), 1.0, "s") for schema in schemas]
    limit = max(each) * 2
    tools = [{"type": "function", "function": {"name": f"t{i}", "parameters": schema}} for i, schema in enumerate(schemas)]
    body = {"tools": tools, "tool_choice": "required"}
    assert sum(each) > limit and len(compiled_grammars(body)) == 6
    with pytest.raises(Refused) as refused:
        budget.check(compiled_grammars(body), limit, "s")
    assert refused.value.code == "grammar_too_costly" and refused.value.param == "tools"


def test_a_grammar_the_backend_cannot_compile_is_the_clients_error(probe: CompileCostProbe) -> None:
    budget = GrammarBudget(probe)
    with pytest.raises(Refused) as refused:
        budget.check(compiled_grammars({"regex": "(?<=a)b"}), 1.0, "s")  # a lookbehind: parses in re, not in xgrammar
    assert refused.value.code == "invalid_grammar" and refused.value.param == "regex"


@pytest.fixture(scope="module")
def gateway(tiny_engine: EngineProcess) -> Iterator[GatewayServer]:
    with serve({"tiny": {"url": tiny_engine.url}}, {"request_bounds": {"max_grammar_compile_s": BUDGET_S}}) as server:
        yield server


def test_the_gateway_refuses_a_costly_schema_and_serves_an_ordinary_one(gateway: GatewayServer) -> None:
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "Go."}], "max_tokens": 24, "temperature": 0}
    served = client.chat.completions.create(**ask, response_format=schema_format(ORDINARY))  # type: ignore[arg-type]
    assert served.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**ask, response_format=schema_format(costly_schema(2)))  # type: ignore[arg-type]
    assert refused.value.code == "grammar_too_costly" and refused.value.param == "response_format"
    with pytest.raises(openai.BadRequestError) as forced:  # a forced call compiles its tool's parameters: measured too
        client.chat.completions.create(
            **ask, tools=[{"type": "function", "function": {"name": "act", "parameters": costly_schema(3)}}],  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": "act"}},
        )
    assert forced.value.code == "grammar_too_costly" and forced.value.param == "tools"
    auto = client.chat.completions.create(  # offered, not forced and not strict: the engine compiles nothing
        **ask, tools=[{"type": "function", "function": {"name": "act", "parameters": costly_schema(4)}}],  # type: ignore[arg-type]
    )
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_the_other_dialects_are_measured_too(gateway: GatewayServer) -> None:
    responses = httpx.post(gateway.url + "/v1/responses", json={
        "model": "tiny", "input": "Go.", "max_output_tokens": 16,
        "text": {"format": {"type": "json_schema", "name": "a", "schema": costly_schema(5)}},
    }, timeout=60)  # fmt: skip
    assert responses.status_code == 400 and responses.json()["error"]["code"] == "grammar_too_costly"
    messages = httpx.post(gateway.url + "/v1/messages", json={
        "model": "tiny", "max_tokens": 16, "messages": [{"role": "user", "content": "Go."}],
        "tools": [{"name": "act", "input_schema": costly_schema(6)}], "tool_choice": {"type": "any"},
    }, timeout=60)  # fmt: skip
    assert messages.status_code == 400 and messages.json()["error"]["type"] == "invalid_request_error"
    assert "max_grammar_compile_s" in messages.json()["error"]["message"]
    completions = httpx.post(gateway.url + "/v1/completions", json={
        "model": "tiny", "prompt": "Go.", "max_tokens": 8, "json_schema": json.dumps(costly_schema(7)),
    }, timeout=60)  # fmt: skip
    assert completions.status_code == 400 and completions.json()["error"]["code"] == "grammar_too_costly"


def test_the_mlflow_guard_measures_a_managed_engines_grammars(tiny_engine: EngineProcess) -> None:
    """The MLflow path's guard of a managed engine (its config: a local tokenizer, xgrammar) refuses the same way."""
    config = tiny_engine.config
    budget = grammar_budget(config, vocab_size(config.model_path))
    assert budget is not None
    guard = RequestGuard("tiny", bounds=RequestGuard("tiny").bounds.model_copy(update={"max_grammar_compile_s": BUDGET_S}), grammar_budget=budget)
    try:
        guard.check([{"role": "user", "content": "Go."}], {"model": "tiny", "response_format": schema_format(ORDINARY)})
        with pytest.raises(BadRequestError) as refused:
            guard.check([{"role": "user", "content": "Go."}], {"model": "tiny", "response_format": schema_format(costly_schema(8))})
        assert refused.value.code == "grammar_too_costly" and "request_bounds in model_config" in str(refused.value)
    finally:
        guard.close()
    assert budget.probe.pid is None  # type: ignore[attr-defined]
