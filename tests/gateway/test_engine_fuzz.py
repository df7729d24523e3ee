"""Fuzz the real SGLang engine through the gateway: well-formed requests with hostile parameter values.

Where ``test_property`` proves that malformed bodies stop at the gateway, this one sends requests the
gateway lets through (or should stop) with SGLang's own sampling and decoding parameters at their
edges: token ids around the vocabulary, huge and negative numbers, empty stops, odd grammars and
schemas, logit biases, streams with usage. The engine must never crash and no answer may be a 500
(a 502 would mean the engine failed on a client's request). ``SGLANG_GATEWAY_FUZZ_EXAMPLES`` sets
how many requests are generated (default 300; the hardening work was checked with several thousand); the seed is
fresh each run, printed, and replayable (:mod:`tests.fuzz_seed`).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from launch.model_info import vocab_size
from launch.process import EngineProcess
from tests.fuzz_seed import SEED, replay
from tests.gateway_server import KEY, GatewayServer, auth, serve

pytestmark = pytest.mark.engine
EXAMPLES = int(os.environ.get("SGLANG_GATEWAY_FUZZ_EXAMPLES", "300"))
VOCAB = 512  # the tiny model's (checked below)
SEEN: Counter[str] = Counter()

edge_ints = st.sampled_from([-(2**63), -(2**31), -1, 0, 1, 2, 7, VOCAB - 1, VOCAB, VOCAB + 1, 2**31, 2**63, 10**20])
small_ints = st.integers(-3, 8)
numbers = st.one_of(st.floats(allow_nan=False, allow_infinity=False, width=32), st.sampled_from([0.0, 1e-30, 1e30, -1e30, 2.0, -2.0]))
token_ids = st.one_of(st.integers(0, VOCAB - 1), edge_ints)
texts = st.text(max_size=24)
schemas = st.sampled_from(
    [
        {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
        {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}},
        {"type": "string", "enum": ["yes", "no"]},
        {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
        {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
        {"type": "string", "pattern": "(["},
        {},
    ]
)
SAMPLING: dict[str, st.SearchStrategy[Any]] = {
    "temperature": numbers,
    "top_p": numbers,
    "top_k": st.one_of(edge_ints, small_ints),
    "min_p": numbers,
    "max_tokens": st.one_of(st.integers(0, 6), edge_ints),
    "max_completion_tokens": st.one_of(st.integers(0, 6), edge_ints),
    "min_tokens": st.one_of(small_ints, edge_ints),
    "n": st.one_of(st.integers(1, 3), edge_ints),
    "seed": edge_ints,
    "sampling_seed": edge_ints,
    "stop": st.one_of(texts, st.lists(texts, max_size=3)),
    "stop_token_ids": st.lists(token_ids, max_size=3),
    "logit_bias": st.dictionaries(token_ids.map(str), numbers, max_size=3),
    "frequency_penalty": numbers,
    "presence_penalty": numbers,
    "repetition_penalty": numbers,
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "no_stop_trim": st.booleans(),
    "regex": st.sampled_from(["[a-z]{1,3}", "(a*)*b", "(", "", ".*", "\\d+"]),
    "ebnf": st.sampled_from(['root ::= "a" | "b"', "root ::= (", 'root ::= "x" root', ""]),
    "json_schema": schemas.map(lambda s: __import__("json").dumps(s)),
    "response_format": st.one_of(
        st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
        schemas.map(lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}),
    ),
    "stream_options": st.sampled_from([{"include_usage": True}, {"include_usage": False}, {"include_usage": True, "continuous_usage_stats": True}]),
    "rid": texts,
    "priority": edge_ints,
    "user": texts,
}
CHAT_ONLY: dict[str, st.SearchStrategy[Any]] = {
    "logprobs": st.booleans(),
    "top_logprobs": st.one_of(st.integers(0, 20), edge_ints),
    "continue_final_message": st.booleans(),
    "separate_reasoning": st.booleans(),
    "chat_template_kwargs": st.dictionaries(st.text(max_size=5), st.one_of(st.booleans(), texts), max_size=2),
    "tool_choice": st.sampled_from(["none", "auto", "required"]),
    "tools": st.just([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}]),
}
COMPLETION_ONLY: dict[str, st.SearchStrategy[Any]] = {
    "logprobs": st.one_of(st.integers(0, 20), edge_ints),
    "echo": st.booleans(),
    "suffix": texts,
}
messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "developer"]), "content": texts}),
    min_size=1,
    max_size=3,
)
prompts = st.one_of(texts.filter(bool), st.lists(token_ids, min_size=1, max_size=4), st.lists(st.lists(token_ids, min_size=1, max_size=3), min_size=1, max_size=2))


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    path = draw(st.sampled_from(["/v1/chat/completions", "/v1/chat/completions", "/v1/completions", "/v1/embeddings"]))
    if path == "/v1/embeddings":
        return path, {"model": "tiny", "input": draw(prompts), **draw(st.fixed_dictionaries({}, optional={"dimensions": edge_ints}))}
    extra = CHAT_ONLY if path == "/v1/chat/completions" else COMPLETION_ONLY
    fields = {**SAMPLING, **extra}
    chosen = draw(st.lists(st.sampled_from(sorted(fields)), max_size=5, unique=True))
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 4}
    body.update({name: draw(fields[name]) for name in chosen})
    body["messages" if path == "/v1/chat/completions" else "prompt"] = draw(messages if path == "/v1/chat/completions" else prompts)
    body["stream"] = draw(st.booleans())
    return path, body


@pytest.fixture(scope="module")
def fuzz_target(tiny_engine: EngineProcess) -> Iterator[tuple[GatewayServer, httpx.Client]]:
    assert vocab_size(tiny_engine.config.model_path) == VOCAB
    models = {"tiny": {"engine": {"model_path": tiny_engine.config.model_path, "device": "cpu"}}}
    with serve(models, {"api_keys": [KEY]}, engines={"tiny": tiny_engine}) as gw:
        with httpx.Client(base_url=gw.url, headers=auth(), timeout=httpx.Timeout(120.0)) as http:
            yield gw, http


@seed(SEED)
@settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(case=requests())
def test_engine_survives_hostile_parameters(fuzz_target: tuple[GatewayServer, httpx.Client], tiny_engine: EngineProcess, case: tuple[str, dict[str, Any]]) -> None:
    _, http = fuzz_target
    path, body = case
    pid = tiny_engine.pid
    with http.stream("POST", path, json=body) as response:
        content = response.read()
    SEEN[str(response.status_code)] += 1
    assert response.status_code < 500, (response.status_code, body, content[:500], replay())
    assert tiny_engine.running and tiny_engine.pid == pid, f"the engine died on {body} ({replay()})"
    if response.status_code >= 400:
        assert b'"error"' in content and b"Traceback" not in content


def test_fuzz_summary_and_engine_alive(fuzz_target: tuple[GatewayServer, httpx.Client], tiny_engine: EngineProcess) -> None:
    """Runs after the fuzz test: the engine still answers, and both refusals and answers were seen."""
    _, http = fuzz_target
    time.sleep(1)
    assert tiny_engine.running
    ok = http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert ok.status_code == 200
    print(f"\nfuzz: {sum(SEEN.values())} requests, statuses {dict(SEEN)} ({replay()})")
    if sum(SEEN.values()) >= 50:
        assert SEEN["200"] > 0 and any(code.startswith("4") for code in SEEN), dict(SEEN)
