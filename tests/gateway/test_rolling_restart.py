"""A rolling restart of the gateway behind a load balancer fails no request (``gateway.shutdown_delay_s``).

Two gateways, each ``sglang-gateway serve`` of the same YAML as a user runs it (a ``url:`` model on the FAKE engine,
tests/fake_engine.py), behind a real HAProxy (tests/haproxy.py: round robin, each server's ``/ready`` checked every
100 ms, no retry elsewhere). Under steady load (a few clients on keep-alive connections, plain and streamed chat
requests), A is restarted (SIGTERM, its exit awaited, started again, until HAProxy has it up), then B: no request
fails, and both served before and after. On SIGTERM each gateway answers ``/ready`` 503 ``draining`` while it still
serves everything for ``shutdown_delay_s``, then stops accepting and lets its requests (streams included) finish.

The control: with ``shutdown_delay_s: 0`` (stop accepting at once, the behaviour without the setting) the same
restart loses requests: those HAProxy still sends in the moment before its next check sees the port closed. The
loss is a matter of timing, so the control restarts until a request was lost (a few restarts at most).

Worker processes (``gateway.workers: 2``): SIGTERM to the control process alone (as Kubernetes sends it to the
container's first process) makes both workers answer ``/ready`` 503 ``draining`` on the public port while they serve
requests (closing each connection after its response); a second SIGTERM ends the delay, and the gateway exits 0.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from launch.ports import pick_free_port
from tests.fake_engine import TOKEN, running_fake_engine
from tests.gateway_server import KEY, auth
from tests.haproxy import HAProxy, haproxy_missing
from tests.load import ThreadedLoad
from tests.postgres import PostgresServer, own_postgres
from tests.servers import CLI, ServerProcess
from tests.waiting import wait_until

PROMPT = [{"role": "user", "content": "Say something."}]
PLAIN_TOKENS, STREAM_TOKENS = 4, 75  # 20 ms a piece on the fake: a stream lasts ~1.5 s, longer than the delay
needs_haproxy = pytest.mark.skipif(haproxy_missing() is not None, reason=haproxy_missing() or "")
DELAY_S = 1.0  # shutdown_delay_s: 10 of HAProxy's health checks; streams begun before it ends outlast it


@dataclass
class Outcome:
    started: float
    ended: float
    stream: bool
    status: int | None
    complete: bool  # a 200 with every piece of the answer
    detail: str = ""


@dataclass
class Load(ThreadedLoad[Outcome]):
    """Chat requests through the balancer on each client's keep-alive connection, one in eight of them streamed."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._sent = itertools.count()

    def client(self) -> AbstractContextManager[Any]:
        return httpx.Client(base_url=self.base_url, headers=auth(KEY), timeout=60)

    def pause(self, outcome: Outcome) -> float:
        return 0.02

    def one(self, client: httpx.Client, stream: bool) -> Outcome:
        started = time.monotonic()
        stream = next(self._sent) % 8 == 0  # plain requests keep the rate up, streams outlast the delay
        tokens = STREAM_TOKENS if stream else PLAIN_TOKENS
        body = {"model": "m", "messages": PROMPT, "max_tokens": tokens, "stream": stream}
        try:
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                text = response.read().decode()
                complete = response.status_code == 200 and text.count(TOKEN) == tokens and '"error"' not in text
                return Outcome(started, time.monotonic(), stream, response.status_code, complete, text[-200:])
        except httpx.HTTPError as error:
            return Outcome(started, time.monotonic(), stream, None, False, f"{type(error).__name__}: {error}")


class Replica:
    """One gateway replica on a fixed port (so the balancer finds it again after a restart), with a state
    directory of its own (as a pod has)."""

    def __init__(self, name: str, config: Path, directory: Path) -> None:
        self.name, self.config, self.directory = name, config, directory
        self.port = pick_free_port()
        self.starts = 0
        self.server: ServerProcess | None = None

    def start(self) -> ServerProcess:
        self.starts += 1
        env = {**os.environ, "XDG_STATE_HOME": str(self.directory / f"state-{self.name}")}
        log = self.directory / f"gateway-{self.name}-{self.starts}.log"
        self.server = ServerProcess([*CLI, "serve", str(self.config), "--port", str(self.port)], log_path=log, env=env, port=self.port)
        self.server.wait_http("/ready", timeout_s=120)
        return self.server

    def sigterm_and_wait(self) -> int:
        """SIGTERM to the gateway process alone (what Kubernetes sends), and its exit code once it exited."""
        server = self.server
        assert server is not None
        server.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: server.proc.poll() is not None, lambda: f"{self.name} still runs after SIGTERM:\n{server.log(3000)}", 60)
        return server.proc.returncode

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(grace_s=30)


@pytest.fixture()
def fake_url(tmp_path: Path) -> Iterator[str]:
    with running_fake_engine(tmp_path / "engine", "m", env={"FAKE_ENGINE_TOKEN_S": "0.02"}) as url:
        yield url


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    yield from own_postgres()


def _config(tmp_path: Path, fake_url: str, **gateway: Any) -> Path:
    config = {
        "models": {"m": {"url": fake_url}},
        "gateway": {"workers": 1, "api_keys": [KEY], "shutdown_grace_s": 20, "health_timeout_s": 2, **gateway},
    }
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _rolling_restarts(tmp_path: Path, config: Path, rounds: list[str], until_lost: bool = False) -> tuple[Load, dict[str, Any]]:
    """Two replicas behind HAProxy under load; restart the replicas named by ``rounds`` in turn (each: SIGTERM, exit,
    start, until HAProxy has it up again). ``until_lost``: stop after the first round that lost a request. The load
    and notes: each replica's exit codes, when each SIGTERM was sent, the rounds done, requests HAProxy sent each."""
    replicas = {name: Replica(name, config, tmp_path) for name in ("a", "b")}
    notes: dict[str, Any] = {"exit_codes": [], "rounds": 0, "sigterms": []}
    with ExitStack() as stack:
        for replica in replicas.values():
            stack.callback(replica.stop)
            replica.start()
        balancer = HAProxy({name: r.port for name, r in replicas.items()}, tmp_path / "haproxy")
        stack.callback(balancer.stop)
        wait_until(lambda: all(balancer.status(name) == "UP" for name in replicas), lambda: f"HAProxy: {balancer.stats()}", 30)
        load = Load(balancer.url, workers=8)
        with load:
            wait_until(lambda: len(load.outcomes) >= 10, "some requests before the first restart", 30)
            for name in rounds:
                replica = replicas[name]
                notes["sigterms"].append(time.monotonic())
                notes["exit_codes"].append(replica.sigterm_and_wait())
                replica.start()
                wait_until(lambda: balancer.status(name) == "UP", lambda: f"HAProxy never had {name} up again: {balancer.stats()}", 30)  # noqa: B023
                seen = len(load.outcomes)
                wait_until(lambda: len(load.outcomes) >= seen + 10, "requests after the restart", 30)  # noqa: B023
                notes["rounds"] += 1
                if until_lost and any(not o.complete for o in load.outcomes):
                    break
        notes["served"] = {name: int(row["stot"]) for name, row in balancer.stats().items()}
        return load, notes


@needs_haproxy
def test_a_rolling_restart_behind_a_load_balancer_fails_no_request(tmp_path: Path, fake_url: str, postgres: PostgresServer) -> None:
    """The two replicas share their state (``gateway.replicas.shared``, one PostgreSQL), as the Kubernetes recipe runs them."""
    shared = {"replicas": {"shared": True, "sync_interval_s": 0.1}, "usage": {"database_url": postgres.url}}
    config = _config(tmp_path, fake_url, shutdown_delay_s=DELAY_S, **shared)
    load, notes = _rolling_restarts(tmp_path, config, ["a", "b"])
    failed = [o for o in load.outcomes if not o.complete]
    assert not failed, (len(failed), len(load.outcomes), failed[:5])
    assert notes["exit_codes"] == [0, 0]  # graceful
    streams = [o for o in load.outcomes if o.stream]
    assert streams and len(streams) < len(load.outcomes)  # plain and streamed requests both
    across = [o for o in streams for sigterm in notes["sigterms"] if o.started < sigterm < o.ended]
    assert across, "no stream was in flight at a SIGTERM"  # each of them finished whole
    assert all(count > 0 for count in notes["served"].values()), notes  # HAProxy sent requests to both


@needs_haproxy
def test_the_control_without_a_delay_the_same_restart_loses_requests(tmp_path: Path, fake_url: str) -> None:
    """What the test above guards against: stopping to accept at SIGTERM, before the balancer knows."""
    config = _config(tmp_path, fake_url, shutdown_delay_s=0)
    load, notes = _rolling_restarts(tmp_path, config, ["a", "b", "a", "b", "a", "b"], until_lost=True)
    failed = [o for o in load.outcomes if not o.complete]
    assert failed, f"{notes['rounds']} restarts without a delay lost no request of {len(load.outcomes)}: the test above proves nothing"
    assert all(o.status in (None, 502, 503) for o in failed), failed[:5]  # refused or cut: the balancer's errors


def test_worker_processes_drain_together_on_the_control_process_sigterm(tmp_path: Path, fake_url: str) -> None:
    config = _config(tmp_path, fake_url, workers=2, shutdown_delay_s=600)  # ended by a second SIGTERM, not by time
    server = ServerProcess([*CLI, "serve", str(config), "--port", "{port}"], log_path=tmp_path / "gateway.log")
    try:
        server.wait_log(r"2 worker processes listening", timeout_s=120)
        server.wait_http("/ready", timeout_s=60)
        os.kill(server.pid, signal.SIGTERM)  # the control process alone
        fresh = httpx.Limits(max_keepalive_connections=0)  # a connection per request: the kernel spreads them
        with httpx.Client(base_url=server.url, headers=auth(KEY), timeout=30, limits=fresh) as client:
            draining: set[str] = set()

            def both_drain() -> bool:
                answer = client.get("/ready")
                if answer.status_code == 503 and answer.json()["status"] == "draining":
                    draining.add(answer.headers["x-gateway-worker"])
                return len(draining) == 2

            wait_until(both_drain, lambda: f"workers draining: {draining}\n{server.log(3000)}", 30)
            served = [client.post("/v1/chat/completions", json={"model": "m", "messages": PROMPT, "max_tokens": 2}) for _ in range(6)]
            assert {r.status_code for r in served} == {200}, [r.text for r in served]
            assert {r.headers["connection"] for r in served} == {"close"}
            assert len({r.headers["x-gateway-worker"] for r in served}) >= 1
        os.kill(server.pid, signal.SIGTERM)  # ends the delay: stop accepting, let requests finish, exit
        assert server.proc.wait(60) == 0, server.log(3000)
    finally:
        server.stop(grace_s=30)
