"""Serving a logged model: ``mlflow models serve --env-manager local`` answers ``/invocations`` (it cannot
stream), and ``load_for_serving`` takes the Databricks request shapes, streaming included (what the
gateway's ``--model-uri`` mode builds on). URL mode against the shared engine: no extra engine start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from launch.ports import pick_free_port
from model_code import load_for_serving

pytestmark = pytest.mark.engine

MESSAGES = [{"role": "user", "content": "What is Databricks?"}]


@pytest.fixture(scope="module")
def served_agent(url_models, mlflow_store):
    info, _ = url_models["chat_agent"]
    port = pick_free_port()
    # the scoring server runs `uvicorn` from PATH: put this interpreter's bin directory first
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    env = {**os.environ, "PATH": path, "MLFLOW_TRACKING_URI": f"sqlite:///{mlflow_store}/mlflow.db"}
    log = open(mlflow_store / f"serve-{port}.log", "wb")
    proc = subprocess.Popen(
        [
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
            str(port),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert proc.poll() is None, (mlflow_store / f"serve-{port}.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/ping", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail("mlflow models serve did not answer /ping in 180 s")
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


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
        assert wrapped.keys() == out.keys()
    finally:
        served.close()
