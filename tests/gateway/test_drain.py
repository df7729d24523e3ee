"""SIGTERM with ``gateway.shutdown_delay_s``, in one process: the server's own signal handling, step by step.

The gateway's server (``gateway.server.GatewayServer``) runs in a thread here and its signal handler is called as
the signal would call it. On SIGTERM it drains: ``/ready`` answers 503 ``draining``, every other route still
answers, and each response closes its connection; it stops at the end of the delay, or at once on a second
SIGTERM. Ctrl-C (SIGINT) and a delay of 0 stop at once, as before the setting. No upstream is needed: the model's
URL is never called. The rolling restart behind a real load balancer is tests/gateway/test_rolling_restart.py.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from gateway.app import create_app
from gateway.config import gateway_settings
from gateway.core.registry import build_registry
from gateway.server import GatewayServer, uvicorn_config
from launch.config import parse_config
from launch.ports import pick_free_port
from tests.gateway_server import KEY
from tests.waiting import wait_until


@contextmanager
def running(delay_s: float) -> Iterator[tuple[GatewayServer, threading.Thread, str]]:
    deployment = parse_config({"models": {"m": {"url": "http://127.0.0.1:9"}}, "gateway": {"api_keys": [KEY], "shutdown_delay_s": delay_s}})
    settings = gateway_settings(deployment).model_copy(update={"port": pick_free_port(), "host": "127.0.0.1"})
    app = create_app(settings, build_registry(deployment, settings))
    server = GatewayServer(uvicorn_config(app, settings, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)  # not the main thread: uvicorn installs no handler
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), "the server to start", 30)
    assert server.started
    try:
        yield server, thread, f"http://127.0.0.1:{settings.port}"
    finally:
        server.should_exit = True
        thread.join(30)


def test_sigterm_drains_until_a_second_sigterm() -> None:
    with running(600) as (server, thread, url), httpx.Client(base_url=url, timeout=10) as client:
        before = client.get("/health")
        assert before.status_code == 200 and before.headers.get("connection") != "close"
        server.handle_exit(signal.SIGTERM, None)
        state = server.config.app.state.gateway
        assert state.draining
        ready = client.get("/ready")
        assert ready.status_code == 503 and ready.json()["status"] == "draining", ready.text
        assert ready.json()["error"]["code"] == "draining"
        assert ready.headers["connection"] == "close"
        served = client.get("/health")  # still served, on a new connection, which closes after it too
        assert served.status_code == 200 and served.headers["connection"] == "close"
        models = client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        assert models.status_code == 200 and models.headers["connection"] == "close"
        assert thread.is_alive() and not server.should_exit
        server.handle_exit(signal.SIGTERM, None)  # ends the delay at once
        thread.join(30)
        assert not thread.is_alive()


def test_the_delay_ends_by_itself() -> None:
    with running(0.3) as (server, thread, url):
        server.handle_exit(signal.SIGTERM, None)
        assert server.config.app.state.gateway.draining
        wait_until(lambda: not thread.is_alive(), "the server to stop at the end of shutdown_delay_s", 30)


def test_ctrl_c_and_a_zero_delay_stop_at_once() -> None:
    for delay_s, sig in ((600, signal.SIGINT), (0, signal.SIGTERM)):
        with running(delay_s) as (server, thread, _):
            server.handle_exit(sig, None)
            assert server.should_exit and not server.config.app.state.gateway.draining
            thread.join(30)
            assert not thread.is_alive()
