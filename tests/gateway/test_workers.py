"""``gateway.workers: 2``: two data-plane processes on one port, one control process owning the engines.

Two gateways, each ``sglang-gateway serve`` as a user runs it:

- in front of the session's real CPU engine (a ``url:`` model, so no engine starts here): both workers answer,
  a stored response created through one worker is read through the other, metrics are summed over workers;
- with a FAKE engine the gateway launches and owns (tests/fake_engine.py: a swap, a crash and a restart take
  a second, not a minute): a swap under load across both workers fails no request, a request that crashed
  the engine through one worker is refused by the other, a SIGKILLed worker comes back while the other one
  serves, and SIGTERM leaves nothing behind.

Each request goes out on a connection of its own (no keep-alive), so the kernel spreads them over both
workers; each response names its worker (``X-Gateway-Worker``).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from launch.process import EngineProcess
from launch.procgroup import stat_fields
from tests.admin_client import prometheus_value
from tests.fake_engine import CRASH, FREEZE, TOKEN, fake_engine_python
from tests.gateway_server import KEY, auth
from tests.leaks import leaves_nothing
from tests.load import ThreadedLoad
from tests.servers import CLI, ServerProcess
from tests.waiting import wait_until

ADMIN = "workers-admin-key"
PROMPT = [{"role": "user", "content": "Say something."}]
WORKER = "x-gateway-worker"


def fresh(url: str) -> httpx.Client:
    """A client that opens a new connection for every request (so requests spread over the workers)."""
    return httpx.Client(base_url=url, headers=auth(KEY), timeout=60, limits=httpx.Limits(max_keepalive_connections=0))


def until_each_worker(url: str, send: Any, workers: int = 2, attempts: int = 60) -> dict[str, httpx.Response]:
    """Call ``send(client)`` on fresh connections until every worker answered once; worker index -> response."""
    seen: dict[str, httpx.Response] = {}
    with fresh(url) as client:
        for _ in range(attempts):
            response = send(client)
            seen.setdefault(response.headers[WORKER], response)
            if len(seen) == workers:
                return seen
    raise AssertionError(f"only workers {sorted(seen)} answered {attempts} requests")


def serve(config: dict[str, Any], tmp_path: Path) -> ServerProcess:
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(config))
    server = ServerProcess([*CLI, "serve", str(path), "--port", "{port}"], log_path=tmp_path / "gateway.log")
    try:
        server.wait_log(r"2 worker processes listening", timeout_s=180)
        server.wait_http("/health", timeout_s=30)
    except BaseException:
        server.stop()
        raise
    return server


def admin(server: ServerProcess, path: str, method: str = "GET") -> Any:
    response = httpx.request(method, server.url + path, headers=auth(ADMIN), timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


# ----------------------------------------------------------------------------- the real engine, by URL


@pytest.fixture(scope="module")
def real(tiny_engine: EngineProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    config = {
        "gateway": {"workers": 2, "api_keys": [KEY], "admin_keys": [ADMIN], "open_paths": ["/health", "/ready", "/metrics"]},
        "models": {"tiny": {"url": tiny_engine.url, "api_key": tiny_engine.api_key}},
    }
    server = serve(config, tmp_path_factory.mktemp("workers-real"))
    yield server
    server.stop()


def test_both_workers_answer_and_each_request_is_logged_once(real: ServerProcess) -> None:
    body = {"model": "tiny", "messages": PROMPT, "max_tokens": 2, "temperature": 0}
    answers = until_each_worker(real.url, lambda client: client.post("/v1/chat/completions", json=body))
    assert {response.status_code for response in answers.values()} == {200}
    pids = {w["index"]: w["pid"] for w in admin(real, "/admin/workers")["workers"]}
    assert len(set(pids.values())) == 2 and all(pid != real.pid for pid in pids.values())
    log = real.log()
    for index, response in answers.items():
        request_id = response.headers["x-request-id"]
        lines = [line for line in log.splitlines() if f"request_id={request_id}" in line]
        assert len(lines) == 1 and f"worker={index}" in lines[0], lines


def test_a_stored_response_created_through_one_worker_is_read_through_the_other(real: ServerProcess) -> None:
    with fresh(real.url) as client:
        created = client.post("/v1/responses", json={"model": "tiny", "input": "Hello", "max_output_tokens": 4, "store": True})
        assert created.status_code == 200, created.text
        response_id, creator = created.json()["id"], created.headers[WORKER]
        for _ in range(60):
            read = client.get(f"/v1/responses/{response_id}")
            if read.headers[WORKER] != creator:
                break
        else:
            raise AssertionError("every read landed on the worker that created the response")
    assert read.status_code == 200, read.text
    assert read.json()["id"] == response_id


def test_metrics_are_summed_over_the_workers(real: ServerProcess) -> None:
    labels = {"model": "tiny", "route": "/v1/chat/completions", "status": "200"}

    def requests_counted() -> dict[str, float]:
        scrapes = until_each_worker(real.url, lambda client: client.get("/metrics"))
        return {index: prometheus_value(scrape.text, "gateway_requests_total", labels) or 0.0 for index, scrape in scrapes.items()}

    before = requests_counted()
    assert before["0"] == before["1"]  # either worker answers the scrape with the same sum
    body = {"model": "tiny", "messages": PROMPT, "max_tokens": 1}
    with fresh(real.url) as client:
        served = [client.post("/v1/chat/completions", json=body) for _ in range(8)]
    assert {r.status_code for r in served} == {200} and {r.headers[WORKER] for r in served} == {"0", "1"}
    after = requests_counted()
    assert after == {"0": before["0"] + 8, "1": before["1"] + 8}


# ----------------------------------------------------------------------------- a FAKE engine the gateway owns


@dataclass
class Outcome:
    started: float
    ended: float
    worker: str | None
    status: int | None
    complete: bool  # a 200 with every piece of the answer
    detail: str = ""


@dataclass
class Load(ThreadedLoad[Outcome]):
    """Requests on fresh connections (half streamed), each outcome with the worker that answered it. A request
    lasts 3 s on the fake (60 pieces of 50 ms): longer than the second an engine takes to stop on SIGTERM, so
    an engine stopped under a request cuts it."""

    tokens: int = 60

    def client(self) -> AbstractContextManager[Any]:
        return fresh(self.base_url)

    def one(self, client: httpx.Client, stream: bool) -> Outcome:
        started = time.monotonic()
        body = {"model": "tiny", "messages": PROMPT, "max_tokens": self.tokens, "stream": stream}
        try:
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                text = response.read().decode()
                # every piece arrived (a cut stream ends with an error event, and may still end with [DONE])
                complete = response.status_code == 200 and text.count(TOKEN) == self.tokens and '"error"' not in text
                return Outcome(started, time.monotonic(), response.headers.get(WORKER), response.status_code, complete, text[-200:])
        except httpx.HTTPError as error:
            return Outcome(started, time.monotonic(), None, None, False, f"{type(error).__name__}: {error}")


@pytest.fixture()
def owned(tmp_path: Path, tiny_model_dir: Path) -> Iterator[tuple[ServerProcess, Path, dict[str, Any]]]:
    """A gateway with 2 workers that launched a FAKE engine (50 ms a piece)."""
    engine = {"model_path": str(tiny_model_dir), "device": "cpu", "python": str(fake_engine_python(tmp_path)), "env": {"FAKE_ENGINE_TOKEN_S": "0.05"}}
    config = {
        "gateway": {"workers": 2, "api_keys": [KEY], "admin_keys": [ADMIN], "shutdown_grace_s": 10,
                    "health_timeout_s": 1, "watchdog": {"interval_s": 0.5, "backoff_initial_s": 0.2, "unhealthy_after": 2}},
        "models": {"tiny": {"engine": engine}},
    }  # fmt: skip
    with leaves_nothing(shm=False) as check:  # a FAKE engine maps no /dev/shm
        server = serve(config, tmp_path)
        check.watch(server.pid)
        check.watch(engine_pid(server))
        runtime_dir = _runtime_dir_of(server)
        try:
            yield server, tmp_path / "deploy.yaml", config
        finally:
            assert server.stop(signal.SIGTERM, grace_s=30) == 0, server.log(3000)  # graceful: exit 0
    assert not runtime_dir.exists(), f"{runtime_dir} (sockets, metrics) was left behind"


def _runtime_dir_of(server: ServerProcess) -> Path:
    """The control process's private directory (where uvicorn says it serves the admin socket)."""
    for line in server.log().splitlines():
        if "admin.sock" in line:
            return Path(line.split("unix socket ", 1)[1].split(" ", 1)[0]).parent
    raise AssertionError("the control process never said where its admin socket is")


def engine_pid(server: ServerProcess) -> int:
    return admin(server, "/admin/models")["models"][0]["replicas"][0]["engine"]["pid"]


def wait_engine_replaced(server: ServerProcess, old_pid: int, timeout_s: float, what: str = "not restarted") -> None:
    """Until the model is ready on an engine other than ``old_pid`` (restarted or swapped)."""
    wait_until(
        lambda: admin(server, "/admin/models")["models"][0]["state"] == "ready" and engine_pid(server) != old_pid,
        lambda: f"{what}: {admin(server, '/admin/models')['models'][0]}\n{server.log(3000)}", timeout_s, every_s=0.2,
    )  # fmt: skip


def test_a_sighup_swap_under_load_on_both_workers_fails_no_request(owned: tuple[ServerProcess, Path, dict[str, Any]]) -> None:
    server, path, config = owned
    old_pid = engine_pid(server)
    with Load(server.url, workers=4) as load:
        time.sleep(2.0)
        config["models"]["tiny"]["engine"]["env"]["FAKE_ENGINE_SWAPPED"] = "1"  # an engine change: blue-green
        path.write_text(yaml.safe_dump(config))
        swapped = time.monotonic()
        os.kill(server.pid, signal.SIGHUP)  # a reload, as an operator sends it to the control process
        wait_engine_replaced(server, old_pid, swapped + 60 - time.monotonic(), "no swap after SIGHUP")
        time.sleep(3.5)
    assert admin(server, "/admin/models")["last_reload"]["ok"]
    assert not _pid_alive(old_pid), "the old engine still runs after the swap"
    outcomes = load.outcomes
    failed = [o for o in outcomes if not o.complete]
    assert not failed, failed[:5]
    across = [o for o in outcomes if o.started < swapped < o.ended]
    assert across and {o.worker for o in outcomes} == {"0", "1"}, (len(across), {o.worker for o in outcomes})


def _poisoned_through_one_worker(server: ServerProcess, content: str) -> tuple[dict[str, httpx.Response], str]:
    """Send a request that takes the engine down (``content``: CRASH or FREEZE) through one worker, wait until the
    watchdog brought a new engine, then send it again through each worker: (answers by worker, the first one's)."""
    old_pid = engine_pid(server)
    poison = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    with fresh(server.url) as client:
        first = client.post("/v1/chat/completions", json=poison, timeout=60)
        assert first.status_code in (502, 503), first.text  # the engine died (or was stopped, frozen) under it
        wait_engine_replaced(server, old_pid, 60)
        return until_each_worker(server.url, lambda c: c.post("/v1/chat/completions", json=poison)), first.headers[WORKER]


def test_a_request_that_crashed_the_engine_through_one_worker_is_refused_by_the_other(
    owned: tuple[ServerProcess, Path, dict[str, Any]],
) -> None:
    server, _, _ = owned
    refused, crashed_on = _poisoned_through_one_worker(server, CRASH)
    other = refused["1" if crashed_on == "0" else "0"]
    assert other.status_code == 400 and other.json()["error"]["code"] == "request_quarantined", other.text
    assert refused[crashed_on].status_code == 400
    assert admin(server, "/admin/models")["models"][0]["restarts"] == 1  # one crash only


def test_a_request_that_froze_the_engine_through_one_worker_is_refused_by_the_other(
    owned: tuple[ServerProcess, Path, dict[str, Any]],
) -> None:
    # The engine freezes under a request held by a worker, not by the control process that runs the watchdog:
    # the control asks the workers what they have upstream on it, and quarantines that.
    server, _, _ = owned
    refused, froze_on = _poisoned_through_one_worker(server, FREEZE)
    other = refused["1" if froze_on == "0" else "0"]
    assert other.status_code == 400 and other.json()["error"]["code"] == "request_quarantined", other.text
    assert "froze" in server.log() and "request shape(s) are now refused" in server.log()


def test_a_killed_worker_comes_back_while_the_other_serves(owned: tuple[ServerProcess, Path, dict[str, Any]]) -> None:
    server, _, _ = owned
    workers = {w["index"]: w for w in admin(server, "/admin/workers")["workers"]}
    victim = workers[0]["pid"]
    with Load(server.url, workers=4) as load:
        time.sleep(1.5)
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        time.sleep(2.5)
    # Streams on the other worker were untouched, and every request sent after the kill succeeded.
    survivors = [o for o in load.outcomes if o.worker == "1" or o.started > killed + 0.5]
    assert survivors and all(o.complete for o in survivors), [o for o in survivors if not o.complete][:5]
    back = wait_until(
        lambda: (worker := admin(server, "/admin/workers")["workers"][0])["connected"] and worker["pid"] != victim and worker,
        lambda: f"worker 0 not back: {admin(server, '/admin/workers')['workers'][0]}", 60, every_s=0.2,
    )  # fmt: skip
    assert back["restarts"] == 1 and back["running"]
    body = {"model": "tiny", "messages": PROMPT, "max_tokens": 2}
    answers = until_each_worker(server.url, lambda client: client.post("/v1/chat/completions", json=body))
    assert {r.status_code for r in answers.values()} == {200}
    assert "worker 0 (pid" in server.log() and "exited with code -9" in server.log()


def _pid_alive(pid: int) -> bool:
    fields = stat_fields(pid)  # None once it is gone; a zombie has exited too
    return fields is not None and fields[0] != "Z"  # (launch.procgroup.pid_alive counts zombies as alive)

