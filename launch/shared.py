"""One engine per engine configuration per machine, shared by every process that asks for it.

Several processes load the same model (``mlflow models serve -w N`` workers, notebooks on one driver):
on a GPU a second engine would ask for the memory the first one holds. With :func:`join` they use one.
The engine belongs to a small detached *host* process (:mod:`launch.engine_host`), and processes meet
in one private directory per configuration (:mod:`launch.engine_dir`), where each user holds a shared
lock on ``users.lock`` for as long as it uses the engine.

The host starts the engine (random API key), publishes it, restarts it if it dies while users remain,
and stops it and removes the directory once it can take ``users.lock`` exclusively (nobody left). A
user that finds the host gone starts a new one; the new host cleans up after the old engine and
reuses its port and key when it can, so the URL other users hold stays valid.

Races: starters are serialised by ``start.lock`` and a host that cannot take ``host.lock`` exits; a
user only trusts ``state.json`` while ``host.lock`` is held; a user that waited for ``users.lock``
while the host was removing the directory sees that its lock file is gone and starts over.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from loguru import logger

from launch.config import EngineConfig
from launch.engine_dir import (
    HOST_LOG,
    SPEC_FILE,
    STALE_FILE,
    START_LOCK,
    STATE_FILE,
    SharedEngineError,
    exclusive,
    hold_users_lock,
    host_alive,
    key_dir_for,
    log_tail,
    read_json,
    start_failure,
    write_private_json,
)
from launch.preflight import PreflightError
from launch.process import EngineStartCancelled, EngineStartTimeout, bearer
from launch.procgroup import pid_alive

HOST_MODULE = "launch.engine_host"
POLL_S = 0.25
HOST_START_TIMEOUT_S = 120.0  # interpreter start and imports of a fresh host on a busy machine
WAIT_MARGIN_S = 60.0  # users wait this much longer than the engine's own start-up timeout
MAX_TAKEOVERS = 3  # hosts that may die in a row while one user waits


# ------------------------------------------------------------------------------ a user's lease
class SharedEngine:
    """One process's use of a shared engine: its URL and key, kept while :meth:`close` is not called.

    Has the attributes callers read from :class:`launch.process.EngineProcess` (``url``, ``api_key``,
    ``pid``, ``port``, ``log_file``, ``running``), plus :meth:`recover` for after a failed request.
    """

    def __init__(
        self,
        name: str,
        engine: EngineConfig,
        key_dir: Path,
        users_fd: int,
        *,
        log_dir: str | Path | None,
        show_log: bool,
    ) -> None:
        self.name = name
        self.config = engine
        self.key_dir = key_dir
        self._users_fd: int | None = users_fd
        self._spec = {
            "name": name,
            "engine": engine.model_dump(mode="json"),
            "log_dir": str(log_dir) if log_dir else None,
        }
        self._show_log = show_log
        self._lock = threading.Lock()  # one recovery at a time
        self._fd_lock = threading.Lock()  # close() never waits for a recovery
        self.state: dict[str, Any] = {}
        self.started_host = False

    # ----------------------------------------------------------------- what callers read
    @property
    def url(self) -> str:
        return str(self.state.get("url", ""))

    @property
    def api_key(self) -> str | None:
        return self.state.get("api_key")

    @property
    def pid(self) -> int | None:
        return self.state.get("engine_pid")

    @property
    def host_pid(self) -> int | None:
        return self.state.get("host_pid")

    @property
    def port(self) -> int | None:
        return self.state.get("port")

    @property
    def log_file(self) -> Path | None:
        value = self.state.get("log_file")
        return Path(value) if value else None

    @property
    def generation(self) -> int:
        return int(self.state.get("generation") or 0)

    @property
    def closed(self) -> bool:
        return self._users_fd is None

    @property
    def running(self) -> bool:
        """Whether this lease is open and the engine process it last saw is alive."""
        pid = self.pid
        return not self.closed and bool(pid) and pid_alive(pid)

    def auth_headers(self) -> dict[str, str]:
        return bearer(self.api_key)

    # ----------------------------------------------------------------- life cycle
    def wait_ready(self, timeout_s: float, stop_when: Callable[[], bool] | None = None) -> None:
        """Start a host if there is none, then wait until the engine is ready (or the host gives up).

        :class:`launch.process.EngineStartCancelled` as soon as ``stop_when()`` is true (the caller gave up:
        once it closes this lease, a host with no user left stops the engine it was starting).
        """
        deadline = time.monotonic() + timeout_s
        takeovers = 0
        saw_attempt = False  # a failed state seen before any other is a dead host's leftover
        reported: tuple[Any, ...] = ()
        messages_seen = 0
        announced = False
        tail = _LogFollower() if self._show_log else None
        while True:
            alive = host_alive(self.key_dir)
            state = read_json(self.key_dir / STATE_FILE) or {}
            status = state.get("status")
            if alive and status == "ready":
                self.state = state
                if tail is not None:
                    tail.follow(state.get("log_file"), self.name)
                return
            if status == "failed" and (alive or saw_attempt):
                raise start_failure(self.name, state)
            if alive and status:
                saw_attempt = True
            if not alive:
                if takeovers >= MAX_TAKEOVERS:
                    host_log = self.key_dir / HOST_LOG
                    raise SharedEngineError(
                        f"engine {self.name!r}: the engine host exited {takeovers} times in a row",
                        log_file=host_log,
                        log_tail=log_tail(host_log),
                    )
                try:
                    started = self._ensure_host()
                except HostExitedEarly as error:  # killed as it came up: the next host takes over, as after a later death
                    logger.warning("engine {}: {}; starting another", self.name, error)
                    started = True
                if started:
                    takeovers += 1
                    saw_attempt = True
                continue
            if not self.started_host and not announced:
                logger.info(
                    "engine {}: waiting for the engine another process is starting (host pid {})",
                    self.name,
                    state.get("host_pid"),
                )
                announced = True
            if self.started_host:
                messages = state.get("messages") or []
                for message in messages[messages_seen:]:
                    logger.warning("engine {}: {}", self.name, message)
                messages_seen = len(messages)
                now = (state.get("status"), state.get("phase"))
                if now != reported and state.get("phase"):
                    logger.info("engine {}: {} ({:.0f}s)", self.name, state["phase"], state.get("phase_s") or 0.0)
                    reported = now
                if tail is not None:
                    tail.follow(state.get("log_file"), self.name)
            if stop_when is not None and stop_when():
                raise EngineStartCancelled(
                    f"engine {self.name!r}: start given up", name=self.name, returncode=None, log_tail=[], log_file=None
                )
            if time.monotonic() >= deadline:
                raise EngineStartTimeout(
                    f"engine {self.name!r} was not ready after {timeout_s:.0f}s (host pid {state.get('host_pid')}, "
                    f"last phase: {state.get('phase')})",
                    name=self.name,
                    returncode=None,
                    log_tail=log_tail(Path(state["log_file"])) if state.get("log_file") else [],
                    log_file=Path(state["log_file"]) if state.get("log_file") else None,
                )
            time.sleep(POLL_S)

    def recover(self, timeout_s: float | None = None) -> bool:
        """After a request could not reach the engine: wait until an engine answers again (the host
        restarts a dead engine; a dead host is replaced). True when the lease is usable again; False when
        it is not within the timeout or the lease was closed meanwhile. Raises :class:`launch.process.EngineError` when
        no engine can be started."""
        if self.closed:
            return False
        timeout = self.config.startup_timeout_s + WAIT_MARGIN_S if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        with self._lock:
            seen_generation = self.generation
            while True:
                state = read_json(self.key_dir / STATE_FILE) or {}
                if host_alive(self.key_dir) and state.get("status") == "ready":
                    if state.get("generation") != seen_generation or _healthy(state):
                        changed = (state.get("url"), state.get("api_key")) != (self.url, self.api_key)
                        self.state = state
                        if changed or state.get("generation") != seen_generation:
                            logger.warning(
                                "engine {}: the shared engine was restarted; using it at {}", self.name, self.url
                            )
                        return True
                elif not host_alive(self.key_dir):
                    try:
                        self.wait_ready(max(1.0, deadline - time.monotonic()), stop_when=lambda: self.closed)
                    except EngineStartCancelled:
                        return False
                    except PreflightError as error:  # the weights went away meanwhile, say: still an engine error here
                        raise SharedEngineError(f"engine {self.name!r}: {error}") from error
                    continue
                if time.monotonic() >= deadline or self.closed:
                    return False
                time.sleep(POLL_S)

    def close(self) -> None:
        """Stop using the engine (the host stops it when nobody else does). Idempotent."""
        with self._fd_lock:
            fd, self._users_fd = self._users_fd, None
        if fd is not None:
            os.close(fd)

    # ----------------------------------------------------------------- starting a host
    def _ensure_host(self) -> bool:
        """Start a host unless one is alive (checked under ``start.lock``); True if this call started it."""
        with exclusive(self.key_dir / START_LOCK):
            if host_alive(self.key_dir):
                return False
            write_private_json(self.key_dir / SPEC_FILE, self._spec)
            state = self.key_dir / STATE_FILE
            if state.exists():  # a dead host's: nobody may trust it once the new host holds host.lock
                os.replace(state, self.key_dir / STALE_FILE)
            spawn_host(self.key_dir)
            self.started_host = True
            return True


class HostExitedEarly(SharedEngineError):
    """The host process ended before it held ``host.lock`` (killed as it started, or it cannot run at all)."""


def spawn_host(key_dir: Path, timeout_s: float = HOST_START_TIMEOUT_S) -> subprocess.Popen[bytes]:
    """Start ``python -m launch.engine_host KEY_DIR`` detached (own session); return once it holds ``host.lock``."""
    log_path = key_dir / HOST_LOG
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    code_root = str(Path(__file__).resolve().parent.parent)  # the directory that holds this package
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (code_root, env.get("PYTHONPATH", "")) if p)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", HOST_MODULE, str(key_dir)],
            stdin=subprocess.DEVNULL,
            stdout=log_fd,
            stderr=log_fd,
            env=env,
            cwd=os.getcwd(),  # relative paths in the config mean what they meant to this process
            start_new_session=True,
            close_fds=True,
        )
    finally:
        os.close(log_fd)
    deadline = time.monotonic() + timeout_s
    while not host_alive(key_dir):
        if proc.poll() is not None:
            raise HostExitedEarly(
                f"the engine host exited with code {proc.returncode} before starting",
                log_file=log_path,
                log_tail=log_tail(log_path),
            )
        if time.monotonic() >= deadline:
            proc.kill()
            proc.wait()
            raise SharedEngineError(f"the engine host did not start within {timeout_s:.0f}s", log_file=log_path)
        time.sleep(0.05)
    threading.Thread(target=proc.wait, name="sglang-engine-host-reaper", daemon=True).start()
    logger.info("engine host started (pid {}) in {}", proc.pid, key_dir)
    return proc


def join(
    name: str,
    engine: EngineConfig,
    *,
    log_dir: str | Path | None = None,
    show_log: bool = False,
    timeout_s: float | None = None,
    stop_when: Callable[[], bool] | None = None,
) -> SharedEngine:
    """Use the machine's engine for ``engine`` (starting it through a new host if none runs); wait until ready.

    Raises what the host met when the engine cannot start, as ``sglang-gateway serve`` would
    (:class:`launch.preflight.PreflightError`, or a :class:`launch.process.EngineError` with the engine's log tail), and
    :class:`launch.process.EngineStartCancelled` once ``stop_when()`` is true while waiting (the lease is
    given back, so an engine nobody else waits for is stopped by its host).
    """
    key_dir = key_dir_for(name, engine)
    lease = SharedEngine(name, engine, key_dir, hold_users_lock(key_dir), log_dir=log_dir, show_log=show_log)
    try:
        lease.wait_ready(engine.startup_timeout_s + WAIT_MARGIN_S if timeout_s is None else timeout_s, stop_when)
    except BaseException:
        lease.close()
        raise
    if lease.started_host:
        logger.info("engine {}: ready at {} (shared; pid {}, log: {})", name, lease.url, lease.pid, lease.log_file)
    else:
        logger.info("engine {}: using the shared engine at {} (pid {})", name, lease.url, lease.pid)
    return lease


def _healthy(state: dict[str, Any]) -> bool:
    try:
        return httpx.get(f"{state.get('url')}/health", timeout=2.0, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


class _LogFollower:
    """Prints the engine log's new lines (``show_engine_log``) while a user waits for the engine."""

    def __init__(self) -> None:
        self._path: str | None = None
        self._offset = 0

    def follow(self, path: str | None, name: str) -> None:
        if not path:
            return
        if path != self._path:
            self._path, self._offset = path, 0
        try:
            with open(path, "rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
        except OSError:
            return
        complete = data[: data.rfind(b"\n") + 1]
        self._offset += len(complete)
        for line in complete.decode("utf-8", errors="replace").splitlines():
            logger.info("[{}] {}", name, line)
