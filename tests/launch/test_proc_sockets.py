"""Reading a process's listening TCP sockets from /proc, on sockets opened here."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

from launch.proc_sockets import ListeningSocket, decode_address, listening_sockets


def test_decode_address_reads_the_kernels_host_order_words() -> None:
    assert decode_address("0100007F:1F90", socket.AF_INET) == ("127.0.0.1", 8080)
    assert decode_address("00000000:0050", socket.AF_INET) == ("0.0.0.0", 80)
    assert decode_address("00000000000000000000000001000000:0016", socket.AF_INET6) == ("::1", 22)
    assert decode_address("0000000000000000FFFF00000100007F:0016", socket.AF_INET6) == ("::ffff:127.0.0.1", 22)


@pytest.mark.parametrize(
    ("address", "wildcard", "loopback"),
    [("0.0.0.0", True, False), ("::", True, False), ("::ffff:0.0.0.0", True, False), ("127.0.0.1", False, True),
     ("::1", False, True), ("::ffff:127.0.0.1", False, True), ("192.0.2.2", False, False)],
)  # fmt: skip
def test_wildcard_and_loopback(address: str, wildcard: bool, loopback: bool) -> None:
    sock = ListeningSocket(address, 1, 1, "x")
    assert (sock.wildcard, sock.loopback) == (wildcard, loopback)


def _listener(family: socket.AddressFamily, host: str) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen()
    return sock


@pytest.fixture
def listeners() -> Iterator[dict[str, socket.socket]]:
    opened = {"v4 loopback": _listener(socket.AF_INET, "127.0.0.1"), "v4 any": _listener(socket.AF_INET, "0.0.0.0")}
    if socket.has_ipv6:
        opened["v6 any"] = _listener(socket.AF_INET6, "::")
    yield opened
    for sock in opened.values():
        sock.close()


def test_listening_sockets_finds_this_processs_binds(listeners: dict[str, socket.socket]) -> None:
    client = socket.create_connection(listeners["v4 loopback"].getsockname())  # connected, not listening: left out
    try:
        client_port = client.getsockname()[1]
        found = {sock.port: sock for sock in listening_sockets({os.getpid()})}
    finally:
        client.close()
    for name, sock in listeners.items():
        seen = found[sock.getsockname()[1]]
        assert seen.pid == os.getpid() and seen.wildcard == ("any" in name), (name, seen)
    assert client_port not in found
