"""``sglang-gateway serve`` end to end: the README's main-job command on the tiny CPU model.

Starts the real command (which launches its own engine through the app's lifespan), runs the
README's curl and OpenAI SDK examples against it, then sends SIGTERM during a stream: the stream
runs to its last token, the process exits 0, and neither the engine it started nor its /dev/shm
files are left.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import openai
import pytest

from launch.procgroup import child_pids, cmdline
from tests.gateway.helpers import BackgroundStream
from tests.leaks import leaves_nothing
from tests.servers import CLI, REPO, ServerProcess

STREAM_TOKENS = 150


def test_serve_bad_config_is_one_line_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  a:\n    url: http://127.0.0.1:1\ngateway:\n  port: nope\n")
    result = subprocess.run([*CLI, "serve", str(bad)], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {bad}: gateway.port: Input should be a valid integer, unable to parse string as an integer"


@pytest.mark.usefixtures("starts_engine")
def test_serve_tiny_cpu_readme_examples_and_graceful_sigterm(tiny_model_dir: Path, tmp_path: Path) -> None:
    env = {**os.environ, "SGLANG_GATEWAY_TINY_MODEL": str(tiny_model_dir)}
    with leaves_nothing() as check:
        server = ServerProcess([*CLI, "serve", "configs/tiny-cpu.yaml", "--port", "{port}"], log_path=tmp_path / "serve.log", env=env)
        check.watch(server.pid)
        server.wait_http("/ready", timeout_s=300)
        base = server.url
        log = (tmp_path / "serve.log").read_text()
        assert f"gateway: listening on {base} (status page and playground: {base}/)" in log, log[-2000:]
        engine_pids = [pid for pid in child_pids(server.pid) if "sglang.launch_server" in cmdline(pid)]
        assert len(engine_pids) == 1, "the gateway should have started one engine process"
        check.watch(engine_pids[0])

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

        # SIGTERM during a stream: the stream still runs to its end, then everything stops.
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": STREAM_TOKENS,
                "ignore_eos": True, "stream": True, "temperature": 0, "stream_options": {"include_usage": True}}
        stream = BackgroundStream(base + "/v1/chat/completions", body).start()
        server.proc.send_signal(signal.SIGTERM)
        events = stream.finish()
        assert events[-1] == "data: [DONE]", events[-3:]
        chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
        assert not [chunk for chunk in chunks if "error" in chunk], "the stream ended with an error event"
        finish_reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finish_reasons and finish_reasons[-1] == "length", events[-3:]
        assert chunks[-1]["usage"]["completion_tokens"] == STREAM_TOKENS
        # ...and the events between reached the client: one per token, except where a token ends mid
        # UTF-8 character (random weights emit many) and the engine holds its text for the next one.
        deltas = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
        assert len([d for d in deltas if d]) >= STREAM_TOKENS // 2, len(deltas)
        assert server.proc.wait(timeout=60) == 0
