"""FAKE engines at the TCP level: listeners that accept and then answer as a test says, or never (the real engine
cannot be made to stall or misbehave on demand)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager


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


SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def http_chunk(data: bytes) -> bytes:
    """``data`` framed as one HTTP/1.1 chunk, as an engine writes each SSE event."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def read_request(conn: socket.socket, head: bool = False) -> bytes:
    """Read one request (its head, then its Content-Length body, if any) from ``conn``; returns the body (``head``:
    its request line instead). A connection closed before a whole head raises ConnectionError."""
    request = b""
    while b"\r\n\r\n" not in request:
        more = conn.recv(65536)
        if not more:
            raise ConnectionError("the connection closed before a request")
        request += more
    head_bytes, _, body = request.partition(b"\r\n\r\n")
    lines = head_bytes.split(b"\r\n")
    length = int(next((line.split(b":")[1] for line in lines if line.lower().startswith(b"content-length")), b"0"))
    while len(body) < length:
        body += conn.recv(65536)
    return lines[0] if head else body


def fake_answering_upstream(answer: Callable[[socket.socket], None]) -> AbstractContextManager[str]:
    """A FAKE engine that answers each connection with ``answer(conn)``, in a thread of its own (it may block)."""
    return fake_tcp_upstream(lambda conn: threading.Thread(target=answer, args=(conn,), daemon=True).start())


@contextmanager
def fake_stalled_upstream() -> Iterator[str]:
    """A FAKE engine that accepts connections and reads requests but never answers (for the 504 tests): the real
    engine cannot be made to stall on demand."""
    with fake_tcp_upstream(lambda conn: None) as url:
        yield url
