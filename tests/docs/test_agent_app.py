"""The Databricks App recipe of docs/databricks.md, run as the platform runs it: its ``app.yaml`` parsed, its command
run without a shell from a folder holding its ``agent.yaml``, the port from ``DATABRICKS_APP_PORT`` and the env from
``app.yaml`` (the secret a value of the test's; MLflow's traces into a local store instead of a workspace).

No engine: the agent's URL is a FAKE engine that records each request and answers when the test says (a real engine
cannot be made to hold a request on demand). Checked: the App answers ``/health`` and ``/agent/info``, sends the
secret as the engine's key, answers a refused request with 400 and an engine that hangs up with 503, keeps answering
``/health`` while a call waits for the engine (the flavour runs off AgentServer's event loop), and exits 0 on SIGTERM.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from launch.ports import pick_free_port
from tests.docs.readme_blocks import marked_blocks
from tests.fake_upstreams import fake_answering_upstream
from tests.servers import ServerProcess
from tests.waiting import wait_until

SECRET = "test-gateway-key"
QUESTION = [{"role": "user", "content": "Hi"}]


class HeldEngine:
    """A FAKE engine: records each request's head, then holds it until :meth:`hang_up`."""

    def __init__(self) -> None:
        self.heads: list[str] = []
        self.release = threading.Event()

    def answer(self, conn: socket.socket) -> None:
        data = b""
        while b"\r\n\r\n" not in data and (more := conn.recv(65536)):
            data += more
        self.heads.append(data.partition(b"\r\n\r\n")[0].decode("latin-1").lower())
        self.release.wait(120)
        conn.close()

    def hang_up(self) -> None:
        self.release.set()


@pytest.fixture
def held_engine() -> Iterator[tuple[HeldEngine, str]]:
    engine = HeldEngine()
    with fake_answering_upstream(engine.answer) as url:
        try:
            yield engine, url
        finally:
            engine.hang_up()


def app_yaml() -> dict:
    [block] = marked_blocks("agent-app-yaml")
    return yaml.safe_load(block.code)


def app_folder(tmp_path: Path, engine_url: str) -> Path:
    """The App's folder: ``agent.yaml`` of the docs with its URL the FAKE engine's."""
    [block] = marked_blocks("agent-app-config")
    config = yaml.safe_load(block.code)
    [entry] = config["models"].values()
    text = block.code.replace(entry["url"], engine_url + "/v1")
    (tmp_path / "agent.yaml").write_text(text)
    return tmp_path


def app_env(spec: dict, port: int, tmp_path: Path) -> dict[str, str]:
    """The process env the platform gives the command: its own variables plus ``app.yaml``'s ``env``."""
    env = {**os.environ, "DATABRICKS_APP_PORT": str(port), "DATABRICKS_APP_NAME": "sglang-agent"}
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])  # "python": this venv's
    for item in spec["env"]:
        env[item["name"]] = item["value"] if "value" in item else SECRET  # valueFrom: the App's secret resource
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path}/mlflow.db"  # no workspace here
    return env


def start_app(tmp_path: Path, engine_url: str, *, workers: int | None = None) -> ServerProcess:
    spec = app_yaml()
    argv = list(spec["command"])
    if workers is not None:
        argv[argv.index("--workers") + 1] = str(workers)
    port = pick_free_port()
    folder = app_folder(tmp_path, engine_url)
    server = ServerProcess(
        argv, log_path=tmp_path / "app.log", env=app_env(spec, port, tmp_path), cwd=folder, port=port
    )
    server.wait_http("/health", 240)
    return server


def test_the_app_yaml_is_what_the_platform_reads() -> None:
    spec = app_yaml()
    assert set(spec) == {"command", "env"}
    assert spec["command"][:4] == ["python", "-m", "model_code.agent_server", "agent.yaml"]
    assert all(set(item) in ({"name", "value"}, {"name", "valueFrom"}) for item in spec["env"])


def test_the_app_recipe_runs(tmp_path: Path, held_engine: tuple[HeldEngine, str]) -> None:
    engine, url = held_engine
    server = start_app(tmp_path, url)
    try:
        assert httpx.get(server.url + "/agent/info").json()["name"] == "sglang-agent"
        assert httpx.get(server.url + "/agent/info").json()["agent_api"] == "responses"
        refused = httpx.post(
            server.url + "/responses", json={"input": QUESTION, "custom_inputs": {"bogus": 1}}, timeout=60
        )
        assert refused.status_code == 400 and "bogus" in refused.text, refused.text
        with ThreadPoolExecutor(1) as pool:
            call: Future[httpx.Response] = pool.submit(
                httpx.post, server.url + "/invocations", json={"input": QUESTION}, timeout=120
            )
            wait_until(lambda: engine.heads, "the request at the engine", 60)
            assert f"authorization: bearer {SECRET}" in engine.heads[0]
            engine.hang_up()
            assert call.result().status_code == 503, call.result().text
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0, server.log(3000)
    finally:
        server.stop()


def test_a_call_waiting_for_the_engine_leaves_the_worker_answering(
    tmp_path: Path, held_engine: tuple[HeldEngine, str]
) -> None:
    """One worker: AgentServer would call a plain function on its event loop, and ``/health`` would wait behind it."""
    engine, url = held_engine
    server = start_app(tmp_path, url, workers=1)
    try:
        with ThreadPoolExecutor(1) as pool:
            call = pool.submit(httpx.post, server.url + "/invocations", json={"input": QUESTION}, timeout=120)
            wait_until(lambda: engine.heads, "the request at the engine", 60)
            assert httpx.get(server.url + "/health", timeout=60).status_code == 200
            assert not call.done()
            engine.hang_up()
            call.result()
    finally:
        server.stop()


def test_an_engine_that_cannot_start_ends_the_command_with_the_reason(tmp_path: Path) -> None:
    """The preflight refuses the weights: the command exits 1 naming why, and never listens."""
    config = tmp_path / "agent.yaml"
    config.write_text(
        yaml.safe_dump({"models": {"m": {"engine": {"model_path": str(tmp_path / "no-weights"), "device": "cpu"}}}})
    )
    port = pick_free_port()
    env = {**os.environ, "DATABRICKS_APP_PORT": str(port), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    done = subprocess.run(
        [sys.executable, "-m", "model_code.agent_server", str(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "no-weights: no such directory" in done.stderr and "Uvicorn running" not in done.stderr
