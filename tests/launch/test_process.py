"""The supervised engine process, driven against the real SGLang server on CPU.

A fake engine (a shell script) is used only where the real one cannot produce the fault on
demand: a process that ignores SIGTERM, to prove the SIGKILL fallback.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import openai
import pytest

from launch.config import EngineConfig
from launch.process import EngineExited, EngineProcess, EngineStartTimeout, new_engine_key
from launch.shm import SHM_DIR, group_pids, owned_shm_files

pytestmark = pytest.mark.engine


def assert_nothing_left(engine: EngineProcess, shm_files: set[Path]) -> None:
    assert engine.pid is not None
    assert group_pids(engine.pid) == set(), "processes of the engine's group are still running"
    leftovers = [p for p in shm_files if p.exists()]
    assert leftovers == [], f"/dev/shm files left behind: {leftovers}"


def test_engine_starts_serves_a_chat_and_stops_clean(tiny_engine_config: EngineConfig, tmp_path: Path) -> None:
    phases: list[str] = []
    key = new_engine_key()
    engine = EngineProcess(
        "tiny", tiny_engine_config, log_dir=tmp_path, on_progress=lambda phase, _t: phases.append(phase), api_key=key
    )
    with engine:
        assert engine.ready and engine.health()  # /health needs no key (probes, load balancers)
        # The key reaches SGLang through a private file, gone once the engine is ready; never on the command line.
        assert key not in Path(f"/proc/{engine.pid}/cmdline").read_bytes().decode()
        assert "--config" in engine.argv and not Path(engine.argv[engine.argv.index("--config") + 1]).exists()
        assert httpx.get(f"{engine.url}/v1/models", timeout=10).status_code == 401
        assert httpx.get(f"{engine.url}/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
        client = openai.OpenAI(base_url=f"{engine.url}/v1", api_key=key, max_retries=0)
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello!"}], max_tokens=8, temperature=0
        )
        assert reply.choices[0].message.role == "assistant"
        assert reply.usage is not None and 0 < reply.usage.completion_tokens <= 8
        assert reply.choices[0].finish_reason in ("length", "stop")
        assert client.models.list().data[0].id == "tiny"  # served under the model's YAML name
        shm_files = owned_shm_files(engine.pid)
        assert any(p.name.startswith("sglang_") for p in shm_files), "expected SGLang to map a /dev/shm file"
    assert engine.returncode is not None and not engine.running
    assert_nothing_left(engine, shm_files)
    assert phases[0] == "starting" and phases[-1].startswith("stopped")
    for phase in ("loading weights", "allocating KV cache", "HTTP server up", "ready"):
        assert phase in phases, phases
    log = engine.log_file.read_text()
    assert "Load weight begin" in log and engine.log_tail(5)
    assert key not in log and "<redacted>" in log  # SGLang prints its arguments, the key among them
    assert engine.log_file.stat().st_mode & 0o077 == 0


def test_readiness_timeout_raises_with_log_tail_and_stops(tiny_engine_config: EngineConfig, tmp_path: Path) -> None:
    engine = EngineProcess("slow", tiny_engine_config, log_dir=tmp_path)
    engine.start()
    try:
        with pytest.raises(EngineStartTimeout) as caught:
            engine.wait_ready(timeout_s=2.0)
        assert "was not ready after 2s" in str(caught.value)
        assert caught.value.returncode is None and caught.value.log_file == engine.log_file
    finally:
        started = time.monotonic()
        engine.stop()
    assert not engine.running and time.monotonic() - started < 30
    assert group_pids(engine.pid) == set()


def test_engine_dying_at_startup_reports_exit_code_and_log_quickly(tiny_model_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken-model"
    broken.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_text((tiny_model_dir / name).read_text())
    (broken / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["NoSuchModelForCausalLM"]}))
    config = EngineConfig(model_path=str(broken), device="cpu", startup_timeout_s=600)
    engine = EngineProcess("broken", config, log_dir=tmp_path)
    shm_before = set(SHM_DIR.iterdir())
    engine.start()
    try:
        with pytest.raises(EngineExited) as caught:
            engine.wait_ready()  # the 600 s timeout must not be what ends this
    finally:
        engine.stop()
    error = caught.value
    assert error.returncode not in (None, 0)
    assert f"exited with code {error.returncode}" in str(error)
    assert error.log_tail and "last lines of the engine log" in str(error)
    assert engine.uptime_s < 300
    assert group_pids(engine.pid) == set()
    left = {p for p in set(SHM_DIR.iterdir()) - shm_before if p.name.startswith(("sglang_", "sem.loky-"))}
    assert left == set(), f"the engine that died left /dev/shm files: {left}"


FAKE_ENGINE_IGNORING_SIGTERM = """#!/bin/sh
# Fake engine: ignores SIGTERM (and the arguments meant for SGLang) so that stop() must SIGKILL it.
[ "$1" = "-c" ] && exit 1   # the launcher's "is a real sgl_kernel importable?" probe
trap '' TERM
echo "fake engine up"
exec sleep 600
"""


def test_stop_falls_back_to_sigkill(tmp_path: Path) -> None:
    fake = tmp_path / "fake_engine_ignoring_sigterm"
    fake.write_text(FAKE_ENGINE_IGNORING_SIGTERM)
    fake.chmod(0o755)
    model = tmp_path / "m"
    model.mkdir()
    engine = EngineProcess("stubborn", EngineConfig(model_path=str(model), device="cpu", python=str(fake)), log_dir=tmp_path)
    engine.start()
    deadline = time.monotonic() + 10
    while "fake engine up" not in "\n".join(engine.log_tail()) and time.monotonic() < deadline:
        time.sleep(0.05)
    started = time.monotonic()
    returncode = engine.stop(grace_s=1.0)
    assert returncode == -9
    assert 1.0 <= time.monotonic() - started < 10
    assert group_pids(engine.pid) == set()


def test_shm_dir_exists_on_this_platform() -> None:
    assert SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)
