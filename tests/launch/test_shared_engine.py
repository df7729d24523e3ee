"""The machine-wide shared engine (``launch.shared``, ``launch.engine_dir``, ``launch.engine_host``).

Lock and directory rules are checked without an engine. The life cycle runs the real SGLang engine
on CPU: a host killed while it starts is replaced by the user waiting on it; a second user (another
process) joins the same engine; an engine that dies is restarted by its host on the same URL and
key; a SIGKILLed user does not keep the engine alive; when the last user leaves, nothing is left.
About two and a half engine starts (the first is cut short).
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from loguru import logger

from launch import engine_dir, shared
from launch.config import EngineConfig
from launch.procgroup import group_pids
from launch.shm import owned_shm_files
from tests.waiting import wait_until

SETTLE_S = 120  # bound on waiting for processes to appear or go away (never a timing assertion)


@pytest.fixture
def runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "runtime"
    monkeypatch.setenv(engine_dir.RUNTIME_DIR_ENV, str(root))
    return root


# ------------------------------------------------------------------------------ no engine
def test_key_follows_the_engine_config(tiny_engine_config: EngineConfig) -> None:
    key = engine_dir.engine_key("tiny", tiny_engine_config)
    assert key == engine_dir.engine_key("tiny", tiny_engine_config.model_copy())
    assert key != engine_dir.engine_key("other", tiny_engine_config)
    assert key != engine_dir.engine_key("tiny", tiny_engine_config.model_copy(update={"max_total_tokens": 1024}))


def test_runtime_dir_is_private_and_refuses_a_symlink(runtime_dir: Path, tmp_path: Path) -> None:
    root = engine_dir.runtime_root()
    assert root == runtime_dir and (root.stat().st_mode & 0o777) == 0o700
    os.chmod(root, 0o755)
    assert (engine_dir.runtime_root().stat().st_mode & 0o777) == 0o700
    trap = tmp_path / "trap"
    trap.symlink_to(tmp_path)
    with pytest.raises(engine_dir.SharedEngineError, match="not a directory owned by this user"):
        engine_dir.private_dir(trap)


def test_host_lock_tells_whether_a_host_lives(runtime_dir: Path) -> None:
    key_dir = engine_dir.private_dir(runtime_dir / "engines" / "k")
    assert not engine_dir.host_alive(key_dir)
    fd = engine_dir.open_lock_file(key_dir / engine_dir.HOST_LOCK)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert engine_dir.host_alive(key_dir)
    finally:
        os.close(fd)
    assert not engine_dir.host_alive(key_dir)


def test_a_users_lock_on_a_removed_file_is_noticed(runtime_dir: Path) -> None:
    key_dir = engine_dir.private_dir(runtime_dir / "engines" / "k")
    fd = engine_dir.hold_users_lock(key_dir)
    try:
        assert engine_dir.same_file(fd, key_dir / engine_dir.USERS_LOCK)
        (key_dir / engine_dir.USERS_LOCK).unlink()  # what a host does when it leaves
        assert not engine_dir.same_file(fd, key_dir / engine_dir.USERS_LOCK)
    finally:
        os.close(fd)
    fd = engine_dir.hold_users_lock(key_dir)  # starts over on a fresh file
    assert engine_dir.same_file(fd, key_dir / engine_dir.USERS_LOCK)
    os.close(fd)


# ------------------------------------------------------------------------------ real engine
def _state(key_dir: Path) -> dict:
    return engine_dir.read_json(key_dir / engine_dir.STATE_FILE) or {}



def _chat(lease: shared.SharedEngine) -> int:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    return httpx.post(
        f"{lease.url}/v1/chat/completions", json=body, headers=lease.auth_headers(), timeout=120
    ).status_code


_SECOND_USER = """
import sys
from launch import engine_dir, shared
from launch.config import EngineConfig
lease = shared.join("tiny", EngineConfig.model_validate_json(sys.argv[1]))
print(lease.pid, lease.started_host, flush=True)
sys.stdin.read()  # hold the engine until killed
"""


@pytest.mark.engine
def test_shared_engine_life_cycle(tiny_engine_config: EngineConfig, runtime_dir: Path, tmp_path: Path) -> None:
    engine = tiny_engine_config.model_copy(update={"skip_server_warmup": True})
    key_dir = engine_dir.key_dir_for("tiny", engine)
    joined: dict = {}

    def first_user() -> None:
        try:
            joined["lease"] = shared.join("tiny", engine, log_dir=tmp_path, show_log=True)
        except BaseException as error:  # handed to the test thread
            joined["error"] = error

    shown: list[str] = []
    sink = logger.add(lambda message: shown.append(message.record["message"]), level="INFO")
    user = threading.Thread(target=first_user)
    user.start()
    # the host dies while the engine starts: the user waiting on it starts a new host
    wait_until(lambda: _state(key_dir).get("status") == "starting", "the first host to start the engine", SETTLE_S, every_s=0.2)
    first_host = _state(key_dir)["host_pid"]
    os.kill(first_host, signal.SIGKILL)
    user.join(timeout=SETTLE_S * 3)
    logger.remove(sink)
    assert "error" not in joined, joined.get("error")
    assert any(line.startswith("[tiny]") and "Load weight" in line for line in shown)  # show_log: the engine's lines
    lease: shared.SharedEngine = joined["lease"]
    assert lease.host_pid != first_host and lease.started_host and _chat(lease) == 200

    # another process joins the same engine without starting one
    second = subprocess.Popen(
        [sys.executable, "-c", _SECOND_USER, engine.model_dump_json()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        text=True,
    )
    try:
        pid, started = second.stdout.readline().split()
        assert int(pid) == lease.pid and started == "False"

        # the engine dies: its host restarts it, on the same URL and key; the user recovers
        url, old_engine = lease.url, lease.pid
        os.killpg(old_engine, signal.SIGKILL)
        assert lease.recover()
        assert lease.pid != old_engine and lease.url == url and _chat(lease) == 200
        shm_files = owned_shm_files(lease.pid)
        host, new_engine = lease.host_pid, lease.pid
    finally:
        second.kill()  # SIGKILL: the kernel drops its lock
        second.wait()
    assert engine_dir.host_alive(key_dir)  # the first user still holds the engine

    lease.close()
    wait_until(lambda: not group_pids(new_engine) and not key_dir.exists(), "the engine to stop and its directory to go", SETTLE_S, every_s=0.2)
    wait_until(lambda: not Path(f"/proc/{host}").exists(), "the host to exit", SETTLE_S, every_s=0.2)  # reaped by this process
    assert [f for f in shm_files if f.exists()] == []
