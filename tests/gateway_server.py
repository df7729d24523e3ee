"""A gateway app under a real uvicorn in a background thread, built from ``models`` / ``gateway`` mappings: the
in-process gateway of every test folder (``serve``), and the client key and header its tests send."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

from gateway.app import create_app
from gateway.config import GatewaySettings, gateway_settings
from gateway.core.registry import build_registry
from gateway.edge.listener import ManyAcceptServer
from gateway.server import uvicorn_config
from launch.config import parse_config
from launch.ports import pick_free_port
from launch.process import EngineProcess
from tests.waiting import wait_until

KEY = "test-key-1"


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class GatewayServer:
    """A gateway app served by uvicorn on a free localhost port, in a thread, through the gateway's listener
    (:class:`ManyAcceptServer`: the serve command's, without its signal handling and heap freeze)."""

    def __init__(self, app: FastAPI, settings: GatewaySettings) -> None:
        self.app = app
        self.port = pick_free_port()
        self.settings = settings.model_copy(update={"port": self.port, "host": "127.0.0.1"})
        self.server: uvicorn.Server = ManyAcceptServer(uvicorn_config(app, self.settings, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name=f"gateway-{self.port}", daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> GatewayServer:
        self.thread.start()

        def failure() -> str:
            return f"gateway did not start (startup error: {self.app.state.startup_error!r})"

        def started() -> bool:
            if not self.thread.is_alive():
                raise RuntimeError(failure())
            return self.server.started

        wait_until(started, failure, timeout_s)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)

    @property
    def state(self) -> Any:
        return self.app.state.gateway


@contextmanager
def serve(
    models: dict[str, Any], gateway: dict[str, Any] | None = None, engines: dict[str, EngineProcess] | None = None
) -> Iterator[GatewayServer]:
    """Build a deployment from ``models``/``gateway`` mappings and serve it (engines given, not owned)."""
    deployment = parse_config({"models": models, "gateway": gateway or {}})
    settings = gateway_settings(deployment)
    app = create_app(settings, build_registry(deployment, settings, engines))
    server = GatewayServer(app, settings).start()
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def serve_engine(name: str, engine: EngineProcess) -> Iterator[GatewayServer]:
    """A gateway serving ``engine`` by URL as model ``name`` (alias ``default``), once ready: its first probe has
    learnt the engine's tool-call parser, which the guard needs before a request with tools."""
    with serve({name: {"url": engine.url, "aliases": ["default"]}}) as server:
        assert httpx.get(server.url + "/ready", timeout=60).status_code == 200
        yield server
