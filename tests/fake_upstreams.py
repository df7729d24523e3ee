"""FAKE engines at the TCP level: listeners that accept and then answer as a test says, or never (the real engine
cannot be made to stall or misbehave on demand)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def fake_tcp_upstream(accepted: Callable[[socket.socket], None]) -> Iterator[str]:
    """A FAKE engine's listener: each connection it accepts goes to ``accepted`` (which must not block); the
    connections are closed at the end. Its URL is yielded."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.2)
    stop = threading.Event()
    held: list[socket.socket] = []

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except (TimeoutError, OSError):
                continue
            held.append(conn)
            accepted(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(2)
        for conn in held:
            conn.close()
        listener.close()


@contextmanager
def fake_stalled_upstream() -> Iterator[str]:
    """A FAKE engine that accepts connections and reads requests but never answers (for the 504 tests): the real
    engine cannot be made to stall on demand."""
    with fake_tcp_upstream(lambda conn: None) as url:
        yield url
