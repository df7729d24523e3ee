"""The directory where the users of one shared engine meet (see :mod:`launch.shared`): its place, its
files, and the locks on them. Used by the users (:mod:`launch.shared`) and the host (:mod:`launch.engine_host`).

``<runtime dir>/engines/<key>/``, mode 0700, the key a hash of the engine config::

    users.lock   each user holds a *shared* flock while it uses the engine; the kernel drops it
                 when the process ends, SIGKILL included
    start.lock   held exclusively by the one user that checks for a host and starts one
    host.lock    held exclusively by the host for its whole life: a free lock means no host
    spec.json    the engine to run (written by the user that starts the host)
    state.json   published by the host (0600, replaced atomically): status, phase, URL, API key, pids
    stale.json   a dead host's last state, moved aside for its successor (port, key, what to clean)
    host.log     the host's own output
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import stat
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from launch.config import EngineConfig
from launch.preflight import PreflightError
from launch.process import EngineError, EngineExited, EngineStartTimeout

RUNTIME_DIR_ENV = "SGLANG_GATEWAY_RUNTIME_DIR"
USERS_LOCK = "users.lock"
START_LOCK = "start.lock"
HOST_LOCK = "host.lock"
SPEC_FILE = "spec.json"
STATE_FILE = "state.json"
STALE_FILE = "stale.json"  # a dead host's state, handed to its successor
HOST_LOG = "host.log"


class SharedEngineError(EngineError):
    """The shared engine could not be started or reached (the message says why; the host's log is named)."""

    def __init__(self, message: str, *, log_file: Path | None = None, log_tail: list[str] | None = None) -> None:
        super().__init__(message, name="shared", returncode=None, log_tail=log_tail or [], log_file=log_file)


_ENGINE_ERRORS: dict[str, type[EngineError]] = {cls.__name__: cls for cls in (EngineError, EngineExited, EngineStartTimeout)}


def failure_state(error: BaseException) -> dict[str, Any]:
    """The ``state.json`` fields of a host whose engine could not start: the error in parts (kind, message, exit
    code, log tail), so that each user raises the very error the host met (:func:`start_failure`)."""
    if isinstance(error, PreflightError):
        return {"error": str(error), "error_kind": "preflight"}
    if isinstance(error, EngineError):
        return {
            "error": error.message,
            "error_kind": type(error).__name__,
            "returncode": error.returncode,
            "log_tail": error.log_tail,
            "log_file": str(error.log_file) if error.log_file else None,
        }
    return {"error": str(error)}


def start_failure(name: str, state: dict[str, Any]) -> Exception:
    """The error a user of the shared engine ``name`` raises for the failure its host published: the host's own
    (:class:`launch.preflight.PreflightError`, :class:`launch.process.EngineExited`...), with its message, exit code
    and log tail, as ``sglang-gateway serve`` prints it; otherwise a :class:`SharedEngineError` naming the engine."""
    message = str(state.get("error") or "the engine host gave up")
    log_file = Path(state["log_file"]) if state.get("log_file") else None
    kind = state.get("error_kind")
    if kind == "preflight":
        return PreflightError(message)
    if kind in _ENGINE_ERRORS:
        tail = [str(line) for line in state.get("log_tail") or []]
        return _ENGINE_ERRORS[kind](message, name=name, returncode=state.get("returncode"), log_tail=tail, log_file=log_file)
    return SharedEngineError(f"engine {name!r}: {message}", log_file=log_file)


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


def key_dir_for(name: str, engine: EngineConfig) -> Path:
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
