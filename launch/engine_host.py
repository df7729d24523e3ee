"""The process that owns a shared engine: ``python -m launch.engine_host KEY_DIR`` (see :mod:`launch.shared`;
``KEY_DIR`` is described in :mod:`launch.engine_dir`).

Started detached by the first user of an engine configuration. It holds ``host.lock`` for its whole
life, starts the engine, publishes ``state.json``, restarts the engine when it dies while users remain
(at most :data:`MAX_RESTARTS` in :data:`RESTART_WINDOW_S`), and stops it and removes the directory as
soon as it can take ``users.lock`` exclusively. The engine gets a parent-death signal from this
process, so killing the host never leaves an engine behind; the next host removes what the dead
engine left in ``/dev/shm``.
"""

from __future__ import annotations

import collections
import fcntl
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from loguru import logger

from launch.config import EngineConfig
from launch.engine_dir import (
    HOST_LOCK,
    HOST_LOG,
    SPEC_FILE,
    STALE_FILE,
    START_LOCK,
    STATE_FILE,
    USERS_LOCK,
    failure_state,
    open_lock_file,
    read_json,
    write_private_json,
)
from launch.lifecycle import start_ready
from launch.ports import port_is_free
from launch.preflight import PreflightError
from launch.process import EngineError, EngineProcess, EngineStartCancelled, new_engine_key
from launch.procgroup import group_pids
from launch.shm import orphaned_shm_files, remove_files

WATCH_S = 0.5
MAX_RESTARTS = 3
RESTART_WINDOW_S = 600.0
FAILED_GRACE_S = 10.0  # a failed start stays published this long for the users waiting on it
HOST_LOCK_RETRY_S = 5.0  # users probe host.lock with a brief shared lock
STALE_ENGINE_GRACE_S = 15.0
MAX_MESSAGES = 50


class EngineHost:
    """Runs one shared engine for the users of ``key_dir`` until none is left."""

    def __init__(self, key_dir: Path, spec: dict[str, Any]) -> None:
        self.key_dir = key_dir
        self.name = str(spec["name"])
        self.engine = EngineConfig.model_validate(spec["engine"])
        self.log_dir = spec.get("log_dir")
        stale = read_json(key_dir / STALE_FILE) or {}
        self.stale = stale
        # A replaced host's port and key, so that URLs its users hold stay valid.
        self.api_key = stale.get("api_key") or new_engine_key()
        self.port = int(stale.get("port") or 0)
        self.state: dict[str, Any] = {
            "host_pid": os.getpid(),
            "started_by": os.getppid(),
            "generation": int(stale.get("generation") or 0),
            "messages": [],
        }
        self.process: EngineProcess | None = None
        self._users_fd = open_lock_file(key_dir / USERS_LOCK)
        self._nobody_left = False
        self._stop = threading.Event()
        self._restarts: collections.deque[float] = collections.deque()

    # ----------------------------------------------------------------- main loop
    def run(self) -> int:
        """Exit code: 0 when the last user left (or a signal asked), 1 when the engine could not be kept up."""
        self._clean_up_after(self.stale)
        try:
            while True:
                try:
                    self.process = self._start()
                except EngineStartCancelled:
                    return 0
                except (EngineError, PreflightError, OSError, ValueError) as error:
                    self._publish(status="failed", **failure_state(error))  # before the log line, which users would relay
                    logger.error("engine {}: {}", self.name, error)
                    self._wait_until_nobody_left(FAILED_GRACE_S)
                    return 1
                self._publish(
                    status="ready",
                    phase="ready",
                    url=self.process.url,
                    api_key=self.api_key,
                    port=self.process.port,
                    engine_pid=self.process.pid,
                    engine_started=time.time(),
                    log_file=str(self.process.log_file),
                )
                logger.info("engine {}: ready at {} (pid {})", self.name, self.process.url, self.process.pid)
                if not self._watch():
                    return 0
                code = self.process.returncode
                self.process.stop()  # reap it and remove its /dev/shm files
                if not self._may_restart():
                    message = f"the engine exited with code {code} {MAX_RESTARTS + 1} times in {RESTART_WINDOW_S:.0f}s; not restarting it (log: {self.process.log_file})"
                    logger.error("engine {}: {}", self.name, message)
                    self._publish(status="failed", error=message)
                    self._wait_until_nobody_left(FAILED_GRACE_S)
                    return 1
                logger.warning(
                    "engine {}: exited with code {}; restarting it (log: {})", self.name, code, self.process.log_file
                )
                self._publish(status="restarting", phase="restarting")
        finally:
            if self.process is not None:
                self.process.stop()
            self._remove_files()

    def request_stop(self, *_: Any) -> None:
        self._stop.set()

    def _start(self) -> EngineProcess:
        engine = self.engine
        if engine.port == 0 and self.port and port_is_free(engine.host, self.port):
            engine = engine.model_copy(update={"port": self.port})
        self.state["generation"] += 1
        self._publish(status="starting" if self.state["generation"] == 1 else "restarting", phase="starting")
        process = start_ready(
            self.name,
            engine,
            log_dir=self.log_dir,
            api_key=self.api_key,
            on_progress=lambda phase, seconds: self._publish(phase=phase, phase_s=round(seconds, 1)),
            echo_level=None,  # users read the engine's log file; this process's output is its own log
            stop_when=self._should_stop,
        )
        self.port = process.port
        return process

    def _watch(self) -> bool:
        """Until the engine dies (True) or nobody is left / a stop was asked (False)."""
        assert self.process is not None
        while not self._stop.wait(WATCH_S):
            if self._should_stop():
                return False
            if not self.process.running:
                return True
        return False

    def _should_stop(self) -> bool:
        return self._stop.is_set() or self._no_users()

    def _no_users(self) -> bool:
        """True once ``users.lock`` can be taken exclusively; then it is kept so that nobody joins a dying host."""
        if not self._nobody_left:
            try:
                fcntl.flock(self._users_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            self._nobody_left = True
            logger.info("engine {}: no user left; stopping", self.name)
        return True

    def _wait_until_nobody_left(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._should_stop() and time.monotonic() < deadline:
            time.sleep(WATCH_S)

    def _may_restart(self) -> bool:
        now = time.monotonic()
        while self._restarts and now - self._restarts[0] > RESTART_WINDOW_S:
            self._restarts.popleft()
        if len(self._restarts) >= MAX_RESTARTS:
            return False
        self._restarts.append(now)
        return True

    # ----------------------------------------------------------------- state and files
    def _publish(self, **fields: Any) -> None:
        self.state.update(fields)
        self.state["updated"] = time.time()
        write_private_json(self.key_dir / STATE_FILE, self.state)

    def relay(self, message: Any) -> None:
        """Loguru sink: warnings and errors reach the users through the state file."""
        record = message.record
        self.state["messages"] = (self.state["messages"] + [record["message"]])[-MAX_MESSAGES:]
        try:
            self._publish()
        except OSError:
            pass

    def _clean_up_after(self, stale: dict[str, Any]) -> None:
        """A dead host's engine dies with it (parent-death signal); wait for that, then remove its /dev/shm files."""
        pid = stale.get("engine_pid")
        if not pid:
            return
        deadline = time.monotonic() + STALE_ENGINE_GRACE_S
        while _sglang_group(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _sglang_group(pid):
            logger.warning("engine {}: the previous engine (pid {}) is still running; killing it", self.name, pid)
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        started = stale.get("engine_started")
        if started:
            removed = remove_files(orphaned_shm_files(float(started) - 1.0))
            if removed:
                logger.info("engine {}: removed {} /dev/shm file(s) of the previous engine", self.name, len(removed))

    def _remove_files(self) -> None:
        """Leave no trace: the whole directory when nobody is left, else only the state (users then take over)."""
        for name in (STATE_FILE, SPEC_FILE, STALE_FILE):
            (self.key_dir / name).unlink(missing_ok=True)
        if self._nobody_left:
            # Safe: users hold users.lock (which we hold exclusively) before touching anything here;
            # one waiting for it sees its file gone and starts over.
            for name in (START_LOCK, HOST_LOCK, HOST_LOG, USERS_LOCK):
                (self.key_dir / name).unlink(missing_ok=True)
            try:
                self.key_dir.rmdir()
            except OSError:
                pass
        os.close(self._users_fd)


def _sglang_group(pgid: int) -> bool:
    """Whether process group ``pgid`` still has an SGLang process (a reused pid is left alone)."""
    for pid in group_pids(pgid):
        try:
            if b"sglang" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return True
        except OSError:
            continue
    return False


def _take_host_lock(key_dir: Path) -> int | None:
    """Hold ``host.lock`` exclusively, or None when another host holds it."""
    fd = open_lock_file(key_dir / HOST_LOCK)
    deadline = time.monotonic() + HOST_LOCK_RETRY_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                return None
            time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m launch.engine_host KEY_DIR", file=sys.stderr)
        return 2
    key_dir = Path(args[0])
    host_fd = _take_host_lock(key_dir)
    if host_fd is None:
        return 0  # another host runs this engine
    logger.remove()
    logger.add(sys.stderr, level="INFO", format="{time:YYYY-MM-DD HH:mm:ss} | {level: <7} | {message}")
    spec = read_json(key_dir / SPEC_FILE)
    if spec is None:
        logger.error("no readable {} in {}", SPEC_FILE, key_dir)
        return 2
    host = EngineHost(key_dir, spec)
    logger.add(host.relay, level="WARNING", format="{message}")
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, host.request_stop)
    logger.info("engine host for {} (pid {}, started by pid {})", host.name, os.getpid(), os.getppid())
    try:
        return host.run()
    finally:
        os.close(host_fd)


if __name__ == "__main__":
    sys.exit(main())
