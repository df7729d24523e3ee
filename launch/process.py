"""A supervised SGLang engine process: start, wait for readiness, stop without leaving anything behind.

The engine runs in its own process group (so one signal reaches the scheduler and detokenizer it
forks) with a parent-death signal (so it cannot outlive a crashed parent). Its output goes to a log
file and to the logger; start-up phases are parsed from it to show progress.

``start()`` must be called from a long-lived thread (normally the main one): Linux delivers the
parent-death signal when the *thread* that forked the child exits.
"""

from __future__ import annotations

import collections
import re
import secrets
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import httpx
from loguru import logger

from launch.argv import build_argv, build_env, secret_config
from launch.config import EngineConfig
from launch.engine_tmp import (
    engine_tmp_env,
    make_engine_tmp_dir,
    remove_engine_tmp_dir,
    remove_orphaned_engine_tmp_dirs,
)
from launch.logpump import pump_output
from launch.ports import listens_among, pick_free_port
from launch.procgroup import group_pids, popen_group, stop_group
from launch.secret_file import remove_orphaned_secret_files, safe_name, write_secret_file
from launch.shm import orphaned_shm_files, owned_shm_files, remove_files, remove_orphaned_shm

LOG_TAIL_LINES = 200

# Start-up phases, in the order SGLang logs them (first match wins for each line). Each supported version's wording of
# these messages is pinned in launch/sglang_facts/<version>.json (log_templates); tests/launch/test_log_phases.py.
PHASES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("loading weights", re.compile(r"Load weight begin")),
    ("weights loaded", re.compile(r"Load weight end")),
    ("allocating KV cache", re.compile(r"KV Cache is allocated")),
    # "Capture cuda graph begin" (SGLang 0.5.10), "Capture target prefill CUDA graph begin" / "... decode ..." (0.5.23)
    ("capturing CUDA graphs", re.compile(r"Capture (?:[\w-]+ )*(?:cuda|CUDA) graph begin")),
    ("CUDA graphs captured", re.compile(r"Capture (?:[\w-]+ )*(?:cuda|CUDA) graph end")),
    ("HTTP server up", re.compile(r"Uvicorn running on")),
    ("warming up", re.compile(r"POST /generate")),
    ("ready", re.compile(r"fired up and ready to roll")),
)


# What SGLang logs when one of its processes dies of an exception (the server then takes itself down).
CRASH_MARKER = re.compile(r"hit an exception|SIGQUIT received")
# What uvicorn logs (then exits with code 3) when the engine's HTTP port is taken.
PORT_TAKEN_MARKER = re.compile(r"error while attempting to bind on address .*address already in use", re.IGNORECASE)
_EXCEPTION_LINE = re.compile(r"^(?:\[[^\]]*\] )?([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)\b:?.*)$")


def crash_cause(lines: list[str]) -> str | None:
    """The exception that crashed an engine, from its log ``lines``: the last line of the first traceback from
    the first crash marker on (``Scheduler hit an exception: Traceback ...`` ... ``IndexError: ...``).

    Not the last exception of the log: SGLang takes itself down after a crash, and what fails on the way (a
    ``FileNotFoundError`` of its shutdown) says nothing about why it crashed. None when no crash is logged.
    """
    marked = next((index for index, line in enumerate(lines) if CRASH_MARKER.search(line)), None)
    if marked is None:
        return None
    in_traceback = False
    for line in lines[marked:]:
        if "Traceback (most recent call last)" in line:
            in_traceback = True
        elif in_traceback and line[:1] not in ("", " ", "\t") and (match := _EXCEPTION_LINE.match(line.rstrip())):
            return match.group(1)[:300]  # frames and source lines are indented; the exception line is not
    for line in lines[marked:]:  # no traceback: an exception named on a line of its own
        match = _EXCEPTION_LINE.match(line.strip())
        if match:
            return match.group(1)[:300]
    return "an exception (see the engine log)"


# argparse's last word on a bad command line: "sglang serve: error: argument --x: invalid int value: 'y'".
_USAGE_ERROR = re.compile(r"^[\w.\- ]+: error: (.+)$")


def start_failure_cause(lines: list[str]) -> str | None:
    """Why an engine exited while starting, from its log ``lines``: a crash (:func:`crash_cause`), else the
    exception line of the last traceback (SGLang's main process failing on the model's config, say), else
    its argument parser's error. None when the log says none of these (killed from outside)."""
    crashed = crash_cause(lines)
    if crashed is not None:
        return crashed
    for index in range(len(lines) - 1, -1, -1):
        if "Traceback (most recent call last)" in lines[index]:
            for line in lines[index + 1 :]:
                if line[:1] not in ("", " ", "\t") and (match := _EXCEPTION_LINE.match(line.rstrip())):
                    return match.group(1)[:300]
            break
    for line in reversed(lines):
        if match := _USAGE_ERROR.match(line.strip()):
            return f"SGLang refused its command line: {match.group(1)[:300]}"
    return None


def killed_by(returncode: int | None) -> str | None:
    """``killed by SIGKILL (...)`` for an engine a signal ended (a negative exit code), else None."""
    if returncode is None or returncode >= 0:
        return None
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    hint = " (the kernel's out-of-memory killer, or another process)" if name == "SIGKILL" else ""
    return f"killed by {name}{hint}"


def port_was_taken(lines: list[str]) -> bool:
    """Whether an engine's log ``lines`` say it exited because its HTTP port was already bound."""
    return any(PORT_TAKEN_MARKER.search(line) for line in lines)


class EngineError(RuntimeError):
    """The engine could not be started or answered wrongly; carries its exit code and log tail."""

    def __init__(self, message: str, *, name: str, returncode: int | None, log_tail: list[str], log_file: Path | None):
        self.message = message  # without the log file and tail that str() adds: what an engine host publishes
        self.name = name
        self.returncode = returncode
        self.log_tail = log_tail
        self.log_file = log_file
        tail = "\n".join(f"    {line}" for line in log_tail[-30:])
        where = f" (full log: {log_file})" if log_file else ""
        super().__init__(f"{message}{where}\n  last lines of the engine log:\n{tail}" if log_tail else message + where)


class EngineExited(EngineError):
    """The engine process exited (during start-up or afterwards)."""


class EngineStartTimeout(EngineError):
    """The engine did not become ready within its start-up timeout."""


class EngineStartCancelled(EngineError):
    """The caller gave up waiting for readiness (``wait_ready(stop_when=...)`` returned True)."""


ProgressCallback = Callable[[str, float], None]


def bearer(api_key: str | None) -> dict[str, str]:
    """The header that sends ``api_key`` to an engine, a router or a url upstream (none without a key)."""
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


def new_engine_key() -> str:
    """A random API key for one engine: only the process that launched it knows it.

    Prefixed: SGLang turns its config file into arguments, and a key starting with ``-`` (one in 64 of
    ``token_urlsafe``'s) would be read as an option (``--api-key: expected one argument``).
    """
    return "sgw_" + secrets.token_urlsafe(32)


class EngineProcess:
    """One ``sglang.launch_server`` subprocess for one model.

    >>> with EngineProcess("tiny", engine_config) as engine:   # starts and waits for /health
    ...     print(engine.url)
    """

    def __init__(
        self,
        name: str,
        config: EngineConfig,
        *,
        log_dir: str | Path | None = None,
        on_progress: ProgressCallback | None = None,
        stop_grace_s: float = 15.0,
        api_key: str | None = None,
        served_model_name: str | None = None,
        echo_level: str | None = "DEBUG",
    ) -> None:
        self.name = name
        self.config = config
        # What the engine answers to in "model" when its config names nothing (default: ``name``; the
        # replicas of one model share their model's name but are named apart in logs).
        self.served_model_name = served_model_name or name
        # With a key, the engine refuses every request without it (but /health and /metrics): local
        # processes cannot go around whoever launched it. It reaches SGLang through a private file.
        self.api_key = api_key
        self._secret_file: Path | None = None
        self.stop_grace_s = stop_grace_s
        self.on_progress = on_progress
        # Level at which each engine log line also goes to the logger (None: the log file only). DEBUG
        # keeps it out of INFO-level consoles; the MLflow wrapper passes None so notebooks stay quiet.
        self.echo_level = echo_level
        self._log_dir = Path(log_dir) if log_dir else Path(tempfile.gettempdir()) / "sglang-gateway-logs"
        self._tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._phase = "not started"
        self._ready = False
        self._started_at: float | None = None
        self._lock = threading.Lock()
        self.port = config.port
        self.log_file: Path | None = None
        self.argv: list[str] = []
        self.uses_cpu_shim = False
        self.tmp_dir: Path | None = None  # the engine's TMPDIR, removed when it stops
        self._known_shm: set[Path] = set()  # remembered while alive: a crashed engine's files are still ours
        self._started_wall: float | None = None
        self._warned_port_answered = False  # another process's server answered on this engine's port

    # ----------------------------------------------------------------- properties
    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "::", "") else self.config.host
        return f"http://{host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def ready(self) -> bool:
        return self._ready and self.running

    @property
    def phase(self) -> str:
        return self._phase

    def auth_headers(self) -> dict[str, str]:
        """Headers a request to this engine needs (its API key, if it has one)."""
        return bearer(self.api_key)

    def crash_exception(self) -> str | None:
        """The exception an engine that crashed logged last (e.g. ``IndexError: index out of range``).

        None when its log shows no crash: an engine killed from outside (OOM killer, an operator's
        SIGKILL) dies without a word, which is how the two are told apart.
        """
        return crash_cause(self.log_tail(LOG_TAIL_LINES))

    def log_tail(self, lines: int = 40) -> list[str]:
        with self._lock:
            return list(self._tail)[-lines:]

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Spawn the engine (returns at once; see :meth:`wait_ready`).

        First removes the ``/dev/shm`` files of engines that died with nobody left to clean up
        (their launcher was SIGKILLed): files no live process uses.
        """
        if self._proc is not None:
            raise RuntimeError(f"engine {self.name!r} was already started")
        orphans = remove_orphaned_shm()
        if orphans:
            names = ", ".join(sorted(path.name for path in orphans))
            logger.info("removed {} /dev/shm file(s) that no live process uses: {}", len(orphans), names)
        stale_keys = remove_orphaned_secret_files()
        if stale_keys:
            logger.info("removed {} engine key file(s) left by launchers that were killed", len(stale_keys))
        stale_dirs = remove_orphaned_engine_tmp_dirs()
        if stale_dirs:
            logger.info("removed {} engine temporary director(ies) left by launchers that were killed", len(stale_dirs))
        if self.port == 0:
            self.port = pick_free_port(self.config.host)
        if self.api_key:
            self._secret_file = write_secret_file(secret_config(self.config, api_key=self.api_key), self.name)
        self.argv = build_argv(self.config, port=self.port, served_model_name=self.served_model_name, config_file=self._secret_file)
        engine_env = build_env(self.config)
        self.uses_cpu_shim = engine_env.uses_cpu_shim
        self.tmp_dir = make_engine_tmp_dir(self.name, engine_env.variables)
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self.log_file = self._log_dir / f"{safe_name(self.name)}-{self.port}-{int(time.time())}.log"
        logger.info("engine {}: starting on port {}: {}", self.name, self.port, " ".join(self.argv))
        self._proc = popen_group(
            self.argv,
            env=engine_tmp_env(self.tmp_dir, engine_env.variables),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self._started_at = time.monotonic()
        self._started_wall = time.time()
        self._set_phase("starting")
        self._reader = threading.Thread(target=self._pump_log, name=f"engine-log-{self.name}", daemon=True)
        self._reader.start()

    def wait_ready(
        self, timeout_s: float | None = None, poll_s: float = 0.25, stop_when: Callable[[], bool] | None = None
    ) -> None:
        """Block until ``/health`` answers 200 from this engine; raise :class:`EngineExited` / :class:`EngineStartTimeout`
        (or :class:`EngineStartCancelled` as soon as ``stop_when()`` is true).

        A 200 from a server of another process on the engine's port (another engine that took a picked port first,
        one left running on a configured port) is not this engine's: the wait goes on until this one exits for the
        port it could not bind (which :func:`launch.lifecycle.start_ready` answers with a new port) or times out."""
        if self._proc is None:
            raise RuntimeError(f"engine {self.name!r} was not started")
        timeout = self.config.startup_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=httpx.Timeout(2.0, connect=1.0), trust_env=False) as client:
            while True:
                if self._proc.poll() is not None:
                    self._join_reader()
                    tail = self.log_tail(LOG_TAIL_LINES)
                    cause = start_failure_cause(tail) or killed_by(self._proc.returncode)
                    raise EngineExited(
                        f"engine {self.name!r} exited with code {self._proc.returncode} while starting"
                        + (f": {cause}" if cause else ""),
                        name=self.name,
                        returncode=self._proc.returncode,
                        log_tail=tail,
                        log_file=self.log_file,
                    )
                if self.health(client) and not self._answered_by_another():
                    self._remove_secret_file()  # SGLang read it long before /health answers
                    self._known_shm |= owned_shm_files(self._proc.pid)
                    self._ready = True
                    self._set_phase("ready")
                    logger.info("engine {}: ready at {} after {:.1f}s", self.name, self.url, self.uptime_s)
                    return
                if stop_when is not None and stop_when():
                    raise EngineStartCancelled(
                        f"engine {self.name!r}: start cancelled (phase: {self._phase})",
                        name=self.name,
                        returncode=None,
                        log_tail=[],
                        log_file=self.log_file,
                    )
                if time.monotonic() >= deadline:
                    raise EngineStartTimeout(
                        f"engine {self.name!r} was not ready after {timeout:.0f}s (last phase: {self._phase})",
                        name=self.name,
                        returncode=None,
                        log_tail=self.log_tail(LOG_TAIL_LINES),
                        log_file=self.log_file,
                    )
                time.sleep(poll_s)

    def _answered_by_another(self) -> bool:
        """Whether what answers on this engine's port is another process's server (logged the first time)."""
        if self._proc is None or self.config.node_rank > 0:
            return False
        if listens_among(self.port, group_pids(self._proc.pid) | {self._proc.pid}) is not False:
            return False  # this engine's, or nothing to tell it by (no kernel tables to read)
        if not self._warned_port_answered:
            self._warned_port_answered = True
            logger.warning("engine {}: another process's server answers on port {}; waiting for this engine to bind it or exit", self.name, self.port)
        return True

    def health(self, client: httpx.Client | None = None) -> bool:
        """One ``GET /health``: True only on 200 (SGLang answers 503 until warm-up is done).

        A follower machine of an engine spanning several (``node_rank`` > 0) serves no HTTP at all: running is
        all it can show (rank 0 answers for the whole engine)."""
        if self.config.node_rank > 0:
            return self.running
        try:
            if client is None:
                response = httpx.get(f"{self.url}/health", timeout=2.0, trust_env=False)
            else:
                response = client.get(f"{self.url}/health")
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self._started_at if self._started_at else 0.0

    def stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``grace_s``, then remove its ``/dev/shm`` files and its
        temporary directory."""
        proc = self._proc
        if proc is None:
            return None
        grace = self.stop_grace_s if grace_s is None else grace_s
        self._ready = False
        self._known_shm |= owned_shm_files(proc.pid)
        if proc.poll() is None:
            logger.info("engine {}: stopping (pid {})", self.name, proc.pid)
        stop_group(proc, grace, label=f"engine {self.name}", leader_first=True)  # SGLang stops its own schedulers
        self._join_reader()
        self._remove_secret_file()
        leftovers = set(self._known_shm)
        if self._started_wall is not None:  # files of an engine that died before they were attributed to it
            leftovers |= orphaned_shm_files(self._started_wall - 1.0)
        removed = remove_files(leftovers)
        if removed:
            logger.debug("engine {}: removed {} /dev/shm file(s)", self.name, len(removed))
        remove_engine_tmp_dir(self.tmp_dir)  # its socket files and metrics directory (see launch.engine_tmp)
        self._set_phase(f"stopped (exit code {proc.returncode})")
        return proc.returncode

    def __enter__(self) -> EngineProcess:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------ internals
    def _pump_log(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None and self.log_file is not None
        pump_output(self._proc.stdout, self.log_file, secret=self.api_key, on_line=self._on_log_line)

    def _on_log_line(self, line: str) -> None:
        with self._lock:
            self._tail.append(line)
        if self.echo_level is not None:
            logger.log(self.echo_level, "[{}] {}", self.name, line)
        self._parse_phase(line)

    def _parse_phase(self, line: str) -> None:
        if self._ready:
            return
        for phase, pattern in PHASES:
            if pattern.search(line):
                self._set_phase(phase)
                return

    def _set_phase(self, phase: str) -> None:
        if phase == self._phase:
            return
        self._phase = phase
        if self.on_progress is not None:
            try:
                self.on_progress(phase, self.uptime_s)
            except Exception:  # a broken progress display must not break the engine
                logger.exception("progress callback failed")

    def _remove_secret_file(self) -> None:
        secret, self._secret_file = self._secret_file, None
        if secret is not None:
            secret.unlink(missing_ok=True)

    def _join_reader(self) -> None:
        if self._reader is not None:
            self._reader.join(timeout=5.0)


