"""``mlflow models serve -w 2`` of a logged model, as a serving container runs it (real CPU engine).

The two scoring workers share one engine; both answer requests (which worker answered is read from
the kernel: the worker that holds the server end of the request's TCP connection); SIGKILL of the
worker that started the engine leaves the other one answering, with the same engine, and the worker
uvicorn starts in its place joins that engine; stopping the server leaves no engine, no engine host,
no shared-engine directory and none of the engine's ``/dev/shm`` files. One engine start.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import mlflow
import psutil
import pytest

from launch.engine_dir import STATE_FILE, runtime_root
from launch.shm import owned_shm_files
from model_code import log_model
from tests.servers import server_process
from tests.waiting import wait_until

pytestmark = pytest.mark.engine

BODY = {"messages": [{"role": "user", "content": "What is Databricks?"}], "custom_inputs": {"max_tokens": 4}}
SETTLE_S = 120  # bound on waiting for processes to appear or go away (never a timing assertion)
TAG_ENV = "SGLANG_GATEWAY_TEST_SERVER_TAG"  # set for the server only: its processes (engine hosts too) inherit it


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def _live(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def scoring_workers(server: psutil.Process) -> list[psutil.Process]:
    """uvicorn's worker processes under ``server`` (spawned by multiprocessing)."""
    return [p for p in server.children(recursive=True) if "spawn_main" in _cmdline(p) and _live(p)]


def engine_hosts(tag: str | None = None) -> list[psutil.Process]:
    """Live engine hosts on this machine; with ``tag``, only those whose environment carries it (see ``TAG_ENV``):
    the ones this test's server started, not those of tests running alongside (pytest-xdist) or of other users."""
    return [p for p in psutil.process_iter() if "launch.engine_host" in _cmdline(p) and _live(p) and _tagged(p, tag)]


def _tagged(proc: psutil.Process, tag: str | None) -> bool:
    try:
        return tag is None or proc.environ().get(TAG_ENV) == tag
    except psutil.Error:
        return False


def engines_of(parents: set[int]) -> list[psutil.Process]:
    """``sglang.launch_server`` main processes started by one of ``parents``."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.ppid() in parents and "sglang.launch_server" in _cmdline(proc) and _live(proc):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def ask(url: str) -> tuple[int, int | None]:
    """POST one request on a new connection: (HTTP status, pid of the worker that held the connection)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.connect()
        client_port = conn.sock.getsockname()[1]
        conn.request("POST", "/invocations", body=json.dumps(BODY), headers={"Content-Type": "application/json"})
        worker = _connection_owner(int(port), client_port)
        response = conn.getresponse()
        payload = response.read()
        assert response.status != 200 or json.loads(payload)["messages"][0]["role"] == "assistant"
        return response.status, worker
    finally:
        conn.close()


def _connection_owner(server_port: int, client_port: int) -> int | None:
    """The process holding the server side of the connection from ``client_port`` (accepted by then)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.raddr and conn.laddr.port == server_port and conn.raddr.port == client_port:
                if conn.pid:
                    return conn.pid
        time.sleep(0.05)
    return None



@pytest.fixture(scope="module")
def logged_agent(mlflow_store, tiny_deployment, tiny_model_dir):
    engine = tiny_deployment.engine("tiny").model_dump(mode="json", exclude_defaults=True)
    engine["skip_server_warmup"] = True
    with mlflow.start_run():
        return log_model({"models": {"tiny": {"engine": engine}}}, flavor="chat_agent", model_path=tiny_model_dir)


def test_two_workers_one_engine_survives_the_owner_and_leaves_nothing(logged_agent, mlflow_store):
    tag = uuid.uuid4().hex
    hosts_before = {p.pid for p in engine_hosts(tag)}
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    env = {**os.environ, "PATH": path, "MLFLOW_TRACKING_URI": f"sqlite:///{mlflow_store}/mlflow.db", TAG_ENV: tag}
    argv = [sys.executable, "-m", "mlflow", "models", "serve", "-m", logged_agent.model_uri]
    argv += ["--env-manager", "local", "-h", "127.0.0.1", "-p", "{port}", "-w", "2"]
    log_path = mlflow_store / "mlflow-serve-w2.log"
    with server_process(argv, log_path=log_path, env=env, ready_path="/ping") as served:
        url, server = served.url, psutil.Process(served.pid)
        wait_until(lambda: len(scoring_workers(server)) == 2, "two scoring workers", SETTLE_S, every_s=0.5)
        workers = {p.pid for p in scoring_workers(server)}
        wait_until(lambda: {p.ppid() for p in engine_hosts(tag) if p.pid not in hosts_before} & workers, "the engine host", SETTLE_S, every_s=0.5)
        [host] = [p for p in engine_hosts(tag) if p.pid not in hosts_before and p.ppid() in workers]
        owner = host.ppid()  # the worker that started the engine (through its host)

        # exactly one engine for the two workers: none of their own, one under the host
        assert engines_of(workers) == []
        [engine] = engines_of({host.pid})
        key_dir = _key_dir_of(host)
        state = json.loads((key_dir / STATE_FILE).read_text())
        assert state["engine_pid"] == engine.pid and state["started_by"] == owner
        shm_files = owned_shm_files(engine.pid)

        # both workers answer (a new connection each time; the kernel hands it to either worker)
        answered: set[int | None] = set()
        for _ in range(60):
            status, worker = ask(url)
            assert status == 200
            answered.add(worker)
            if workers <= answered:
                break
        assert workers <= answered, f"answered by {answered}, workers {workers}"

        # SIGKILL the worker that started the engine: the other keeps answering, on the same engine
        os.kill(owner, signal.SIGKILL)
        for _ in range(10):
            status, worker = ask(url)
            assert status == 200 and worker != owner
        assert [p.pid for p in engines_of({host.pid})] == [engine.pid] and _live(host)

        # uvicorn replaces the dead worker; the new one joins the running engine instead of starting one
        wait_until(lambda: len({p.pid for p in scoring_workers(server)} - workers) == 1, "a replacement worker", SETTLE_S, every_s=0.5)
        [replacement] = {p.pid for p in scoring_workers(server)} - workers
        for _ in range(SETTLE_S):
            status, worker = ask(url)
            assert status == 200
            if worker == replacement:
                break
            time.sleep(1)
        assert worker == replacement
        everyone = {p.pid for p in scoring_workers(server)} | {host.pid}
        assert [p.pid for p in engines_of(everyone)] == [engine.pid]
        assert [h.pid for h in engine_hosts(tag) if h.pid not in hosts_before] == [host.pid]
        assert "server_args=" not in log_path.read_text(errors="replace")  # the engine's log stays in its file

    # the server is stopped (process group SIGTERM): the host sees no user left and stops the engine
    wait_until(lambda: not _live(host) and not _live(engine), "the engine and its host to stop", SETTLE_S, every_s=0.5)
    wait_until(lambda: not key_dir.exists(), "the shared-engine directory to be removed", SETTLE_S, every_s=0.5)
    assert [h.pid for h in engine_hosts(tag) if h.pid not in hosts_before] == []
    assert [f for f in shm_files if f.exists()] == []


def _key_dir_of(host: psutil.Process) -> Path:
    key_dir = Path(host.cmdline()[-1])
    assert key_dir.parent == runtime_root() / "engines"
    return key_dir
