"""One engine per engine configuration per machine, shared by every process that asks for it.

Several processes load the same model (``mlflow models serve -w N`` workers, notebooks on one driver):
on a GPU a second engine would ask for the memory the first one holds. With :func:`join` they use one.
The engine belongs to a small detached *host* process (:mod:`launch.engine_host`), and processes meet
in one directory per configuration::

    <runtime dir>/engines/<key>/   mode 0700; key: hash of the engine config (weights path included)
        users.lock   each user holds a *shared* flock while it uses the engine; the kernel drops it
                     when the process ends, SIGKILL included
        start.lock   held exclusively by the one user that checks for a host and starts one
        host.lock    held exclusively by the host for its whole life: a free lock means no host
        spec.json    the engine to run (written by the user that starts the host)
        state.json   published by the host (0600, replaced atomically): status, phase, URL, API key, pids
        stale.json   a dead host's last state, moved aside for its successor (port, key, what to clean)
        host.log     the host's own output

The host starts the engine (random API key), publishes it, restarts it if it dies while users remain,
and stops it and removes the directory once it can take ``users.lock`` exclusively (nobody left). A
user that finds the host gone starts a new one; the new host cleans up after the old engine and
reuses its port and key when it can, so the URL other users hold stays valid.

Races: starters are serialised by ``start.lock`` and a host that cannot take ``host.lock`` exits; a
user only trusts ``state.json`` while ``host.lock`` is held; a user that waited for ``users.lock``
while the host was removing the directory sees that its lock file is gone and starts over.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from loguru import logger

from launch.config import EngineConfig
from launch.process import EngineError, EngineStartTimeout

RUNTIME_DIR_ENV = "SGLANG_GATEWAY_RUNTIME_DIR"
USERS_LOCK = "users.lock"
START_LOCK = "start.lock"
HOST_LOCK = "host.lock"
SPEC_FILE = "spec.json"
STATE_FILE = "state.json"
STALE_FILE = "stale.json"  # a dead host's state, handed to its successor
HOST_LOG = "host.log"
HOST_MODULE = "launch.engine_host"
POLL_S = 0.25
HOST_START_TIMEOUT_S = 120.0  # interpreter start and imports of a fresh host on a busy machine
WAIT_MARGIN_S = 60.0  # users wait this much longer than the engine's own start-up timeout
MAX_TAKEOVERS = 3  # hosts that may die in a row while one user waits


class SharedEngineError(EngineError):
    """The shared engine could not be started or reached (the message says why; the host's log is named)."""

    def __init__(self, message: str, *, log_file: Path | None = None, log_tail: list[str] | None = None) -> None:
        super().__init__(message, name="shared", returncode=None, log_tail=log_tail or [], log_file=log_file)


# ------------------------------------------------------------------------------ files and locks
def runtime_root() -> Path:
    """This user's directory for shared engines: ``$SGLANG_GATEWAY_RUNTIME_DIR``, ``$XDG_RUNTIME_DIR/sglang-gateway``
    or ``<tmp>/sglang-gateway-<uid>``; created 0700, refused when another user owns it."""
    override = os.environ.get(RUNTIME_DIR_ENV)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if override:
        root = Path(override)
    elif xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK):
        root = Path(xdg) / "sglang-gateway"
    else:
        root = Path(tempfile.gettempdir()) / f"sglang-gateway-{os.getuid()}"
    return private_dir(root)


def private_dir(path: Path) -> Path:
    """Create ``path`` (0700) if needed; refuse a symlink or a directory another user owns."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise SharedEngineError(f"{path}: not a directory owned by this user (remove it, or set {RUNTIME_DIR_ENV})")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def engine_key(name: str, engine: EngineConfig) -> str:
    """Same key for the same engine (served name, every engine field, real weights path and interpreter)."""
    data = engine.model_dump(mode="json")
    data["model_path"] = _real_path(engine.model_path)
    data["python"] = os.path.realpath(engine.python_executable)
    blob = json.dumps({"name": name, "engine": data}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def engine_dir(name: str, engine: EngineConfig) -> Path:
    """The directory where users of this engine meet (not created)."""
    return runtime_root() / "engines" / engine_key(name, engine)


def _real_path(path: str) -> str:
    expanded = os.path.expanduser(path)
    return os.path.realpath(expanded) if os.path.exists(expanded) else path


def write_private_json(path: Path, data: dict[str, Any]) -> None:
    """Replace ``path`` atomically with ``data`` as JSON, readable by this user only."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open(fd, "w") as handle:
        json.dump(data, handle)
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def open_lock_file(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)


def same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (the host removes the files when it leaves)."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def hold_users_lock(key_dir: Path) -> int:
    """Open ``users.lock`` and hold it shared; start over if the host removed it while we waited."""
    while True:
        private_dir(key_dir)
        fd = open_lock_file(key_dir / USERS_LOCK)
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a host that found nobody is cleaning up
        if same_file(fd, key_dir / USERS_LOCK):
            return fd
        os.close(fd)


def host_alive(key_dir: Path) -> bool:
    """Whether a host holds ``host.lock`` (a dead host's lock is released by the kernel)."""
    try:
        fd = os.open(key_dir / HOST_LOCK, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also releases the probe's own shared lock
    return False


@contextmanager
def exclusive(path: Path) -> Iterator[None]:
    fd = open_lock_file(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def log_tail(path: Path | None, lines: int = 30) -> list[str]:
    if path is None:
        return []
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


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
        self._lock = threading.Lock()
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
        if self.closed or not pid:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def auth_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    # ----------------------------------------------------------------- life cycle
    def wait_ready(self, timeout_s: float) -> None:
        """Start a host if there is none, then wait until the engine is ready (or the host gives up)."""
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
                raise SharedEngineError(
                    f"engine {self.name!r}: {state.get('error') or 'the engine host gave up'}",
                    log_file=Path(state["log_file"]) if state.get("log_file") else None,
                )
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
                if self._ensure_host():
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
        restarts a dead engine; a dead host is replaced). True when the lease is usable again."""
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
                    self.wait_ready(max(1.0, deadline - time.monotonic()))
                    continue
                if time.monotonic() >= deadline:
                    return False
                time.sleep(POLL_S)

    def close(self) -> None:
        """Stop using the engine (the host stops it when nobody else does). Idempotent."""
        with self._lock:
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
            raise SharedEngineError(
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
) -> SharedEngine:
    """Use the machine's engine for ``engine`` (starting it through a new host if none runs); wait until ready.

    Raises :class:`launch.process.EngineError` (with the engine's log tail) when it cannot start.
    """
    key_dir = engine_dir(name, engine)
    lease = SharedEngine(name, engine, key_dir, hold_users_lock(key_dir), log_dir=log_dir, show_log=show_log)
    try:
        lease.wait_ready(engine.startup_timeout_s + WAIT_MARGIN_S if timeout_s is None else timeout_s)
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
