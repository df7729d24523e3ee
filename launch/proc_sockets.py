"""The TCP sockets a process group listens on, read from ``/proc`` (no ``ss``/``lsof`` needed).

A socket belongs to a process when one of its ``/proc/PID/fd`` entries points at ``socket:[INODE]``;
``/proc/PID/net/tcp`` and ``tcp6`` (the process's own network namespace) list every socket by inode
with its local address and state. Matching the two gives what an engine *really* opened, whoever in
it (SGLang, torch, gloo, NCCL, ZMQ) opened it: the check behind "engines listen on loopback only".
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from launch.procgroup import cmdline, group_pids

_TCP_LISTEN = "0A"  # st column of /proc/net/tcp*: include/net/tcp_states.h TCP_LISTEN
_TABLES = (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6))


@dataclass(frozen=True)
class ListeningSocket:
    """One listening TCP socket and the process holding it."""

    address: str  # "127.0.0.1", "::", "::ffff:127.0.0.1"
    port: int
    pid: int
    command: str

    @property
    def ip(self) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
        return ipaddress.ip_address(self.address)

    @property
    def wildcard(self) -> bool:
        """Bound to every interface (``0.0.0.0``, ``::`` or ``::ffff:0.0.0.0``): reachable from the network."""
        ip = self.ip
        mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
        return ip.is_unspecified or (mapped is not None and mapped.is_unspecified)

    @property
    def loopback(self) -> bool:
        ip = self.ip
        mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
        return ip.is_loopback or (mapped is not None and mapped.is_loopback)

    def __str__(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port} (pid {self.pid}: {self.command[:80]})"


def decode_address(hex_address: str, family: int) -> tuple[str, int]:
    """``/proc/net/tcp*``'s ``0100007F:1F90`` -> ``("127.0.0.1", 8080)``.

    The kernel prints the address as 32-bit words in host byte order (``%08X`` of each ``__be32``).
    """
    host_hex, port_hex = hex_address.split(":")
    words = [int(host_hex[i : i + 8], 16) for i in range(0, len(host_hex), 8)]
    packed = b"".join(struct.pack("=I", word) for word in words)
    return socket.inet_ntop(family, packed), int(port_hex, 16)


def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets ``pid`` holds open (empty if it is gone or not ours to read)."""
    inodes: set[int] = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(fd_dir / fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def listening_table(pid: int) -> dict[int, tuple[str, int]]:
    """Every listening TCP socket in ``pid``'s network namespace: inode -> (address, port)."""
    table: dict[int, tuple[str, int]] = {}
    for name, family in _TABLES:
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == _TCP_LISTEN:
                table[int(fields[9])] = decode_address(fields[1], family)
    return table


def listening_sockets(pids: set[int] | list[int]) -> list[ListeningSocket]:
    """The listening TCP sockets held by ``pids``, sorted by port (a socket shared by a fork is listed once)."""
    found: dict[int, ListeningSocket] = {}
    for pid in sorted(pids):
        inodes = socket_inodes(pid)
        if not inodes:
            continue
        command = cmdline(pid)
        for inode, (address, port) in listening_table(pid).items():
            if inode in inodes and inode not in found:
                found[inode] = ListeningSocket(address, port, pid, command)
    return sorted(found.values(), key=lambda sock: (sock.port, sock.address))


def group_listening_sockets(pgid: int) -> list[ListeningSocket]:
    """The listening TCP sockets of every process in process group ``pgid`` (an engine and what it forked)."""
    return listening_sockets(group_pids(pgid))
