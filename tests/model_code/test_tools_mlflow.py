"""The agent path through MLflow: each flavour's ``predict`` and ``predict_stream`` with tools, in URL mode (the
session's engine) and managed mode (the loaded model starts its own engine), return the flavour's own tool-call
objects with schema-valid arguments; on the real default model (SmolLM2-135M-Instruct), a two-turn agent loop (call
-> tool result -> final answer) runs through ``mlflow.pyfunc.load_model`` and through ``mlflow models serve``, and
greedy, each flavour gives the engine's own answer.

Matrix: 3 flavours x predict/predict_stream x URL/managed = 12 cases, each a forced call (``tool_choice:
required``: the engine's grammar holds it to the tool and its schema, engine_guard.tool_calls), on the real CPU engine
with the tiny random-weight model (the grammar, not the model, makes the call: and ten times faster).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from launch.process import EngineProcess
from model_code.errors import BadRequestError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}}, "required": ["city"]},
    },
}  # fmt: skip
SCHEMA = WEATHER["function"]["parameters"]
QUESTION = [{"role": "user", "content": "What's the weather like in Paris today?"}]
FLAVORS = ("chat_agent", "chat_model", "responses_agent")


def _load(config: dict[str, Any]) -> dict[str, Any]:
    import mlflow

    from model_code import log_model

    models = {}
    for flavor in FLAVORS:
        with mlflow.start_run():
            info = log_model(config, flavor=flavor, flashinfer=None)
        models[flavor] = mlflow.pyfunc.load_model(info.model_uri)
    return models


def _loaded(config: dict[str, Any]) -> Iterator[dict[str, Any]]:
    from model_code import close_model

    models = _load(config)
    yield models
    for model in models.values():
        close_model(model)


@pytest.fixture(scope="module")
def url_models(tiny_engine: EngineProcess, mlflow_store: Path) -> Iterator[dict[str, Any]]:
    yield from _loaded({"models": {"tiny": {"url": tiny_engine.url}}})


@pytest.fixture(scope="module")
def real_models(smollm2_engine: EngineProcess, mlflow_store: Path) -> Iterator[dict[str, Any]]:
    yield from _loaded({"models": {"smollm2": {"url": smollm2_engine.url}}})


@pytest.fixture(scope="module")
def managed_models(starts_engine: None, tiny_model_dir: Path, mlflow_store: Path) -> Iterator[dict[str, Any]]:
    """The three flavours logged with an engine section (tiny-cpu.yaml's): loading starts one engine, shared by the three."""
    engine = {"model_path": str(tiny_model_dir), "device": "cpu", "dtype": "float32", "max_total_tokens": 4096,
              "tool_call_parser": "qwen25"}  # fmt: skip
    yield from _loaded({"models": {"tiny": {"engine": engine}}})


def request(flavor: str, real: bool = False) -> dict[str, Any]:
    """A forced call in each flavour's own request shape: greedy on the real model; sampled on the tiny one, whose
    random weights, greedy, fill a call's JSON with whitespace until max_tokens (sampled, a call ends in tens of tokens)."""
    temperature, tokens = (0, 40) if real else (1.0, 300)
    if flavor == "chat_agent":  # ChatAgent: generation parameters travel in custom_inputs
        return {"messages": QUESTION, "custom_inputs": {"tools": [WEATHER], "tool_choice": "required", "temperature": temperature, "max_tokens": tokens}}
    if flavor == "chat_model":  # ChatModel: ChatParams at the top level (tool_choice is not one: custom_inputs)
        return {"messages": QUESTION, "tools": [WEATHER], "temperature": temperature, "max_tokens": tokens, "custom_inputs": {"tool_choice": "required"}}
    # ResponsesAgent: MLflow 3.17's signature takes `tools` items with only a `type` (a function tool's name and
    # parameters fail its schema check in load_model's predict), so function tools travel in custom_inputs
    return {"input": QUESTION, "custom_inputs": {"tools": [WEATHER], "tool_choice": "required"}, "temperature": temperature, "max_output_tokens": tokens}


def calls_of(flavor: str, model: Any, stream: bool, real: bool = False) -> list[dict[str, Any]]:
    """The calls as each flavour's own objects carry them: [{id, name, arguments}]."""
    body = request(flavor, real)
    if flavor == "chat_agent":
        if not stream:
            (message,) = model.predict(body)["messages"]
            raw = message.get("tool_calls") or []
        else:
            raw = [call for chunk in model.predict_stream(body) for call in chunk["delta"].get("tool_calls") or []]
        return [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in raw]
    if flavor == "chat_model":
        if not stream:
            raw = model.predict(body)["choices"][0]["message"].get("tool_calls") or []
        else:
            raw = [c for chunk in model.predict_stream(body) for choice in chunk["choices"] for c in choice["delta"].get("tool_calls") or []]
        return [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in raw]
    if not stream:
        items = model.predict(body)["output"]
    else:
        items = [event["item"] for event in model.predict_stream(body) if event["type"] == "response.output_item.done"]
    return [{"id": i["call_id"], "name": i["name"], "arguments": i["arguments"]} for i in items if i["type"] == "function_call"]


@pytest.mark.parametrize("stream", [False, True], ids=["predict", "predict_stream"])
@pytest.mark.parametrize("flavor", FLAVORS)
@pytest.mark.parametrize("mode", ["url", "managed"])
def test_each_flavour_returns_its_own_tool_call_objects(mode: str, flavor: str, stream: bool, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue(f"{mode}_models")[flavor]
    calls = calls_of(flavor, model, stream)
    assert len(calls) >= 1, calls
    assert len({call["id"] for call in calls}) == len(calls) and all(call["id"] for call in calls)
    for call in calls:
        assert call["name"] == "get_weather"
        jsonschema.validate(json.loads(call["arguments"]), SCHEMA)


@pytest.fixture(scope="module")
def served_real_agent(smollm2_engine: EngineProcess, mlflow_store: Path) -> Iterator[str]:
    """``mlflow models serve --env-manager local`` of a ChatAgent logged against the real model's engine (URL mode)."""
    import os
    import sys

    import mlflow

    from model_code import log_model
    from tests.servers import server_process

    with mlflow.start_run():
        info = log_model({"models": {"smollm2": {"url": smollm2_engine.url}}}, flavor="chat_agent", flashinfer=None)
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])  # its uvicorn from this venv
    env = {**os.environ, "PATH": path, "MLFLOW_TRACKING_URI": f"sqlite:///{mlflow_store}/mlflow.db",
           "MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT": "600"}  # its default 60 s: a CPU model on a loaded machine can pass it
    argv = [sys.executable, "-m", "mlflow", "models", "serve", "-m", info.model_uri, "--env-manager", "local",
            "-h", "127.0.0.1", "-p", "{port}"]  # fmt: skip
    with server_process(argv, log_path=mlflow_store / "mlflow-serve-tools.log", env=env, ready_path="/ping") as server:
        yield server.url


@pytest.mark.real_model
def test_a_two_turn_agent_loop_through_mlflow_models_serve(served_real_agent: str) -> None:
    """The same loop as a serving endpoint's client runs it: two POSTs to /invocations."""
    import httpx

    first = httpx.post(served_real_agent + "/invocations", json=request("chat_agent", real=True), timeout=300)
    assert first.status_code == 200, first.text
    (message,) = first.json()["messages"]
    (call,) = message["tool_calls"][:1]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"])["city"] in ("Paris", "Tokyo")
    turn = QUESTION + [
        {**message, "content": message.get("content") or ""},
        {"role": "tool", "content": "Heavy snow, minus 12 degrees.", "tool_call_id": call["id"], "name": call["function"]["name"], "id": "t1"},
    ]  # fmt: skip
    second = httpx.post(served_real_agent + "/invocations", timeout=300,
                        json={"messages": turn, "custom_inputs": {"tools": [WEATHER], "temperature": 0, "max_tokens": 24}})  # fmt: skip
    assert second.status_code == 200, second.text
    assert "snow" in second.json()["messages"][-1]["content"].lower(), second.json()


@pytest.mark.real_model
@pytest.mark.parametrize("flavor", ["chat_agent", "responses_agent"])
def test_a_two_turn_agent_loop_through_load_model(flavor: str, real_models: dict[str, Any]) -> None:
    """Call -> the tool's result -> an answer made from it, each turn one ``predict`` of the loaded model."""
    model = real_models[flavor]
    (call,) = calls_of(flavor, model, stream=False, real=True)[:1]
    result = "Heavy snow, minus 12 degrees."
    if flavor == "chat_agent":
        turn = QUESTION + [
            {"role": "assistant", "content": "", "id": "a1",
             "tool_calls": [{"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]},
            {"role": "tool", "content": result, "tool_call_id": call["id"], "name": call["name"], "id": "t1"},
        ]  # fmt: skip
        answer = model.predict({"messages": turn, "custom_inputs": {"tools": [WEATHER], "temperature": 0, "max_tokens": 24}})
        text = answer["messages"][-1]["content"]
    else:
        items = QUESTION + [
            {"type": "function_call", "call_id": call["id"], "name": call["name"], "arguments": call["arguments"]},
            {"type": "function_call_output", "call_id": call["id"], "output": result},
        ]
        answer = model.predict({"input": items, "custom_inputs": {"tools": [WEATHER]}, "temperature": 0, "max_output_tokens": 26})
        text = "".join(part["text"] for item in answer["output"] if item["type"] == "message" for part in item["content"])
    assert "snow" in text.lower(), answer


MAX_TOKENS = 24


@pytest.mark.real_model
def test_each_mlflow_flavour_gives_the_engines_answer(smollm2_engine: EngineProcess, real_models: dict[str, Any]) -> None:
    """Greedy, a Japanese prompt: each flavour's predict (and ChatAgent's predict_stream) is the engine's own answer."""
    import httpx

    messages = [{"role": "user", "content": "日本の首都はどこですか？日本語で答えてください。"}]
    direct = httpx.post(smollm2_engine.url + "/v1/chat/completions", timeout=300,
                        json={"model": "smollm2", "messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS}).json()  # fmt: skip
    expected = (direct["choices"][0]["message"]["content"], direct["usage"]["completion_tokens"])
    requests = {
        "chat_agent": {"messages": messages, "custom_inputs": {"temperature": 0, "max_tokens": MAX_TOKENS}},
        "chat_model": {"messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS},
        "responses_agent": {"input": messages, "temperature": 0, "max_output_tokens": MAX_TOKENS},
    }
    for flavor, request in requests.items():
        model = real_models[flavor]
        out = model.predict(request)
        if flavor == "chat_agent":
            got = (out["messages"][0]["content"], out["usage"]["completion_tokens"])
            streamed = "".join(chunk["delta"]["content"] for chunk in model.predict_stream(request))
            assert streamed == expected[0], streamed
        elif flavor == "chat_model":
            got = (out["choices"][0]["message"]["content"], out["usage"]["completion_tokens"])
        else:
            text = "".join(part["text"] for item in out["output"] if item["type"] == "message" for part in item["content"])
            got = (text, expected[1])  # ResponsesAgent's output carries no usage (its text comes from the chat route)
        assert got == expected, flavor


def test_the_guard_ends_a_forced_call_where_the_client_sends_it() -> None:
    """The MLflow path ends a call that must come alone as the gateway does (engine_guard.tool_calls.end_forced_call),
    each rewritten field sent where ``chat.completions.create`` takes it: ``stop`` by name (or in ``extra_body`` when the
    caller put it there), ``no_stop_trim`` in ``extra_body``."""
    from model_code.guard import RequestGuard

    guard = RequestGuard("tiny", tool_call_parser="qwen25", knows_tool_parser=True)
    named = {"type": "function", "function": {"name": "get_weather"}}
    kwargs: dict[str, Any] = {"model": "tiny", "tools": [WEATHER], "tool_choice": named, "stop": "x"}
    guard.check(QUESTION, kwargs)
    assert kwargs["stop"] == ["x", "\n</tool_call>"] and kwargs["extra_body"] == {"no_stop_trim": True}
    kwargs = {"model": "tiny", "tools": [WEATHER], "tool_choice": named, "extra_body": {"stop": ["y"]}}
    guard.check(QUESTION, kwargs)
    assert "stop" not in kwargs and kwargs["extra_body"] == {"stop": ["y", "\n</tool_call>"], "no_stop_trim": True}
    kwargs = {"model": "tiny", "tools": [WEATHER], "tool_choice": "required"}  # parallel calls allowed: not ended
    guard.check(QUESTION, kwargs)
    assert "stop" not in kwargs and "extra_body" not in kwargs


def test_the_mlflow_guard_holds_strings_and_checks_forced_tools_as_the_gateway_does() -> None:
    """A length-bounded string of a response format is sent held by a pattern (raw control characters otherwise), a
    forced tool's schema is checked as sent (a keyword the grammar cannot hold refused), a tool name checked."""
    from engine_guard.json_strings import ANY_CHARACTER
    from model_code.guard import RequestGuard

    guard = RequestGuard("tiny", tool_call_parser="qwen25", knows_tool_parser=True)
    bounded = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 5}}}
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": bounded}}
    kwargs: dict[str, Any] = {"model": "tiny", "response_format": response_format}
    guard.check(QUESTION, kwargs)
    assert kwargs["response_format"]["json_schema"]["schema"]["properties"]["s"] == {"type": "string", "pattern": f"^{ANY_CHARACTER}{{0,5}}$"}
    assert response_format["json_schema"]["schema"] is bounded and bounded["properties"]["s"] == {"type": "string", "maxLength": 5}
    unheld = {"type": "object", "properties": {"v": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}
    forced = {"model": "tiny", "tools": [{"type": "function", "function": {"name": "act", "parameters": unheld}}], "tool_choice": "required"}
    with pytest.raises(BadRequestError, match="'uniqueItems'"):
        guard.check(QUESTION, forced)
    named = {"model": "tiny", "tools": [{"type": "function", "function": {"name": 'a"b', "parameters": bounded}}]}
    with pytest.raises(BadRequestError, match="not a valid tool name"):
        guard.check(QUESTION, named)


def test_a_forced_call_cut_by_its_token_limit_is_an_error_on_the_mlflow_path(tiny_engine: EngineProcess) -> None:
    """As on the gateway (502 ``forced_call_missing``): a forced choice answered without a call raises, naming why."""
    from model_code.client import EngineClient
    from model_code.errors import EngineInternalError
    from model_code.replica_set import Replica, ReplicaSet
    from model_code.target import ModelCodeSettings

    settings = ModelCodeSettings()
    client = EngineClient("tiny", ReplicaSet([Replica(0, tiny_engine.url, tiny_engine.api_key or "EMPTY", settings)]), settings)
    named = {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "max_tokens": 3}
    try:
        for ask in (client.chat, client.chat_json):
            with pytest.raises(EngineInternalError, match="forced_call_missing: the answer reached its token limit"):
                ask(QUESTION, named)
    finally:
        client.close()
