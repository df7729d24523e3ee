"""MLflow's ``AgentServer`` in front of the ResponsesAgent flavour, as a Databricks App runs it:
``python -m model_code.agent_server configs/smollm2-cpu.yaml --workers 2`` on the real default model (SmolLM2).

One engine for the two workers (started by the command before uvicorn starts them; none of the workers' own);
``/invocations`` and ``/responses`` answer, plainly and streamed through the openai SDK; a two-turn tool loop runs
through ``client.responses.create``; a guard refusal keeps its 400; a traced call returns its trace id when asked;
and SIGTERM to the command leaves no engine, no engine host, no shared-engine directory and no ``/dev/shm`` file.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import mlflow
import psutil
import pytest
from openai import OpenAI

from launch.engine_dir import runtime_root
from launch.ports import pick_free_port
from launch.shm import owned_shm_files
from tests.model_code.test_shared_serving import TAG_ENV, _live, engine_hosts, engines_of, scoring_workers
from tests.servers import REPO, ServerProcess
from tests.waiting import wait_until

pytestmark = [pytest.mark.engine, pytest.mark.real_model]

SETTLE_S = 180  # bound on waiting for processes to appear or go away (never a timing assertion)
QUESTION = [{"role": "user", "content": "What's the weather like in Paris today?"}]
WEATHER = {
    "type": "function", "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}}, "required": ["city"]},
}  # fmt: skip


class App:
    def __init__(self, server: ServerProcess, tag: str) -> None:
        self.server, self.tag = server, tag
        self.url = server.url
        self.openai = OpenAI(base_url=server.url, api_key="unused", timeout=300)


@pytest.fixture(scope="module")
def app(starts_engine: None, default_model_dir: Path, mlflow_store: Path) -> Iterator[App]:
    """The command as an App runs it (port from ``DATABRICKS_APP_PORT``), two workers; stopped by the last test."""
    tag, port = uuid.uuid4().hex, pick_free_port()
    server = ServerProcess(
        [sys.executable, "-m", "model_code.agent_server", "configs/smollm2-cpu.yaml", "--host", "127.0.0.1", "--workers", "2"],
        log_path=mlflow_store / "agent-server.log",
        env={**os.environ, "DATABRICKS_APP_PORT": str(port), "SGLANG_GATEWAY_DEFAULT_MODEL": str(default_model_dir),
             "MLFLOW_TRACKING_URI": f"sqlite:///{mlflow_store}/mlflow.db", TAG_ENV: tag,
             "MLFLOW_EXPERIMENT_ID": mlflow.get_experiment_by_name("model_code-tests").experiment_id},
        cwd=REPO, port=port,
    )  # fmt: skip
    try:
        server.wait_http("/health", SETTLE_S * 2)
        yield App(server, tag)
    finally:
        server.stop()


def test_two_workers_share_one_engine_that_the_command_started(app: App) -> None:
    command = psutil.Process(app.server.pid)
    wait_until(lambda: len(scoring_workers(command)) == 2, "two AgentServer workers", SETTLE_S, every_s=0.5)
    workers = {p.pid for p in scoring_workers(command)}
    [host] = engine_hosts(app.tag)
    assert host.ppid() == command.pid  # started before any worker: by the command itself
    [engine] = engines_of({host.pid})
    assert engines_of(workers | {command.pid}) == []
    # every worker holds the same engine: its log says it joined the running one (none starts its own)
    wait_until(lambda: app.server.log().count("using the shared engine") >= 2, "both workers joined", SETTLE_S)
    assert app.server.log().count("engine host started") == 1


def test_invocations_and_responses_answer(app: App) -> None:
    body = {"input": QUESTION, "max_output_tokens": 8, "temperature": 0}
    answer = httpx.post(app.url + "/invocations", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    assert answer.json()["output"][0]["content"][0]["text"]
    response = app.openai.responses.create(model="smollm2", input=QUESTION, max_output_tokens=8, temperature=0)
    assert response.output_text == answer.json()["output"][0]["content"][0]["text"]


def test_responses_streams_through_the_openai_sdk(app: App) -> None:
    events = list(
        app.openai.responses.create(model="smollm2", input=QUESTION, max_output_tokens=8, temperature=0, stream=True)
    )
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) > 1 and events[0].type == "response.output_text.delta"  # token by token, as the engine wrote
    assert events[-1].type == "response.completed"
    done = [event.item for event in events if event.type == "response.output_item.done"]
    assert done[0].content[0].text == "".join(deltas)


def test_a_two_turn_tool_loop_through_responses(app: App) -> None:
    first = app.openai.responses.create(
        model="smollm2", input=QUESTION, tools=[WEATHER], tool_choice="required", temperature=0, max_output_tokens=40
    )
    [call] = [item for item in first.output if item.type == "function_call"][:1]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Tokyo")
    turn: list[Any] = QUESTION + [
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Heavy snow, minus 12 degrees."},
    ]
    second = app.openai.responses.create(
        model="smollm2", input=turn, tools=[WEATHER], temperature=0, max_output_tokens=26
    )
    assert "snow" in second.output_text.lower(), second


def test_a_refused_request_keeps_its_status_and_a_trace_id_comes_when_asked(app: App) -> None:
    refused = httpx.post(app.url + "/responses", json={"input": QUESTION, "custom_inputs": {"bogus": 1}}, timeout=300)
    assert refused.status_code == 400 and "bogus" in refused.json()["detail"], refused.text
    traced = httpx.post(
        app.url + "/invocations", json={"input": QUESTION, "max_output_tokens": 2},
        headers={"x-mlflow-return-trace-id": "true"}, timeout=300,
    )  # fmt: skip
    assert traced.status_code == 200 and traced.json()["metadata"]["trace_id"].startswith("tr-"), traced.text


def test_sigterm_leaves_no_engine(app: App) -> None:
    """Last in the module: SIGTERM to the command alone (what a platform sends its main process)."""
    [host] = engine_hosts(app.tag)
    [engine] = engines_of({host.pid})
    key_dir = Path(host.cmdline()[-1])
    assert key_dir.parent == runtime_root() / "engines"
    shm_files = owned_shm_files(engine.pid)
    os.kill(app.server.pid, signal.SIGTERM)
    assert app.server.proc.wait(SETTLE_S) == 0, app.server.log(3000)
    wait_until(lambda: not _live(host) and not _live(engine), "the engine and its host to stop", SETTLE_S, every_s=0.5)
    wait_until(lambda: not key_dir.exists(), "the shared-engine directory to be removed", SETTLE_S, every_s=0.5)
    assert engine_hosts(app.tag) == []
    assert [f for f in shm_files if f.exists()] == []
