"""The MLflow path is guarded like the gateway: every call's engine request goes through ``engine_guard``
(``model_code.guard``), and a call under which the engine crashed is not sent again, and its shape refused
(``model_code.quarantine``).

The hostile calls and the engine-schema fuzz go through ``mlflow.pyfunc.load_model(...).predict`` /
``predict_stream`` of models logged in URL mode against the shared real ``tiny_engine`` (no engine start of
their own); the crash runs on the FAKE engine (tests/fake_engine.py), the one engine that dies on demand.
``SGLANG_GATEWAY_MLFLOW_FUZZ`` sets how many fuzzed calls (default 100); the seed is fresh each run, printed, and
replayable (:mod:`tests.fuzz_seed`).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import mlflow
import openai
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from launch.model_info import vocab_size
from model_code import close_model, log_model
from model_code.client import EngineClient
from model_code.errors import BadRequestError, EngineRequestError
from model_code.replica_set import Replica, ReplicaSet
from model_code.target import ModelCodeSettings
from tests.fake_engine import CRASH, fake_engine_python
from tests.fuzz_seed import SEED, replay
from tests.gateway.test_engine_openapi_fuzz import _clamped, from_schema, hostile
from tests.waiting import wait_until

MESSAGES = [{"role": "user", "content": "hi"}]
EXAMPLES = int(os.environ.get("SGLANG_GATEWAY_MLFLOW_FUZZ", "100"))
SWITCHED_ON = ["input_ids", "rid", "lora_path"]


@pytest.fixture(scope="module")
def guarded(tiny_engine: Any, mlflow_store: Path) -> Any:
    """Two chat_agent models on the shared engine by URL: the extension switch off (the default), and on for
    ``input_ids``, ``rid``, ``lora_path`` (``gateway.extension_fields`` of the same model_config)."""
    entry = {"url": tiny_engine.url, "vocab_size": vocab_size(tiny_engine.config.model_path)}
    models = {}
    for name, section in (("off", {}), ("on", {"extension_fields": {"tiny": SWITCHED_ON}})):
        config = {"models": {"tiny": entry}, "mlflow": {"defaults": {"max_tokens": 4}}, **({"gateway": section} if section else {})}
        with mlflow.start_run():
            info = log_model(config, flavor="chat_agent", flashinfer=None)
        models[name] = mlflow.pyfunc.load_model(info.model_uri)
    yield models
    for model in models.values():
        close_model(model)


def _refused(model: Any, custom_inputs: dict[str, Any], stream: bool = False) -> BadRequestError:
    request = {"messages": MESSAGES, "custom_inputs": custom_inputs}
    with pytest.raises(BadRequestError) as refused:
        list(model.predict_stream(request)) if stream else model.predict(request)
    return refused.value


@pytest.mark.parametrize(
    ("switch", "custom_inputs", "field", "code"),
    [
        ("off", {"extra_body": {"input_ids": [-1]}}, "input_ids", "extension_field_disabled"),
        ("on", {"extra_body": {"input_ids": [-1]}}, "input_ids", "invalid_token_ids"),
        ("on", {"extra_body": {"input_ids": [999999]}}, "input_ids", "invalid_token_ids"),
        ("off", {"extra_body": {"n": 100000}}, "n", "invalid_request"),  # the schema bounds n (128)
        ("off", {"extra_body": {"regex": "x{200}", "stop_regex": "(x+x+)+y"}}, "stop_regex", "invalid_grammar"),
        ("off", {"extra_body": {"no_such_field": 1}}, "no_such_field", "unknown_field"),
        # the engine answers 500 (an error event in a stream) where the gateway answers 400
        ("off", {"extra_body": {"ebnf": "root ::= root"}}, "ebnf", "invalid_grammar"),
        # the engine refuses it only once its stream has begun (an error event, under 200: the fuzz found it)
        ("off", {"extra_body": {"response_format": {"type": "structural_tag", "structures": [], "triggers": [""]}}}, "response_format", "invalid_grammar"),
        ("off", {"rid": "abc"}, "rid", "extension_field_disabled"),
        ("off", {"lora_path": "/tmp/adapter"}, "lora_path", "extension_field_disabled"),
        ("off", {"extra_body": {"stream": True}}, "stream", None),
    ],
)
def test_hostile_calls_are_refused_naming_the_field_and_the_engine_lives(guarded, tiny_engine, switch, custom_inputs, field, code):
    pid = tiny_engine.pid
    for stream in (False, True):
        refused = _refused(guarded[switch], custom_inputs, stream)
        assert refused.param == field and refused.code == code, refused
        assert field in refused.message, refused.message
    assert tiny_engine.running and tiny_engine.pid == pid
    answer = guarded[switch].predict({"messages": MESSAGES, "custom_inputs": {"max_tokens": 2}})
    assert answer["messages"][0]["role"] == "assistant"  # the engine still serves


def test_the_switch_lets_a_valid_extension_through(guarded, tiny_engine):
    answer = guarded["on"].predict({"messages": MESSAGES, "custom_inputs": {"extra_body": {"input_ids": [1, 2, 3]}, "max_tokens": 2}})
    assert answer["usage"]["prompt_tokens"] == 3  # the engine read the ids, not the messages


def test_engine_schema_fuzz_through_predict_never_crashes_the_engine(guarded, tiny_engine):
    """Fields of the engine's own chat schema (``GET /openapi.json``), drawn as the gateway's fuzz draws them, in
    ``custom_inputs.extra_body`` of ``predict`` and ``predict_stream`` calls, on both models: each call is served
    or refused with a BadRequestError; no other error, and the engine never dies."""
    pid = tiny_engine.pid
    openapi = httpx.get(tiny_engine.url + "/openapi.json", timeout=30).json()
    components = openapi.get("components", {})
    ref = openapi["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    properties = components["schemas"][ref.rsplit("/", 1)[1]]["properties"]
    fields = [(name, st.one_of(from_schema(prop, components), hostile)) for name, prop in properties.items() if name != "model"]
    outcomes: Counter[str] = Counter()
    bad: list[tuple[dict[str, Any], str]] = []
    started = time.monotonic()
    print(f"\nmlflow predict fuzz: {replay()}")

    @seed(SEED)
    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def one_call(data: st.DataObject) -> None:
        drawn = data.draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique_by=lambda item: item[0]))
        extra = _clamped({"max_tokens": 4, **{name: data.draw(values) for name, values in drawn}})
        model = guarded[data.draw(st.sampled_from(["off", "on"]))]
        stream = data.draw(st.booleans())
        request = {"messages": MESSAGES, "custom_inputs": {"extra_body": extra}}
        try:
            list(model.predict_stream(request)) if stream else model.predict(request)
            outcomes["served"] += 1
        except BadRequestError:
            outcomes["refused"] += 1
        except EngineRequestError as error:  # the engine failed: what the guard exists to prevent
            outcomes[type(error).__name__] += 1
            bad.append((extra, str(error)[:300]))

    one_call()
    took = time.monotonic() - started
    print(f"mlflow predict fuzz: {sum(outcomes.values())} calls in {took:.0f}s, {dict(outcomes)} ({replay()})")
    assert not bad, (replay(), bad[:5])
    assert tiny_engine.running and tiny_engine.pid == pid, f"the engine crashed ({replay()})"
    assert httpx.get(tiny_engine.url + "/health", timeout=30).status_code == 200
    assert sum(outcomes.values()) >= EXAMPLES // 2 and outcomes["served"] and outcomes["refused"]


def test_a_call_that_crashes_the_engine_is_not_retried_and_its_shape_is_refused(mlflow_store, tiny_deployment, tiny_model_dir, tmp_path):
    """The FAKE engine dies under a chat whose message is its crash marker (as SGLang's scheduler dies under a
    poison request). The shared engine is restarted by its host; the call is sent once, and its shape is refused."""
    calls = tmp_path / "calls"
    engine = {
        **tiny_deployment.engine("tiny").model_dump(mode="json", exclude_defaults=True),
        "python": str(fake_engine_python(tmp_path)), "env": {"FAKE_ENGINE_CALLS": str(calls)}, "skip_server_warmup": True,
    }  # fmt: skip
    with mlflow.start_run():
        config = {"models": {"tiny": {"engine": engine}}, "gateway": {"extension_fields": {"tiny": ["input_ids"]}}}
        info = log_model(config, flavor="chat_agent", model_path=tiny_model_dir)
    model = mlflow.pyfunc.load_model(info.model_uri)
    try:
        # a managed model's vocabulary is read from its logged weights: an id past it never reaches the engine
        refused = _refused(model, {"extra_body": {"input_ids": [999999]}})
        assert refused.param == "input_ids" and refused.code == "invalid_token_ids"
        assert not calls.exists() or "chat" not in calls.read_text().split()
        with pytest.raises(EngineRequestError) as crashed:
            model.predict({"messages": [{"role": "user", "content": CRASH}]})
        assert not isinstance(crashed.value, BadRequestError)
        assert calls.read_text().split().count("chat") == 1  # sent once: no retry, not even to the restarted engine
        with pytest.raises(BadRequestError) as refused:  # the same shape, other words: refused before it is sent
            model.predict({"messages": [{"role": "user", "content": CRASH.lower()}]})
        assert refused.value.code == "request_quarantined" and "messages" in refused.value.message
        assert calls.read_text().split().count("chat") == 1

        def answered() -> dict | None:
            try:
                return model.predict({"messages": MESSAGES, "custom_inputs": {"max_tokens": 2}})
            except EngineRequestError:
                return None

        answer = wait_until(answered, "another shape to be served once the host has restarted the engine", 60, every_s=0.5)
        assert answer["messages"][0]["content"] == "tok tok "
    finally:
        close_model(model)


def _client_on(answers: list[Any], max_retries: int) -> tuple[EngineClient, list[int]]:
    """An EngineClient whose one replica is a FAKE engine made of httpx's MockTransport: each request gets the
    next of ``answers`` (an HTTP status, or an exception raised as the connection's failure)."""
    sent: list[int] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(1)
        outcome = answers[min(len(sent), len(answers)) - 1]
        if isinstance(outcome, Exception):
            raise outcome
        if outcome != 200:
            return httpx.Response(outcome, json={"error": {"message": f"status {outcome} (FAKE)"}})
        return httpx.Response(200, json={
            "id": "c", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}],
        })  # fmt: skip

    settings = ModelCodeSettings(max_retries=max_retries)
    replica = Replica(0, "http://fake-engine", "k", settings)
    replica._client = openai.OpenAI(
        base_url=replica.base_url, api_key="k", max_retries=0, http_client=httpx.Client(transport=httpx.MockTransport(answer))
    )
    return EngineClient("m", ReplicaSet([replica]), settings), sent


def test_answers_are_retried_a_broken_connection_never(monkeypatch):
    monkeypatch.setattr(time, "sleep", lambda seconds: None)  # the backoff
    client, sent = _client_on([503, 500, 200], max_retries=2)
    assert client.chat(MESSAGES).choices[0].message.content == "ok" and len(sent) == 3  # 429/5xx answers: retried
    client, sent = _client_on([400, 200], max_retries=2)
    with pytest.raises(BadRequestError):
        client.chat(MESSAGES)
    assert len(sent) == 1  # the request's own fault: not retried
    for broken in (httpx.RemoteProtocolError("peer closed connection"), httpx.ReadTimeout("timed out")):
        client, sent = _client_on([broken, 200], max_retries=2)
        with pytest.raises(EngineRequestError):
            client.chat(MESSAGES)
        assert len(sent) == 1 and len(client.quarantine.refused()) == 1  # crashed or froze under it: sent once, refused
        with pytest.raises(BadRequestError, match="took the engine of model 'm' down"):
            client.chat([{"role": "user", "content": "ho"}])  # the same shape
        assert len(sent) == 1
        assert client.chat([{"role": "system", "content": "s"}, *MESSAGES]).choices[0].message.content == "ok"  # another shape
