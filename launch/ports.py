"""Free-port helpers for engines, routers and gateways started with ``port: 0``."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterable
from pathlib import Path

from launch.procgroup import fd_targets

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# SGLang picks its scheduler's NCCL/gloo port from 22000-29999 (also below the ephemeral range), and 30000 is
# its default HTTP port: ours come from around them.
PICK_RANGES: tuple[tuple[int, int], ...] = ((10000, 21999), (30001, 65535))
PICK_ATTEMPTS = 64
TCP_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))  # the kernel's sockets, one per line
_LISTEN = "0A"  # the "st" column of a listening socket


def pick_free_port(host: str = "127.0.0.1") -> int:
    """A free TCP port on ``host``, outside the kernel's ephemeral range where there is room.

    The port is only checked here and bound later (an engine binds it about 20 s after this, once
    SGLang is imported). The kernel hands out ephemeral ports to every ``bind(0)`` and outgoing
    connection on the machine, so a port picked from that range can be taken in the meantime (the
    engine then exits with uvicorn's code 3): one in a few dozen starts on a machine that opens many
    connections, such as a test run. Ports outside it are only taken by someone who picks them.
    """
    candidates = outside_ephemeral_ports()
    for port in random.sample(candidates, min(PICK_ATTEMPTS, len(candidates))):
        if port_is_free(host, port, reuse_addr=False):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # no room outside it: the kernel's pick
        sock.bind((_bind_host(host), 0))
        return int(sock.getsockname()[1])


def outside_ephemeral_ports() -> list[int]:
    """The ports of :data:`PICK_RANGES` that the kernel never hands out by itself."""
    low, high = ephemeral_range()
    return [port for start, end in PICK_RANGES for port in range(start, end + 1) if not low <= port <= high]


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        low, high = EPHEMERAL_RANGE_FILE.read_text().split()[:2]
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def port_is_free(host: str, port: int, *, reuse_addr: bool = True) -> bool:
    """Whether nothing is listening on (or bound to) ``host:port``.

    Connections of a stopped server still in TIME_WAIT do not count: the engine's server binds with
    ``SO_REUSEADDR`` (uvicorn does), so an engine restarted after a crash gets its old port back.
    ``reuse_addr=False``: they count too (a port picked for a new server is one nothing uses at all).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        if reuse_addr:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((_bind_host(host), port))
        except OSError:
            return False
    return True


def _bind_host(host: str) -> str:
    return "0.0.0.0" if host in ("", "0.0.0.0", "::") else host


def listening_socket_inodes(port: int) -> set[int] | None:
    """The inodes of the sockets listening on TCP ``port`` here (IPv4 and IPv6); None where the kernel's tables
    cannot be read (not Linux)."""
    inodes: set[int] = set()
    readable = False
    for table in TCP_TABLES:
        try:
            rows = table.read_text().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for row in rows:
            fields = row.split()  # sl local_address rem_address st tx_queue:rx_queue tr:when retrnsmt uid timeout inode
            if len(fields) > 9 and fields[3] == _LISTEN and int(fields[1].rpartition(":")[2], 16) == port:
                inodes.add(int(fields[9]))
    return inodes if readable else None


def listens_among(port: int, pids: Iterable[int]) -> bool | None:
    """Whether one of ``pids`` listens on TCP ``port``: False when only other processes do (another server answers
    there), None when that cannot be told (no kernel tables, or nothing listens)."""
    inodes = listening_socket_inodes(port)
    if not inodes:
        return None
    sockets = {f"socket:[{inode}]" for inode in inodes}
    return any(target in sockets for pid in pids for target in fd_targets(pid))
