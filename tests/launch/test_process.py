"""The supervised engine process, driven against the real SGLang server on CPU, and its /dev/shm hygiene.

A fake engine (a shell script) is used only where the real one cannot produce the fault on
demand: a process that ignores SIGTERM, to prove the SIGKILL fallback. The orphan sweep is shown on
files made here, mapped by a plain child process (an engine's files are mapped the same way).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from launch import shm
from launch.config import EngineConfig
from launch.process import (
    EngineExited,
    EngineProcess,
    EngineStartTimeout,
    killed_by,
    new_engine_key,
    start_failure_cause,
)
from launch.procgroup import group_pids
from launch.shm import SHM_DIR, orphaned_shm_files, remove_orphaned_shm
from tests.fake_engine import fake_engine_python
from tests.leaks import leaves_nothing, unused_shm_files
from tests.waiting import wait_until


@pytest.mark.usefixtures("starts_engine")
def test_engine_starts_serves_a_chat_and_stops_clean(tiny_engine_config: EngineConfig, tmp_path: Path) -> None:
    phases: list[str] = []
    key = new_engine_key()
    engine = EngineProcess(
        "tiny", tiny_engine_config, log_dir=tmp_path, on_progress=lambda phase, _t: phases.append(phase), api_key=key
    )
    with leaves_nothing() as check, engine:
        check.watch(engine.pid)
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
        # SGLang's temporary files (ZeroMQ sockets, the metrics directory) are in the engine's own TMPDIR
        assert engine.tmp_dir is not None and f"TMPDIR={engine.tmp_dir}".encode() in Path(f"/proc/{engine.pid}/environ").read_bytes()
        kinds = {"socket" if path.is_socket() else "dir" if path.is_dir() else "file" for path in engine.tmp_dir.iterdir()}
        assert {"socket", "dir"} <= kinds, sorted(engine.tmp_dir.iterdir())
    assert engine.returncode is not None and not engine.running
    assert not engine.tmp_dir.exists()  # removed with the engine (leaves_nothing checks it too)
    assert phases[0] == "starting" and phases[-1].startswith("stopped")
    for phase in ("loading weights", "allocating KV cache", "HTTP server up", "ready"):
        assert phase in phases, phases
    log = engine.log_file.read_text()
    assert "Load weight begin" in log and engine.log_tail(5)
    assert key not in log and "<redacted>" in log  # SGLang prints its arguments, the key among them
    assert engine.log_file.stat().st_mode & 0o077 == 0


def test_readiness_timeout_raises_with_log_tail_and_stops(tiny_engine_config: EngineConfig, tmp_path: Path) -> None:
    """A FAKE engine (tests/fake_engine.py) that takes 60 s to listen: the timeout and the stop of a starting
    engine are the launcher's; a real start is the test above."""
    fake = {"python": str(fake_engine_python(tmp_path)), "env": {"FAKE_ENGINE_START_S": "60"}}
    engine = EngineProcess("slow", tiny_engine_config.model_copy(update=fake), log_dir=tmp_path)
    with leaves_nothing() as check:
        engine.start()
        check.watch(engine.pid)
        try:
            with pytest.raises(EngineStartTimeout) as caught:
                engine.wait_ready(timeout_s=2.0)
            assert "was not ready after 2s" in str(caught.value)
            assert caught.value.returncode is None and caught.value.log_file == engine.log_file
            assert any("fake engine" in line for line in caught.value.log_tail)  # the tail its name promises
        finally:
            engine.stop()
        assert not engine.running


@pytest.mark.usefixtures("starts_engine")
def test_engine_dying_at_startup_reports_exit_code_and_log_quickly(tiny_model_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken-model"
    broken.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_text((tiny_model_dir / name).read_text())
    (broken / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["NoSuchModelForCausalLM"]}))
    config = EngineConfig(model_path=str(broken), device="cpu", startup_timeout_s=600)
    engine = EngineProcess("broken", config, log_dir=tmp_path)
    with leaves_nothing() as check:  # the engine that died leaves no /dev/shm file either
        engine.start()
        check.watch(engine.pid)
        try:
            with pytest.raises(EngineExited) as caught:
                engine.wait_ready()  # the 600 s timeout must not be what ends this
        finally:
            engine.stop()
    error = caught.value
    assert error.returncode not in (None, 0)
    assert f"exited with code {error.returncode}" in str(error)
    assert error.log_tail and "last lines of the engine log" in str(error)
    # the first line says why, in SGLang's words (an unsupported architecture: its scheduler's exception)
    assert "while starting: ValueError: Cannot find model module. 'NoSuchModelForCausalLM'" in str(error).splitlines()[0], str(error)[:500]


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
    wait_until(lambda: "fake engine up" in "\n".join(engine.log_tail()), "the fake engine to be up (ignoring SIGTERM)", 10, every_s=0.05)
    started = time.monotonic()
    returncode = engine.stop(grace_s=1.0)
    assert returncode == -9
    assert 1.0 <= time.monotonic() - started < 10
    assert group_pids(engine.pid) == set()


def test_shm_dir_exists_on_this_platform() -> None:
    assert SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


MAP_AND_WAIT = "import mmap, sys; f = open(sys.argv[1], 'r+b'); m = mmap.mmap(f.fileno(), 0); f.close(); print('mapped', flush=True); sys.stdin.read()"


@pytest.fixture()
def engine_style_files(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Path]]:
    """Three engine-style /dev/shm files of 4 KiB (removed at the end if a test left them).

    Their names match an engine pattern of this process only: the engines other tests (other pytest-xdist
    workers) stop meanwhile sweep the real patterns, and would otherwise take the unused files of this test."""
    monkeypatch.setattr(shm, "ENGINE_SHM_PATTERNS", (*shm.ENGINE_SHM_PATTERNS, "gwtest_sweep_*"))
    paths = [SHM_DIR / f"gwtest_sweep_{uuid.uuid4().hex}.shm" for _ in range(3)]
    for path in paths:
        path.write_bytes(b"\0" * 4096)
        os.utime(path, (time.time() - 60, time.time() - 60))  # made a minute ago
    yield paths
    for path in paths:
        path.unlink(missing_ok=True)


def test_orphan_sweep_removes_only_files_no_live_process_uses(engine_style_files: list[Path]) -> None:
    """What the next engine start does with the files of an engine whose launcher was SIGKILLed."""
    used, orphan, young = engine_style_files
    os.utime(young, None)  # just made: left alone, whoever is setting it up
    holder = subprocess.Popen([sys.executable, "-c", MAP_AND_WAIT, str(used)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "mapped\n"
        assert orphaned_shm_files() >= {orphan, young} and used not in orphaned_shm_files()
        assert {orphan, young} <= unused_shm_files() and used not in unused_shm_files()  # the tests' own check agrees
        removed = remove_orphaned_shm()
        assert orphan in removed and not orphan.exists()
        assert used.exists() and young.exists()
    finally:
        holder.communicate("")  # the holder exits: its file is an orphan now
    os.utime(used, (time.time() - 60, time.time() - 60))
    assert used in remove_orphaned_shm() and not used.exists() and young.exists()


def test_orphan_sweep_leaves_other_users_files(engine_style_files: list[Path]) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file to another user")
    theirs = engine_style_files[0]
    os.chown(theirs, 54321, 54321)
    assert theirs not in remove_orphaned_shm() and theirs.exists()


def test_the_cause_of_a_failed_start_is_read_from_the_log() -> None:
    """The first line of a failed start's error says why, in SGLang's (or the kernel's) words."""
    main_process = ["UserWarning: x", "Traceback (most recent call last):", '  File "a.py", line 1, in <module>', "    raise ValueError(",
                    "ValueError: Unrecognized model in /m. Should have a `model_type` key in its config.json."]  # fmt: skip
    assert start_failure_cause(main_process) == "ValueError: Unrecognized model in /m. Should have a `model_type` key in its config.json."
    parser = ["usage: sglang serve [-h] ...", "                    [--config CONFIG]", "sglang serve: error: argument --max-running-requests: invalid int value: 'lots'"]
    assert start_failure_cause(parser) == "SGLang refused its command line: argument --max-running-requests: invalid int value: 'lots'"
    crashed = ["[x] Scheduler hit an exception: Traceback (most recent call last):", "  File s", "IndexError: boom", "Traceback (most recent call last):", "FileNotFoundError: later"]
    assert start_failure_cause(crashed) == "IndexError: boom"  # the crash, not what failed on the way down
    assert start_failure_cause(["loading", "Load weight begin"]) is None
    assert killed_by(-9) == "killed by SIGKILL (the kernel's out-of-memory killer, or another process)"
    assert killed_by(-15) == "killed by SIGTERM" and killed_by(1) is None and killed_by(None) is None
