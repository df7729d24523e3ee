"""``port_is_free``: a listener makes a port taken; a stopped server's connections in TIME_WAIT do not (the
engine's server binds with SO_REUSEADDR, so a restarted engine can take its old port back)."""

from __future__ import annotations

import socket

from launch.ports import ephemeral_range, pick_free_port, port_is_free


def test_a_listening_port_is_taken_and_a_stopped_servers_port_is_free_again() -> None:
    port = pick_free_port()
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen()
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    assert not port_is_free("127.0.0.1", port)
    accepted.close()  # the server side closes first: its end of the connection stays in TIME_WAIT
    server.close()
    client.close()
    assert port_is_free("127.0.0.1", port)


def test_picked_ports_are_outside_the_kernels_ephemeral_range() -> None:
    """The kernel hands ephemeral ports to every outgoing connection: a port picked there can be taken before the
    engine binds it (it did, in a CI run: an engine exited with code 3)."""
    low, high = ephemeral_range()
    picked = {pick_free_port() for _ in range(50)}
    assert not any(low <= port <= high for port in picked), (low, high, sorted(picked))
    assert len(picked) > 40  # random picks, not one port handed out again and again
    for port in picked:
        assert port_is_free("127.0.0.1", port)
