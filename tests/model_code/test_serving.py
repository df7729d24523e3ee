"""Serving a logged model: ``mlflow models serve --env-manager local`` answers ``/invocations`` (it cannot
stream), and ``load_for_serving`` takes the Databricks request shapes, streaming included (what the
gateway's ``--model-uri`` mode builds on). URL mode against the shared engine: no extra engine start."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from model_code import load_for_serving
from tests.servers import ServerProcess, server_process

MESSAGES = [{"role": "user", "content": "What is Databricks?"}]


@pytest.fixture(scope="module")
def served_agent(url_models, mlflow_store):
    """``mlflow models serve --env-manager local`` of the logged ChatAgent."""
    info, _ = url_models["chat_agent"]
    # the scoring server runs `uvicorn` from PATH: put this interpreter's bin directory first
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    env = {**os.environ, "PATH": path, "MLFLOW_TRACKING_URI": f"sqlite:///{mlflow_store}/mlflow.db"}
    argv = [
        sys.executable,
        "-m",
        "mlflow",
        "models",
        "serve",
        "-m",
        info.model_uri,
        "--env-manager",
        "local",
        "-h",
        "127.0.0.1",
        "-p",
        "{port}",
    ]
    with server_process(argv, log_path=mlflow_store / "mlflow-serve.log", env=env, ready_path="/ping") as server:
        yield server.url


def test_mlflow_models_serve_invocations(served_agent):
    body = {"messages": MESSAGES, "custom_inputs": {"temperature": 0.1, "max_tokens": 16}}
    response = httpx.post(f"{served_agent}/invocations", json=body, timeout=120)
    assert response.status_code == 200, response.text
    out = response.json()
    assert out["messages"][0]["role"] == "assistant" and out["usage"]["completion_tokens"] > 0
    # a bad parameter is a 400 with the reason, not a 500
    response = httpx.post(
        f"{served_agent}/invocations", json={"messages": MESSAGES, "custom_inputs": {"temprature": 1}}, timeout=60
    )
    assert response.status_code == 400 and "unknown generation parameter" in response.text
    # the request guard runs behind /invocations too: a field the gateway refuses is a 400 naming it
    for extra, field in (({"input_ids": [-1]}, "input_ids"), ({"stop_regex": "(x+x+)+y"}, "stop_regex")):
        body = {"messages": MESSAGES, "custom_inputs": {"extra_body": extra}}
        response = httpx.post(f"{served_agent}/invocations", json=body, timeout=60)
        assert response.status_code == 400 and field in response.json()["message"], response.text


@pytest.mark.parametrize(
    "flavor, body",
    [
        ("chat_agent", {"messages": MESSAGES, "custom_inputs": {"max_tokens": 8}, "stream": True}),
        ("chat_model", {"messages": MESSAGES, "max_tokens": 8, "stream": True}),
        ("responses_agent", {"input": MESSAGES, "max_output_tokens": 8, "stream": True}),
    ],
)
def test_load_for_serving_request_shapes(url_models, flavor, body):
    from model_code.serving import wants_stream

    info, _ = url_models[flavor]
    served = load_for_serving(info.model_uri)
    try:
        assert served.flavor == flavor and served.model_name == "tiny"
        assert wants_stream(body)
        out = served.predict(body)
        assert out
        chunks = list(served.predict_stream(body))
        assert len(chunks) >= 2
        wrapped = served.predict({"inputs": {k: v for k, v in body.items() if k != "stream"}})
        # the same fields; ``incomplete_details`` only on an answer that reached max_output_tokens (sampling decides)
        assert wrapped.keys() - {"incomplete_details"} == out.keys() - {"incomplete_details"}
    finally:
        served.close()


KEY = "sk-model-uri-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def _model_uri_servers(url_config, mlflow_store, tmp_path_factory):
    """``sglang-gateway serve --model-uri`` of a ChatAgent, as a user runs it, with gateway settings from both
    places: the logged model_config's ``gateway:`` section (one request at a time, no queue) and a
    ``--gateway-config`` file (an API key, in a key file named relative to it). Returns the server running now,
    started again when a test stopped the previous one (the stop test does); all stopped at the end."""
    import mlflow

    from model_code import log_model

    with mlflow.start_run():
        limited = {**url_config, "gateway": {"limits": {"max_concurrent": 1, "max_queue": 0}, "port": 1}}
        info = log_model(limited, flavor="chat_agent", flashinfer=None)
    config_dir = tmp_path_factory.mktemp("gateway-config")
    (config_dir / "keys.txt").write_text(f"{KEY}\n")
    (config_dir / "gateway.yaml").write_text("gateway:\n  api_keys_file: keys.txt\n")
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{mlflow_store}/mlflow.db"}
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--model-uri", info.model_uri, "--port", "{port}"]
    argv += ["--gateway-config", str(config_dir / "gateway.yaml")]
    servers: list[ServerProcess] = []

    def running() -> ServerProcess:
        if not servers or servers[-1].proc.poll() is not None:
            server = ServerProcess(argv, log_path=mlflow_store / f"gateway-model-uri-{len(servers)}.log", env=env)
            servers.append(server)
            server.wait_http("/health")
        return servers[-1]

    yield running
    for server in servers:
        server.stop()


@pytest.fixture
def gateway_model_uri(_model_uri_servers):
    """The module's ``serve --model-uri`` server (a test after the stop test, in a random order, starts it again
    instead of finding it stopped)."""
    return _model_uri_servers()


def test_gateway_model_uri_answers_the_same_body_as_mlflow_serve(gateway_model_uri, served_agent):
    url = gateway_model_uri.url
    body = {"messages": MESSAGES, "custom_inputs": {"temperature": 0, "max_tokens": 12}}
    ours = httpx.post(f"{url}/invocations", json=body, headers=AUTH, timeout=120)
    theirs = httpx.post(f"{served_agent}/invocations", json=body, timeout=120)
    assert ours.status_code == theirs.status_code == 200, ours.text
    assert ours.json().keys() == theirs.json().keys()
    assert ours.json()["messages"][0]["content"] == theirs.json()["messages"][0]["content"]  # temperature 0
    bad = httpx.post(
        f"{url}/invocations", json={"messages": MESSAGES, "custom_inputs": {"temprature": 1}}, headers=AUTH, timeout=60
    )
    assert bad.status_code == 400
    assert "unknown generation parameter" in bad.json()["error"]["message"]
    junk = httpx.post(f"{url}/invocations", content=b"{not json", headers=AUTH, timeout=30)
    assert junk.status_code == 400 and set(junk.json()["error"]) >= {"message", "type", "param", "code"}


def test_gateway_model_uri_streams_invocations_as_sse(gateway_model_uri):
    import json

    url = gateway_model_uri.url
    body = {"messages": MESSAGES, "custom_inputs": {"temperature": 0, "max_tokens": 12}, "stream": True}
    with httpx.stream("POST", f"{url}/invocations", json=body, headers=AUTH, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = [event for event in raw.split("\n\n") if event]
    assert all(event.startswith("data: ") for event in events), raw[:500]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
    assert len(chunks) >= 2
    assert all(chunk["delta"]["role"] == "assistant" for chunk in chunks)
    assert "".join(chunk["delta"]["content"] for chunk in chunks)
    assert chunks[-1]["finish_reason"] and chunks[-1]["usage"]["completion_tokens"] > 0


def test_gateway_model_uri_applies_the_gateway_settings(gateway_model_uri):
    url = gateway_model_uri.url
    body = {"messages": MESSAGES, "custom_inputs": {"max_tokens": 4}}
    assert httpx.post(f"{url}/invocations", json=body, timeout=60).status_code == 401  # the key file's key
    assert httpx.post(f"{url}/invocations", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
    # the logged limit (one at a time, no queue): a long stream holds the model's slot, on both routes
    long = {"messages": MESSAGES, "custom_inputs": {"max_tokens": 1500, "ignore_eos": True}, "stream": True}
    with httpx.stream("POST", f"{url}/invocations", json=long, headers=AUTH, timeout=120) as first:
        assert first.status_code == 200
        lines = first.iter_lines()  # kept: dropping the iterator would close the stream
        assert next(lines).startswith("data: ")
        refused = httpx.post(f"{url}/invocations", json=body, headers=AUTH, timeout=60)
        assert refused.status_code == 429 and refused.headers["retry-after"]
        openai_route = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}
        assert httpx.post(f"{url}/v1/chat/completions", json=openai_route, headers=AUTH).status_code == 429
    # the slot comes back once the abandoned stream is noticed (bounded wait)
    for _ in range(120):
        status = httpx.post(f"{url}/invocations", json=body, headers=AUTH, timeout=60).status_code
        if status != 429:
            break
        time.sleep(0.5)
    assert status == 200


def test_gateway_model_uri_also_serves_openai_and_stops_cleanly(gateway_model_uri):
    import openai

    client = openai.OpenAI(base_url=f"{gateway_model_uri.url}/v1", api_key=KEY, max_retries=0)
    reply = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=6, temperature=0)
    assert reply.model == "tiny" and reply.choices[0].message.role == "assistant"
    assert gateway_model_uri.stop() == 0


@pytest.mark.parametrize(
    "gateway_yaml, message",
    [
        ("gateway:\n  limits:\n    max_concurent: 2\n", "gateway.limits.max_concurent: unknown key"),
        ("models: {}\n", "no 'gateway:' mapping"),
        ("gateway:\n  api_keys_env: ${SGLANG_GATEWAY_TEST_UNSET_VAR}\n", "SGLANG_GATEWAY_TEST_UNSET_VAR is not set"),
    ],
)
def test_gateway_config_errors_are_one_line_before_loading(tmp_path, gateway_yaml, message):
    """A bad --gateway-config fails at once (exit 2, one line naming the file), before any model load."""
    config = tmp_path / "gateway.yaml"
    config.write_text(gateway_yaml)
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--model-uri", "runs:/absent/model"]
    result = subprocess.run([*argv, "--gateway-config", str(config)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {config}: ") and message in line
