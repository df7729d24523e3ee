"""Fuzz generated from the engine's own OpenAPI schema, sent through the gateway with a client key.

``GET /openapi.json`` of the running SGLang server lists every body field each route accepts, its extensions
included: this reaches the fields the gateway does not model (the crash classes the first hardening round
missed were found this way). Each request is a valid base body for its route with one to three fields
replaced by values generated from the engine's schema for that field (:func:`from_schema`), or by
hostile JSON. The real engine must never crash, and no answer may be a
500 or a 502: a client's request is either served or refused (4xx). Lengths are clamped (``max_tokens`` and
friends at most 8) so that thousands of requests fit in minutes; their edges are the other fuzzer's job. Every
field also draws empty values (``""``, ``[]``, ``[""]``, ``null``...), and so do each route's input fields: an input
of no token crashed the engine through the guard; a deterministic sweep of every route's inputs left out
or empty, alone and in pairs (180 requests), covers that class on every run.
``SGLANG_GATEWAY_OPENAPI_FUZZ`` sets how many requests (default 150; the hardening was checked with 5,000); the
seed is fresh each run, printed, and replayable (:mod:`tests.fuzz_seed`).
"""

from __future__ import annotations

import itertools
import json
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

EXAMPLES = int(os.environ.get("SGLANG_GATEWAY_OPENAPI_FUZZ", "150"))
TRACE = os.environ.get("SGLANG_GATEWAY_FUZZ_TRACE")  # a file that gets every request sent (to find a culprit)
HELLO = [{"role": "user", "content": "hi"}]
BASES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": HELLO, "max_tokens": 4},
    "/v1/completions": {"prompt": "hi", "max_tokens": 4},
    "/v1/responses": {"input": "hi", "max_output_tokens": 4},
    "/v1/messages": {"messages": HELLO, "max_tokens": 4},
    "/v1/messages/count_tokens": {"messages": HELLO},
    "/v1/embeddings": {"input": "hi"},
    "/v1/tokenize": {"prompt": "hi"},
    "/v1/detokenize": {"tokens": [1, 2]},
    "/v1/score": {"query": "q", "items": ["a"], "label_token_ids": [1]},
    "/v1/rerank": {"query": "q", "documents": ["a"]},
    "/v1/classify": {"input": "hi"},
}
CLAMPED = {"max_tokens": 8, "max_completion_tokens": 8, "max_output_tokens": 8, "min_tokens": 8, "n": 3, "best_of": 3, "top_logprobs": 5}
hostile = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**64), 2**64), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
# Inputs of no token (an empty score item with no query crashed the engine through the guard): drawn for
# any field, and for the fields that carry a route's input (ABSENT: the field left out) in two requests of three
ABSENT = object()
EMPTIES: list[Any] = [ABSENT, None, "", [], [""], [[]], ["", "a"], [[1], []]]
empties = st.sampled_from(EMPTIES[1:] + [{}])
INPUTS: dict[str, tuple[str, ...]] = {
    "/v1/chat/completions": ("messages",),
    "/v1/completions": ("prompt",),
    "/v1/responses": ("input", "instructions"),
    "/v1/messages": ("messages", "system"),
    "/v1/messages/count_tokens": ("messages", "system"),
    "/v1/embeddings": ("input",),
    "/v1/tokenize": ("prompt", "messages"),
    "/v1/detokenize": ("tokens",),
    "/v1/score": ("query", "items"),
    "/v1/rerank": ("query", "documents"),
    "/v1/classify": ("input",),
}
emptied = st.sampled_from([*EMPTIES, [{"role": "user", "content": ""}], [{"role": "user", "content": []}]])
STATUSES: Counter[int] = Counter()
BAD: list[tuple[str, dict[str, Any], int, str]] = []


@pytest.fixture(scope="module")
def openapi(tiny_engine: EngineProcess) -> dict[str, Any]:
    return httpx.get(tiny_engine.url + "/openapi.json", timeout=30).json()


@pytest.fixture(scope="module")
def fuzzed_gateway(tiny_engine: EngineProcess) -> Iterator[GatewayServer]:
    vocab = vocab_size(tiny_engine.config.model_path)
    models = {"tiny": {"url": tiny_engine.url, "aliases": ["default"], "vocab_size": vocab}}
    with serve(models, {"api_keys": [KEY], "upstream_read_timeout_s": 60}) as gateway:
        yield gateway


def from_schema(schema: Any, components: dict[str, Any], depth: int = 0) -> st.SearchStrategy[Any]:
    """Values of a JSON schema as pydantic writes them (type, anyOf/oneOf, enum, const, arrays, objects, $ref),
    with the hostile edges of each type; deeper than four levels, hostile JSON. (hypothesis-jsonschema does not
    run with this hypothesis version, and cannot draw SGLang's recursive content parts.)"""
    if not isinstance(schema, dict) or depth > 4:
        return hostile
    if "$ref" in schema:
        return from_schema(components["schemas"].get(schema["$ref"].rsplit("/", 1)[1], {}), components, depth + 1)
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([from_schema(option, components, depth + 1) for option in schema[key]])
    kind = schema.get("type")
    if kind == "string":
        return st.one_of(st.text(max_size=30), st.sampled_from(["", "(", "resp_x", "../../flush_cache", "x" * 5000]))
    if kind == "integer":
        return st.one_of(st.integers(-3, 600), st.sampled_from([-(2**63), -(2**31), 2**31, 2**63, 10**20]))
    if kind == "number":
        return st.one_of(st.floats(-1e3, 1e3, allow_nan=False), st.sampled_from([0.0, -1.0, 1e30, -1e30, 1e-30]))
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), components, depth + 1), max_size=4)
    if kind == "object" or "properties" in schema:
        properties = schema.get("properties", {})
        if not properties:
            return st.dictionaries(st.text(max_size=8), hostile, max_size=3)
        required = {name: from_schema(properties[name], components, depth + 1) for name in schema.get("required", []) if name in properties}
        optional = {name: from_schema(prop, components, depth + 1) for name, prop in properties.items() if name not in required}
        return st.fixed_dictionaries(required, optional=optional)
    return hostile


def _field_strategies(openapi: dict[str, Any]) -> dict[str, list[tuple[str, st.SearchStrategy[Any]]]]:
    """Path -> (field, values from the engine's schema for it, or hostile JSON) for every field of every route."""
    components = openapi.get("components", {})
    result: dict[str, list[tuple[str, st.SearchStrategy[Any]]]] = {}
    for path in BASES:
        ref = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        schema = components["schemas"][ref.rsplit("/", 1)[1]]
        result[path] = [
            (name, st.just("tiny") if name == "model" else st.one_of(from_schema(prop, components), hostile, empties))
            for name, prop in schema.get("properties", {}).items()
        ]
    return result


def _clamped(body: dict[str, Any]) -> dict[str, Any]:
    for name, most in CLAMPED.items():
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > most:
            body[name] = most
    if body.get("stream") is not True:
        body.pop("stream", None)
    return body


def test_engine_schema_fuzz_never_crashes_the_engine_nor_answers_5xx(
    fuzzed_gateway: GatewayServer, tiny_engine: EngineProcess, openapi: dict[str, Any]
) -> None:
    pid = tiny_engine.pid
    strategies = _field_strategies(openapi)
    assert set(strategies) == set(BASES) == set(INPUTS) and all(strategies.values())
    started = time.monotonic()
    client = httpx.Client(base_url=fuzzed_gateway.url, headers=auth(), timeout=120)

    print(f"\nopenapi fuzz: {replay()}")

    @seed(SEED)
    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def one_request(data: st.DataObject) -> None:
        path = data.draw(st.sampled_from(sorted(BASES)))
        mode = data.draw(st.sampled_from(["fields", "inputs", "both"]))  # fields of the engine's schema, emptied inputs
        fields = data.draw(st.lists(st.sampled_from(strategies[path]), min_size=mode != "inputs", max_size=3 * (mode != "inputs"), unique_by=lambda item: item[0]))
        body = {"model": "tiny", **BASES[path]}
        for name, values in fields:
            body[name] = data.draw(values)
        if mode != "fields":
            for name in INPUTS[path]:
                body[name] = data.draw(emptied) if data.draw(st.booleans()) else body.get(name, ABSENT)
        body = _clamped({name: value for name, value in body.items() if value is not ABSENT})
        try:
            response = client.post(path, json=body)
        except httpx.HTTPError as error:  # a connection the gateway dropped is a failure too
            BAD.append((path, body, 0, repr(error)))
            return
        STATUSES[response.status_code] += 1
        if TRACE:
            with open(TRACE, "a") as trace:
                trace.write(json.dumps({"path": path, "status": response.status_code, "body": body, "answer": response.text[:300]}, default=repr) + "\n")
        if response.status_code >= 500:
            BAD.append((path, body, response.status_code, response.text[:300]))

    try:
        one_request()
    finally:
        client.close()
    took = time.monotonic() - started
    print(f"openapi fuzz: {sum(STATUSES.values())} requests in {took:.0f}s, statuses {dict(sorted(STATUSES.items()))} ({replay()})")
    assert not BAD, (replay(), BAD[:5])
    assert tiny_engine.running and tiny_engine.pid == pid, f"the engine crashed ({replay()})"
    assert httpx.get(tiny_engine.url + "/health", timeout=30).status_code == 200
    assert sum(STATUSES.values()) >= EXAMPLES // 2  # hypothesis may stop early on a small search space; never at none


def test_empty_inputs_on_every_route_never_crash_the_engine(fuzzed_gateway: GatewayServer, tiny_engine: EngineProcess) -> None:
    """Every route with each of its input fields left out or empty (``""``, ``[]``, ``[""]``, ``[[]]``, ``null``), alone
    and in pairs: served or refused, never a 5xx; the engine's pid is unchanged (an empty score item with no query
    crashed it through the guard). Deterministic: the random fuzz above explores, this covers the class."""
    pid = tiny_engine.pid
    values = [ABSENT, None, "", [""], [[]]]
    statuses: Counter[int] = Counter()
    bad = []
    with httpx.Client(base_url=fuzzed_gateway.url, headers=auth(), timeout=120) as client:
        for path, inputs in INPUTS.items():
            for chosen in itertools.product(values, repeat=len(inputs)):
                body = {"model": "tiny", **BASES[path], **dict(zip(inputs, chosen, strict=True))}
                body = {name: value for name, value in body.items() if value is not ABSENT}
                try:
                    response = client.post(path, json=body)
                except httpx.HTTPError as error:
                    bad.append((path, body, repr(error)))
                    continue
                statuses[response.status_code] += 1
                if response.status_code >= 500:
                    bad.append((path, body, response.text[:300]))
    print(f"\nempty inputs: {sum(statuses.values())} requests, statuses {dict(sorted(statuses.items()))}")
    assert not bad, bad[:5]
    assert tiny_engine.running and tiny_engine.pid == pid, "the engine crashed"
    assert httpx.get(tiny_engine.url + "/health", timeout=30).status_code == 200
