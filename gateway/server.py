"""Owns uvicorn: build the app from a YAML file and serve it until SIGTERM / Ctrl-C.

On SIGTERM or Ctrl-C uvicorn stops accepting connections, lets in-flight requests (streams included)
finish for up to ``gateway.shutdown_grace_s``, then the app's lifespan stops the engines it started.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from types import FrameType

import uvicorn
from fastapi import FastAPI
from loguru import logger

from gateway.app import app_from_config
from gateway.config import GatewaySettings
from gateway.control.controller import StartAborted
from gateway.edge.connection import guarded_protocol
from launch.config import ConfigError, load_config
from launch.ports import port_is_free


def uvicorn_config(app: FastAPI, settings: GatewaySettings, *, log_level: str = "info") -> uvicorn.Config:
    """The uvicorn settings the gateway runs with (also used by tests that serve on a real socket)."""
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        lifespan="on",
        access_log=False,  # the gateway writes its own line per request
        log_level=log_level,
        # Seconds as given: uvicorn hands the value to asyncio.wait_for (a float works; 0 means no grace at all).
        timeout_graceful_shutdown=settings.shutdown_grace_s,  # type: ignore[arg-type]
        timeout_keep_alive=max(1, round(settings.http.keepalive_timeout_s)),
        loop="auto",  # uvloop when installed
        http=guarded_protocol(settings.http),  # httptools with header/connection limits and timeouts
    )


FDS_PER_CONNECTION = 3  # a client connection, its upstream connection, the duplicate used for TCP_QUICKACK
_FDS_SPARE = 256  # log files, engines' pipes, the listening socket, health probes


def raise_open_file_limit(max_connections: int) -> int:
    """Raise this process's soft open-file limit to its hard limit; warn when ``max_connections`` streams would
    not fit. Returns the soft limit now in force (0 where the platform has none)."""
    try:
        import resource
    except ImportError:  # not on this platform
        return 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as error:
            logger.warning("gateway: cannot raise the open-file limit from {} to {}: {}", soft, target, error)
    needed = max_connections * FDS_PER_CONNECTION + _FDS_SPARE
    if soft != resource.RLIM_INFINITY and soft < needed:
        logger.warning(
            "gateway: open-file limit {} is below the {} that http.max_connections={} streams need; raise it (ulimit -n) or lower the setting",
            soft, needed, max_connections,
        )  # fmt: skip
    return soft


def _note_signal(signum: int, frame: object) -> None:
    logger.info("gateway: stopped by {}", signal.Signals(signum).name)


class _Server(uvicorn.Server):
    """uvicorn's server, plus: a stop signal during engine start-up stops the engines at once."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        controller = getattr(getattr(self.config.app, "state", None), "controller", None)
        if controller is not None and not self.started:
            controller.abort_start()
        super().handle_exit(sig, frame)


class _HideStartupTraceback(logging.Filter):
    """A failed engine start is reported once, as one clear error, not as uvicorn's lifespan traceback."""

    def __init__(self, app: FastAPI) -> None:
        super().__init__()
        self.app = app

    def filter(self, record: logging.LogRecord) -> bool:
        return self.app.state.startup_error is None


def run(
    config_path: str | Path, host: str | None = None, port: int | None = None, *, verbose: bool = False, watch: bool = False
) -> None:
    """Serve the deployment in ``config_path``; raises ConfigError / PreflightError / EngineError.

    SIGHUP reloads the file (as ``POST /admin/reload`` does); ``watch`` also reloads when it changes.
    """
    deployment = load_config(config_path)
    app, settings = app_from_config(deployment, host=host, port=port, watch=watch)
    logger.info("gateway: serving {} model(s) from {}", len(deployment.models), config_path)
    serve_app(app, settings, verbose=verbose, source=str(config_path))


def serve_app(app: FastAPI, settings: GatewaySettings, *, verbose: bool = False, source: str = "gateway") -> None:
    """Run ``app`` under uvicorn until SIGTERM / Ctrl-C (graceful, exit 0); SIGHUP asks for a reload."""
    if settings.port and not port_is_free(settings.host, settings.port):
        raise ConfigError(f"{source}: gateway.port: port {settings.port} on {settings.host} is already in use (or use --port)")
    raise_open_file_limit(settings.http.max_connections)
    server = _Server(uvicorn_config(app, settings, log_level="debug" if verbose else "info"))
    hide = _HideStartupTraceback(app)
    logging.getLogger("uvicorn.error").addFilter(hide)
    # uvicorn re-raises the signal that stopped it once it has shut down; with these handlers in
    # place that ends here, so a graceful SIGTERM / Ctrl-C exits 0 instead of dying by the signal.
    in_main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, _note_signal) for sig in (signal.SIGTERM, signal.SIGINT)} if in_main else {}
    if in_main:
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, lambda *_: app.state.controller.request_reload("SIGHUP"))
    try:
        # uvicorn binds the port after the lifespan has started the engines: until then connections are refused
        logger.info("gateway: will listen on http://{}:{} once the engines are ready", settings.host, settings.port)
        server.run()
    except SystemExit:  # uvicorn exits 3 when the lifespan (engine start-up) failed
        if app.state.startup_error is None:
            raise
    finally:
        logging.getLogger("uvicorn.error").removeFilter(hide)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    error = app.state.startup_error
    if error is not None and not isinstance(error, StartAborted):
        raise error
