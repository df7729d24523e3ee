"""Serving throughput as users meet it: one logged model (ChatAgent, URL mode: the engine is the upstream given)
served three ways, ``concurrency`` clients at once, the server's whole process tree's CPU measured:

- ``mlflow models serve -w N`` ``/invocations`` (MLflow's scoring server: it answers whole, never streams);
- ``sglang-gateway serve --model-uri`` ``/invocations`` with ``"stream": true`` (the same model's ``predict_stream``);
- the same gateway's OpenAI route ``/v1/chat/completions`` (streamed), in front of the same engine.

Tokens are the answers' ``completion_tokens``; tokens/s is over the wall time of the measured requests. The model
is logged with tracing off (a throughput figure; the tracing cost is ``benchmarks mlflow``'s).
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from benchmarks import processes
from launch.ports import pick_free_port

MESSAGES = [{"role": "user", "content": " ".join(["hello"] * 24)}]


def _invocations_whole(http: httpx.Client, url: str, max_tokens: int) -> int:
    body = {"messages": MESSAGES, "custom_inputs": {"max_tokens": max_tokens, "temperature": 0.0}}
    answer = http.post(url + "/invocations", json=body)
    answer.raise_for_status()
    data = answer.json()
    data = data.get("predictions", data) if isinstance(data, dict) else data
    return int((data.get("usage") or {}).get("completion_tokens") or 0)


def _sse_tokens(http: httpx.Client, url: str, body: dict[str, Any]) -> int:
    tokens = 0
    with http.stream("POST", url, json=body) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = int(usage.get("completion_tokens") or tokens)
    return tokens


def _invocations_stream(http: httpx.Client, url: str, max_tokens: int) -> int:
    body = {"messages": MESSAGES, "custom_inputs": {"max_tokens": max_tokens, "temperature": 0.0}, "stream": True}
    return _sse_tokens(http, url + "/invocations", body)


def _openai_stream(http: httpx.Client, url: str, max_tokens: int) -> int:
    body = {
        "model": "bench", "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    return _sse_tokens(http, url + "/v1/chat/completions", body)


def _drive(url: str, call: Any, concurrency: int, requests: int, max_tokens: int, pgid: int) -> dict[str, float]:
    """``requests`` calls, ``concurrency`` at a time (after a warm-up of one per client): tokens/s, CPU µs/token."""
    clients = [httpx.Client(timeout=600) for _ in range(concurrency)]
    try:
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(lambda http: call(http, url, max_tokens), clients))
            cpu, start = processes.group_cpu_s(pgid), time.perf_counter()
            per_client = max(1, requests // concurrency)
            tokens = sum(pool.map(lambda http: sum(call(http, url, max_tokens) for _ in range(per_client)), clients))
            wall, cpu = time.perf_counter() - start, processes.group_cpu_s(pgid) - cpu
    finally:
        for http in clients:
            http.close()
    return {
        "requests": per_client * concurrency, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
        "server_cpu_s": cpu, "cpu_us_per_token": cpu * 1e6 / max(tokens, 1),
    }  # fmt: skip


def run_serving_bench(
    url: str, workers: int, concurrency: int, requests: int, max_tokens: int, out_dir: Path, console: Console
) -> dict[str, Any]:
    import mlflow

    from model_code import log_model

    tracking = f"sqlite:///{out_dir / 'mlflow.db'}"
    mlflow.set_tracking_uri(tracking)
    experiment = mlflow.create_experiment(f"serving-{time.time_ns()}", artifact_location=str(out_dir / "mlflow-artifacts"))
    mlflow.set_experiment(experiment_id=experiment)
    with mlflow.start_run():
        info = log_model({"models": {"bench": {"url": url}}, "mlflow": {"tracing": "off"}}, flavor="chat_agent", flashinfer=None)
    # MLflow's server runs ``uvicorn`` by name: this interpreter's scripts first on the PATH
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": tracking, "PATH": path}
    rows = []

    port = pick_free_port()
    argv = [
        sys.executable, "-m", "mlflow", "models", "serve", "-m", info.model_uri, "-w", str(workers), "-p", str(port),
        "-h", "127.0.0.1", "--env-manager", "local",
    ]  # fmt: skip
    console.print(f"mlflow models serve -w {workers}")
    child = processes.Child("mlflow models serve", argv, out_dir / "mlflow-serve.log", env)
    try:
        served = f"http://127.0.0.1:{port}"
        processes.wait_http(served + "/ping", child, 180)
        rows.append({"server": f"mlflow models serve -w {workers}", "route": "/invocations (whole answer)",
                     **_drive(served, _invocations_whole, concurrency, requests, max_tokens, child.pid)})  # fmt: skip
    finally:
        child.stop()

    port = pick_free_port()
    argv = [*processes.gateway_argv(Path("x"))[:-1], "--model-uri", info.model_uri, "--port", str(port), "--host", "127.0.0.1"]
    console.print("sglang-gateway serve --model-uri")
    child = processes.Child("gateway --model-uri", argv, out_dir / "gateway-serve.log", env)
    try:
        served = f"http://127.0.0.1:{port}"
        processes.wait_http(served + "/ready", child, 180)
        for route, call in (("/invocations (stream)", _invocations_stream), ("/v1/chat/completions (stream)", _openai_stream)):
            rows.append({"server": "sglang-gateway serve --model-uri", "route": route,
                         **_drive(served, call, concurrency, requests, max_tokens, child.pid)})  # fmt: skip
    finally:
        child.stop()
    return {"rows": rows, "workers": workers, "concurrency": concurrency, "max_tokens": max_tokens, "load": os.getloadavg()}
