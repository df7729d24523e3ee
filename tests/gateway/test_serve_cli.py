"""``sglang-gateway serve`` end to end: the README's main-job command on the tiny CPU model.

Starts the real command (which launches its own engine through the app's lifespan), runs the
README's curl and OpenAI SDK examples against it, then sends SIGTERM during a stream: the stream
finishes, the process exits 0 and the engine it started is gone.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from launch.ports import pick_free_port
from launch.shm import group_pids

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "gateway.cli"]


def test_serve_bad_config_is_one_line_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  a:\n    url: http://127.0.0.1:1\ngateway:\n  port: nope\n")
    result = subprocess.run([*CLI, "serve", str(bad)], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {bad}: gateway.port: Input should be a valid integer, unable to parse string as an integer"


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


@pytest.mark.engine
def test_serve_tiny_cpu_readme_examples_and_graceful_sigterm(tiny_model_dir: Path, tmp_path: Path) -> None:
    port = pick_free_port()
    env = {**os.environ, "SGLANG_GATEWAY_TINY_MODEL": str(tiny_model_dir)}
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([*CLI, "serve", "configs/tiny-cpu.yaml", "--port", str(port)], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(base + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "gateway not ready after 300s"
            time.sleep(0.5)
        engine_pids = _children(proc.pid)
        assert engine_pids, "the gateway started no engine process"

        # README: curl
        if shutil.which("curl"):
            out = subprocess.run(
                ["curl", "-s", f"{base}/v1/chat/completions", "-H", "Content-Type: application/json", "-d",
                 '{"model": "default", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16}'],
                capture_output=True, text=True, timeout=60, check=True,
            ).stdout
            assert json.loads(out)["choices"][0]["message"]["role"] == "assistant"

        # README: OpenAI SDK
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        reply = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hello!"}], max_tokens=16)
        assert reply.choices[0].message.content is not None
        streamed = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Hello!"}], max_tokens=16, stream=True) if c.choices]
        assert streamed

        # SIGTERM during a stream: the stream still ends with [DONE], then everything stops.
        events: list[bytes] = []
        started = threading.Event()

        def stream() -> None:
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 150,
                    "ignore_eos": True, "stream": True, "temperature": 0}
            with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    started.set()
                    if line:
                        events.append(line.encode())

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(30)
        proc.send_signal(signal.SIGTERM)
        reader.join(60)
        assert events[-1] == b"data: [DONE]", events[-3:]
        assert proc.wait(timeout=60) == 0
        for pid in engine_pids:
            assert not group_pids(pid), f"engine process group {pid} still alive"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()
