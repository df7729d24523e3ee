"""Free-port helpers for engines started with ``port: 0``."""

from __future__ import annotations

import socket


def pick_free_port(host: str = "127.0.0.1") -> int:
    """Ask the kernel for a free TCP port on ``host``.

    SGLang's scheduler opens about ten more ports of its own right after start-up, so there is a
    small window in which another process can take this one; the engine then exits with an error
    that ``EngineProcess.wait_ready`` reports.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_bind_host(host), 0))
        return int(sock.getsockname()[1])


def port_is_free(host: str, port: int) -> bool:
    """Whether nothing is listening on (or bound to) ``host:port``.

    Connections of a stopped server still in TIME_WAIT do not count: the engine's server binds with
    ``SO_REUSEADDR`` (uvicorn does), so an engine restarted after a crash gets its old port back.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((_bind_host(host), port))
        except OSError:
            return False
    return True


def _bind_host(host: str) -> str:
    return "0.0.0.0" if host in ("", "0.0.0.0", "::") else host
