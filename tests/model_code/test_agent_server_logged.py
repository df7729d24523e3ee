"""``python -m model_code.agent_server`` from a logged model (a ``runs:/`` URI in a sqlite tracking store), as an App
runs it from ``models:/...``: the command downloads the model once and serves it; a model of another flavour is
refused before the port is bound. No engine: the model is logged in URL mode against a FAKE engine that records
each request and answers when the test says (a real engine cannot hold a request on demand).
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import mlflow

from launch.ports import pick_free_port
from model_code import log_model
from tests.docs.test_agent_app import QUESTION, HeldEngine
from tests.docs.test_agent_app import held_engine as held_engine  # a fixture
from tests.servers import ServerProcess
from tests.waiting import wait_until


def _env(mlflow_store: Path, port: int) -> dict[str, str]:
    return {
        **os.environ,
        "DATABRICKS_APP_PORT": str(port),
        "MLFLOW_TRACKING_URI": f"sqlite:///{mlflow_store}/mlflow.db",
        "MLFLOW_EXPERIMENT_ID": mlflow.get_experiment_by_name("model_code-tests").experiment_id,
    }


def test_a_logged_responses_agent_is_served(
    mlflow_store: Path, held_engine: tuple[HeldEngine, str], tmp_path: Path
) -> None:
    engine, url = held_engine
    with mlflow.start_run():
        info = log_model({"models": {"m": {"url": url + "/v1"}}}, flavor="responses_agent", flashinfer=None)
    port = pick_free_port()
    argv = [sys.executable, "-m", "model_code.agent_server", info.model_uri, "--host", "127.0.0.1"]
    server = ServerProcess(argv, log_path=tmp_path / "agent.log", env=_env(mlflow_store, port), port=port)
    try:
        server.wait_http("/health", 240)
        refused = httpx.post(
            server.url + "/responses", json={"input": QUESTION, "custom_inputs": {"bogus": 1}}, timeout=60
        )
        assert refused.status_code == 400, refused.text
        with ThreadPoolExecutor(1) as pool:
            call = pool.submit(httpx.post, server.url + "/invocations", json={"input": QUESTION}, timeout=120)
            wait_until(lambda: engine.heads, "the request at the engine", 60)
            assert engine.heads[0].startswith("post /v1/chat/completions")
            engine.hang_up()
            assert call.result().status_code == 503
    finally:
        server.stop()


def test_a_model_of_another_flavour_is_refused(mlflow_store: Path) -> None:
    with mlflow.start_run():
        info = log_model({"models": {"m": {"url": "http://127.0.0.1:9/v1"}}}, flavor="chat_agent", flashinfer=None)
    done = subprocess.run(
        [sys.executable, "-m", "model_code.agent_server", info.model_uri],
        env=_env(mlflow_store, pick_free_port()), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1 and "flavor='responses_agent'" in done.stderr, done.stderr[-3000:]
