"""The container contract of Databricks custom LLM serving, played here with the real CPU engine.

What the platform is documented (or, where docs/databricks.md notes it, inferred) to do with a model logged
with ``log_model(flavor="entrypoint")``: read the command from the ``MLmodel`` metadata, download the
model's artifacts, run the command in the artifacts folder (port 8080 there; a free port here through
``SGLANG_GATEWAY_PORT``), wait until ``GET /v1/models`` answers 200, forward OpenAI chat bodies to
``POST /invocations``, scrape ``/metrics``, and stop the container with SIGTERM. One engine start.

The command runs without a shell, with the test checkout off ``PYTHONPATH``: the gateway that answers
is the copy in the artifacts folder. The cold-start time is printed (``-s``), never asserted.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import mlflow
import openai
import pytest
import yaml

from launch.ports import pick_free_port
from launch.procgroup import group_pids
from launch.shm import owned_shm_files
from model_code import log_model
from model_code.entrypoint import PORT_ENV
from tests.leaks import LeakCheck
from tests.model_code.helpers import engine_children
from tests.waiting import wait_until

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]
START_WAIT_S = 900.0  # generous on a loaded CI machine: how long to wait before calling the start failed
HELLO = [{"role": "user", "content": "What is Databricks?"}]


class PlatformHop(httpx.HTTPTransport):
    """The serving platform's hop, simulated: what the OpenAI SDK sends to
    ``<workspace>/serving-endpoints/chat/completions`` (``model`` = the endpoint's name) reaches the model's
    server as ``POST /invocations`` with the same body."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/serving-endpoints/chat/completions":
            request.url = request.url.copy_with(path="/invocations")
        return super().handle_request(request)


def _sse_events(raw: bytes) -> list[Any]:
    events = raw.strip().split(b"\n\n")
    assert all(event.startswith(b"data: ") for event in events), raw[-500:]
    assert events[-1] == b"data: [DONE]"
    return [json.loads(event[6:]) for event in events[:-1]]


@pytest.fixture
def artifacts_folder(
    mlflow_store: Path, tiny_deployment: Any, tiny_model_dir: Path, tmp_path: Path
) -> tuple[str, Path]:
    """(command, artifacts folder) as the platform gets them: from the logged MLmodel, downloaded."""
    with mlflow.start_run():
        info = log_model(REPO / "configs" / "tiny-cpu.yaml", flavor="entrypoint", model_path=tiny_model_dir)
    model_dir = Path(mlflow.artifacts.download_artifacts(info.model_uri, dst_path=str(tmp_path / "model")))
    metadata = yaml.safe_load((model_dir / "MLmodel").read_text())["metadata"]
    assert metadata["task"] == "llm/v1/chat"
    return metadata["entrypoint"], model_dir / "artifacts"


@pytest.fixture
def container(artifacts_folder: tuple[str, Path], tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The command running in its own process group; stopped by the test (killed here only if the test failed)."""
    command, folder = artifacts_folder
    port = pick_free_port()
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(
        {
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
            PORT_ENV: str(port),
            "HF_HUB_OFFLINE": "1",
        }
    )
    log_path = tmp_path / "container.log"
    leaks = LeakCheck()
    with open(log_path, "wb") as log:
        started = time.monotonic()
        proc = subprocess.Popen(
            shlex.split(command), cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    running = {
        "proc": proc,
        "url": f"http://127.0.0.1:{port}",
        "log": log_path,
        "started": started,
        "leaks": leaks,
    }
    try:
        yield running
    finally:
        for pgid in (proc.pid, *running.get("engine_groups", ())):
            if group_pids(pgid):
                os.killpg(pgid, signal.SIGKILL)
        proc.wait(timeout=60)


def _wait_ready(container: dict[str, Any]) -> float:
    """Poll ``GET /v1/models`` as the platform does; the seconds from the command's start to the first 200."""
    proc, url, log_path = container["proc"], container["url"], container["log"]

    def answered() -> bool:
        assert proc.poll() is None, f"the command exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}"
        try:
            response = httpx.get(url + "/v1/models", timeout=5)
        except httpx.TransportError:  # refused: uvicorn binds only once the engines are ready
            return False
        assert response.status_code == 200, response.text
        return True

    wait_until(answered, lambda: f"no 200 from /v1/models:\n{log_path.read_text()[-4000:]}", START_WAIT_S, every_s=0.5)
    return time.monotonic() - container["started"]


def test_the_logged_entrypoint_serves_like_a_custom_llm_container(container: dict[str, Any]) -> None:
    proc, url, log_path = container["proc"], container["url"], container["log"]

    cold_start_s = _wait_ready(container)
    log = log_path.read_text()
    assert "engines ready in" in log  # the first 200 came after the engine was ready, not before
    for phase in ("loading weights", "allocating KV cache"):  # start phases in the container's log
        assert f"engine tiny: {phase} (" in log, log[-3000:]
    print(f"\ncold start (command start to the first /v1/models 200): {cold_start_s:.1f}s")
    assert {card["id"] for card in httpx.get(url + "/v1/models", timeout=10).json()["data"]} == {"tiny", "default"}

    # The endpoint's requests, forwarded to POST /invocations: an OpenAI chat body, no model or any model.
    plain = httpx.post(url + "/invocations", json={"messages": HELLO, "max_tokens": 8, "temperature": 0}, timeout=120)
    assert plain.status_code == 200, plain.text
    answer = plain.json()
    assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["role"] == "assistant"
    assert 0 < answer["usage"]["completion_tokens"] <= 8

    body = {
        "model": "sglang-endpoint",
        "messages": HELLO,
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
        "top_k": 1,
    }  # an engine field at the top level
    with httpx.Client(timeout=120) as http, http.stream("POST", url + "/invocations", json=body) as streamed:
        raw = b"".join(streamed.iter_raw())
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    chunks = _sse_events(raw)
    assert any(choice["delta"].get("content") for chunk in chunks for choice in chunk["choices"])
    assert chunks[-1]["choices"] == [] and 0 < chunks[-1]["usage"]["completion_tokens"] <= 8

    # The OpenAI SDK as Databricks users point it: base_url <workspace>/serving-endpoints, model = endpoint name.
    with httpx.Client(transport=PlatformHop(), timeout=120) as hop:
        sdk = openai.OpenAI(
            base_url=url + "/serving-endpoints", api_key="a-workspace-token", http_client=hop, max_retries=0
        )
        reply = sdk.chat.completions.create(model="sglang-endpoint", messages=HELLO, max_tokens=8, temperature=0)
        assert reply.choices[0].message.role == "assistant" and reply.usage.completion_tokens > 0
        stream = sdk.chat.completions.create(
            model="sglang-endpoint", messages=HELLO, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
        )  # greedy: sampling, the tiny random model may answer nothing but its end
        sdk_chunks = list(stream)
    assert sdk_chunks[-1].usage is not None and sdk_chunks[-1].usage.completion_tokens > 0
    assert "".join(c.choices[0].delta.content or "" for c in sdk_chunks if c.choices)
    assert 'route="/invocations"' in httpx.get(url + "/metrics", timeout=10).text  # what a scraper sees

    # SIGTERM to the container's process group: everything ends, nothing is left behind.
    engines = engine_children(proc.pid)
    assert len(engines) == 1
    container["engine_groups"] = engines  # the engine runs in a process group of its own
    engine_shm = owned_shm_files(engines[0])
    assert engine_shm, "the engine uses /dev/shm, so the check below can fail"
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, log_path.read_text()[-3000:]
    assert not group_pids(proc.pid) and not group_pids(engines[0])
    assert not [path for path in engine_shm if path.exists()]
    for pgid in (proc.pid, *engines):
        container["leaks"].watch(pgid)
    container["leaks"].assert_nothing_left()  # waits out files of other tests' engines mid-stop
    assert "gateway: stopped by SIGTERM" in log_path.read_text()
