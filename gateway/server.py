"""Owns uvicorn: build the app from a YAML file and serve it until SIGTERM / Ctrl-C.

On SIGTERM the gateway first drains for ``gateway.shutdown_delay_s`` (when above 0): ``/ready`` answers 503
``draining`` and every response closes its connection, while every request is still served, so that a load balancer
(or Kubernetes' endpoints) stops sending new ones before the port closes. Then, as at once on Ctrl-C, uvicorn stops
accepting connections, lets in-flight requests (streams included) finish for up to ``gateway.shutdown_grace_s``,
and the app's lifespan stops the engines it started. A second SIGTERM while draining ends the delay at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

import uvicorn
from fastapi import FastAPI
from loguru import logger
from prometheus_client import values as prometheus_values
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from gateway import gc_freeze
from gateway.app import app_from_config
from gateway.config import GatewaySettings, gateway_settings
from gateway.control.controller import StartAborted
from gateway.control.workers import ADMIN_SOCKET, METRICS_DIR, WorkerPlan
from gateway.core.endpoints import listening_note
from gateway.edge.connection import guarded_protocol
from gateway.edge.forwarded import ForwardedHeaders
from gateway.edge.listener import ManyAcceptServer, bind_unix_socket
from launch.config import ConfigError, load_config
from launch.ports import pick_free_port, port_is_free


class GatewayConfig(uvicorn.Config):
    """uvicorn's settings, with its proxy-headers middleware asked only of a request that carries such a header
    (:class:`ForwardedHeaders`; which proxies are trusted is uvicorn's ``forwarded_allow_ips``, as before)."""

    def load(self) -> None:
        super().load()
        if type(self.loaded_app) is ProxyHeadersMiddleware:
            self.loaded_app.__class__ = ForwardedHeaders  # (a subclass adding nothing but its __call__)


def uvicorn_config(app: FastAPI, settings: GatewaySettings, *, log_level: str = "info", uds: str | None = None) -> uvicorn.Config:
    """The uvicorn settings the gateway runs with (also used by tests that serve on a real socket); ``uds``: serve
    on that Unix socket instead of the host and port (the control process of worker processes)."""
    return GatewayConfig(
        app,
        host=settings.host,
        port=settings.port,
        uds=uds,
        lifespan="on",
        access_log=False,  # the gateway writes its own line per request
        log_level=log_level,
        # Seconds as given: uvicorn hands the value to asyncio.wait_for (a float works; 0 means no grace at all).
        timeout_graceful_shutdown=settings.shutdown_grace_s,  # type: ignore[arg-type]
        timeout_keep_alive=max(1, round(settings.http.keepalive_timeout_s)),
        loop="auto",  # uvloop when installed
        # httptools with header/connection limits and timeouts; connections close after each response while draining
        http=guarded_protocol(settings.http, getattr(app.state, "gateway", None)),
    )


FDS_PER_CONNECTION = 3  # a client connection, its upstream connection, the duplicate used for TCP_QUICKACK
_FDS_SPARE = 256  # log files, engines' pipes, the listening socket, health probes


def raise_open_file_limit(max_connections: int, *, explicit: bool = True) -> int:
    """Raise this process's soft open-file limit to its hard limit; warn when ``max_connections`` streams would
    not fit and the setting was ``explicit`` (the default is capped instead: :func:`with_open_file_budget`).
    Returns the soft limit now in force (0 where the platform has none)."""
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
    if explicit and soft != resource.RLIM_INFINITY and soft < needed:
        logger.warning(
            "gateway: open-file limit {} is below the {} that http.max_connections={} streams need; raise it (ulimit -n) or lower the setting",
            soft, needed, max_connections,
        )  # fmt: skip
    return soft


def with_open_file_budget(settings: GatewaySettings) -> GatewaySettings:
    """Raise the open-file limit (:func:`raise_open_file_limit`); when ``http.max_connections`` is the default and
    the limit fits fewer streams, serve that many (logged, not warned: nothing is misconfigured), so that past it a
    new connection gets 503 ``too_many_connections`` instead of the process running out of descriptors."""
    explicit = "max_connections" in settings.http.model_fields_set
    soft = raise_open_file_limit(settings.http.max_connections, explicit=explicit)
    fits = (soft - _FDS_SPARE) // FDS_PER_CONNECTION
    if explicit or soft <= 0 or fits >= settings.http.max_connections:
        return settings
    fits = max(fits, 1)
    logger.info("gateway: the open-file limit {} fits {} client connections (http.max_connections default {})", soft, fits, settings.http.max_connections)
    return settings.model_copy(update={"http": settings.http.model_copy(update={"max_connections": fits})})


def _note_signal(signum: int, frame: object) -> None:
    logger.info("gateway: stopped by {}", signal.Signals(signum).name)


class GatewayServer(ManyAcceptServer):
    """uvicorn's server, accepting every waiting connection per pass of the loop (:class:`ManyAcceptServer`), plus:
    a stop signal during engine start-up stops the engines at once; ``on_started`` is called once it accepts
    connections; SIGTERM once started drains for ``gateway.shutdown_delay_s`` first (the
    app's state says ``draining``: ``/ready`` 503, connections closed after each response), then stops as uvicorn does.
    """

    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self.on_started = on_started
        self.exit_watch: threading.Timer | None = None  # the process's own server (serve_app): see shutdown
        self.drain_until: float | None = None  # monotonic time at which a SIGTERM's drain ends and the stop begins
        self._drain_noted = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            gc_freeze.settle()  # start-up's objects out of the collector's passes (gateway.gc_freeze)
            if self.on_started is not None:
                self.on_started()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's, then, in the process's own server, :data:`EXIT_WAIT_S` for the process to end: the loop's end
        waits for every thread of its default executor, and one blocked on a server that never answers (a database
        call no deadline of the gateway's covers) would hold the exit forever."""
        await super().shutdown(sockets)
        if self.exit_watch is not None:
            self.exit_watch.start()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        app_state = getattr(self.config.app, "state", None)
        controller = getattr(app_state, "controller", None)
        if controller is not None and not self.started:
            controller.abort_start()
        state = getattr(app_state, "gateway", None)
        if sig == signal.SIGTERM and self.started and not self.should_exit and state is not None:
            delay_s = state.settings.shutdown_delay_s
            # A worker process told to drain by its control process (which got the SIGTERM) stops at its SIGTERM.
            if self.drain_until is None and delay_s > 0 and not state.draining:
                self._captured_signals.append(sig)  # re-raised once stopped, as uvicorn does with the ones it handles
                self.drain_until = time.monotonic() + delay_s
                state.draining = True  # logged by on_tick: no logging inside a signal handler (its lock may be held)
                self.wake()
                return
        super().handle_exit(sig, frame)

    def next_tick_s(self) -> float:
        """A drain ends on time: the tick after a SIGTERM comes at its end, not up to a second past it."""
        tick_s = super().next_tick_s()
        if self.drain_until is not None and not self.should_exit:
            return min(tick_s, self.drain_until - time.monotonic())
        return tick_s

    async def on_tick(self, counter: int) -> bool:
        if self.drain_until is not None and not self._drain_noted:
            self._drain_noted = True
            logger.info("gateway: SIGTERM: draining for gateway.shutdown_delay_s ({:g} s): /ready answers 503 while requests "
                        "are still served; then no new connections", self.config.app.state.gateway.settings.shutdown_delay_s)  # fmt: skip
        if self.drain_until is not None and not self.should_exit and time.monotonic() >= self.drain_until:
            logger.info("gateway: drained; no longer accepting connections")
            self.should_exit = True
        return await super().on_tick(counter)


EXIT_WAIT_S = 2.0  # after the app's shutdown, how long the process may take to end before it ends without its threads


def _exit_without_blocked_threads() -> None:
    """The app has shut down (its rows written or given up) but a thread still holds the process: end it, exit 0."""
    blocked = [thread.name for thread in threading.enumerate() if thread not in (threading.current_thread(), threading.main_thread()) and not thread.daemon]
    logger.error("gateway: stopped, but threads still wait (a database or upstream that does not answer?): {}; exiting "
                 "without them", ", ".join(blocked[:8]))  # fmt: skip
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def _log_listening(server: uvicorn.Server, app: FastAPI) -> None:
    settings = app.state.gateway.settings
    bound = [sock.getsockname() for srv in server.servers for sock in (srv.sockets or ())]
    port = bound[0][1] if bound else settings.port
    logger.info("gateway: listening on {}", listening_note(settings.host, port, settings.status_page))


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
    settings = gateway_settings(deployment, host=host, port=port)
    count = settings.worker_count()
    if count == 1:
        app, settings = app_from_config(deployment, host=host, port=port, watch=watch, settings=settings)
        logger.info("gateway: serving {} model(s) from {}", len(deployment.models), config_path)
        serve_app(app, settings, verbose=verbose, source=str(config_path))
        return
    check_port_free(settings, str(config_path))
    with worker_runtime() as runtime_dir:
        port = settings.port or pick_free_port(settings.host)
        plan = WorkerPlan(count, runtime_dir, settings.host, port, verbose)
        settings = settings.model_copy(update={"port": port})
        app, settings = app_from_config(deployment, host=host, port=port, watch=watch, workers=plan, settings=settings)
        logger.info("gateway: serving {} model(s) from {} on {} worker processes", len(deployment.models), config_path, count)
        serve_app(app, settings, verbose=verbose, source=str(config_path), uds=str(runtime_dir / ADMIN_SOCKET))


def check_port_free(settings: GatewaySettings, source: str) -> None:
    if settings.port and not port_is_free(settings.host, settings.port):
        raise ConfigError(f"{source}: gateway.port: port {settings.port} on {settings.host} is already in use (or use --port)")


@contextlib.contextmanager
def worker_runtime() -> Iterator[Path]:
    """A private directory for the control process and its workers (sockets, summed metrics), removed at the end.

    Prometheus' multiprocess mode is switched on here, before the app's metrics exist: the workers inherit
    ``PROMETHEUS_MULTIPROC_DIR``; this process's own series go to the same directory.
    """
    runtime_dir = Path(tempfile.mkdtemp(prefix="sglang-gateway-workers-"))  # 0700
    metrics_dir = runtime_dir / METRICS_DIR
    metrics_dir.mkdir()
    before_env, before_class = os.environ.get("PROMETHEUS_MULTIPROC_DIR"), prometheus_values.ValueClass
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    prometheus_values.ValueClass = prometheus_values.MultiProcessValue()
    try:
        yield runtime_dir
    finally:
        prometheus_values.ValueClass = before_class
        if before_env is None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = before_env
        shutil.rmtree(runtime_dir, ignore_errors=True)


def serve_app(
    app: FastAPI, settings: GatewaySettings, *, verbose: bool = False, source: str = "gateway", uds: str | None = None
) -> None:
    """Run ``app`` under uvicorn until SIGTERM / Ctrl-C (graceful, exit 0); SIGHUP asks for a reload. With ``uds``,
    uvicorn serves on that socket (the control process: its workers hold the port), bound before the engines start."""
    if uds is None:
        check_port_free(settings, source)
    settings = with_open_file_budget(settings)
    server = GatewayServer(uvicorn_config(app, settings, log_level="debug" if verbose else "info", uds=uds))
    server.exit_watch = threading.Timer(EXIT_WAIT_S, _exit_without_blocked_threads)
    server.exit_watch.daemon = True
    if uds is None:  # the control process of workers has no port: its supervisor says where they listen
        server.on_started = lambda: _log_listening(server, app)
    listening: list[socket.socket] | None = None
    if uds is not None:  # bound before the lifespan, which starts the workers (bind_unix_socket); logged: uvicorn names no socket it is handed
        listening = [bind_unix_socket(uds, server.config.backlog)]
        logger.info("gateway: the control process serves its workers' admin requests on unix socket {} (owner only)", uds)
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
        if uds is None:
            logger.info("gateway: will listen on http://{}:{} once the engines are ready", settings.host, settings.port)
        server.run(sockets=listening)
    except SystemExit:  # uvicorn exits 3 when the lifespan (engine start-up) failed
        if app.state.startup_error is None:
            raise
    finally:
        server.exit_watch.cancel()
        for sock in listening or ():
            sock.close()
        logging.getLogger("uvicorn.error").removeFilter(hide)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    error = app.state.startup_error
    if error is not None and not isinstance(error, StartAborted):
        raise error
