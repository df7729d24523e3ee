"""Small utilities of the gateway tests: background streams, SSE and error-body checks, Prometheus values, a
cutting relay in front of an engine, a port nothing listens on."""

from __future__ import annotations

import json
import re
import socket
import threading
from typing import Any

import httpx


class BackgroundStream:
    """A streamed POST read line by line in a thread, for tests that act while it runs (stop, swap...).

    ``start()`` returns once the first line arrived; ``finish()`` waits for the end. ``lines`` holds the
    non-empty lines; a connection cut mid-body is not an error here (``cut`` says so).
    """

    def __init__(self, url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        self.url, self.body, self.headers = url, body, headers or {}
        self.lines: list[str] = []
        self.cut = False
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)

    def _read(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, headers=self.headers, timeout=120) as response:
                for line in response.iter_lines():
                    if line:
                        self.lines.append(line)
                    self._started.set()
        except httpx.HTTPError:
            self.cut = True
        finally:
            self._started.set()

    def start(self, timeout_s: float = 60) -> BackgroundStream:
        self._thread.start()
        return self.wait_started(timeout_s)

    def wait_started(self, timeout_s: float = 60) -> BackgroundStream:
        assert self._started.wait(timeout_s) and self.lines, f"no line of the stream within {timeout_s}s"
        return self

    @staticmethod
    def start_together(*streams: BackgroundStream, timeout_s: float = 60) -> None:
        """Start every stream at once, then wait for the first line of each (streams that may end within a
        second or two are then all still running)."""
        for stream in streams:
            stream._thread.start()
        for stream in streams:
            stream.wait_started(timeout_s)

    def finish(self, timeout_s: float = 120) -> list[str]:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"the stream did not end within {timeout_s}s"
        return self.lines


def last_sse_event(lines: list[str]) -> tuple[str | None, dict[str, Any]]:
    """(event name, data) of the last event of an SSE stream, from its non-empty lines (``[DONE]`` skipped)."""
    kind, last = None, (None, {})
    for line in lines:
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: ") and line != "data: [DONE]":
            last, kind = (kind, json.loads(line[6:])), None
    return last


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    """The response has ``status`` and an OpenAI-shaped error body (and an X-Request-Id)."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert_no_internals(response)
    assert response.headers.get("x-request-id")
    if code is not None:
        assert body["error"]["code"] == code, body
    return body


def assert_no_internals(response: httpx.Response) -> None:
    """No traceback and no source file named in an error answer (a path to a .py file, or a frame's ``File "``); the
    request's own path, which an answer may echo ("no route /x.py"), is the client's and does not count, nor does a
    body field the answer names ("unknown field '.py'")."""
    text = response.text.replace(response.request.url.path, "<path>")
    assert "Traceback" not in text and 'File "' not in text and not re.search(r"/[\w./-]*\.py\b", text), response.text


class CuttingRelay:
    """A TCP relay in front of a real engine. Once :meth:`arm` is called, each connection forwards
    ``hold_after`` more bytes of answers, then holds the rest, until :meth:`cut` closes every connection: an
    upstream dying mid-stream at a chosen point.

    The real engine cannot be cut on demand at that point (a SIGKILL races streams that end in a second); this
    relay is a fake fault in front of it, named as one. Use it as ``with CuttingRelay(engine_url) as url:``.
    """

    def __init__(self, upstream_url: str, hold_after: int = 1500) -> None:
        host, port = upstream_url.removeprefix("http://").rsplit(":", 1)
        self.upstream = (host, int(port))
        self.hold_after = hold_after
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.listener.settimeout(0.2)
        self.holding = 0  # connections whose answer is held
        self.armed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> str:
        self._thread.start()
        return f"http://127.0.0.1:{self.listener.getsockname()[1]}"

    def __exit__(self, *exc: object) -> None:
        self.cut()
        self._stop.set()
        self._thread.join(2)
        self.listener.close()

    def arm(self) -> None:
        """From now on, hold each answer after ``hold_after`` bytes."""
        self.armed.set()

    def cut(self) -> None:
        """Close every relayed connection at once (both sides)."""
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except (TimeoutError, OSError):
                continue
            upstream = socket.create_connection(self.upstream)
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, self.hold_after), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket, limit: int | None) -> None:
        sent = 0
        try:
            while data := source.recv(65536):
                if limit is not None and not self.armed.is_set():
                    target.sendall(data)
                    continue
                if limit is not None and sent + len(data) > limit:
                    target.sendall(data[: max(0, limit - sent)])
                    with self._lock:
                        self.holding += 1
                    while source.recv(65536):  # hold the rest: read it, forward nothing
                        pass
                    return
                target.sendall(data)
                sent += len(data)
        except OSError:
            return


_HELD_CLOSED: list[socket.socket] = []


def closed_port_url() -> str:
    """A URL on which nothing listens, and nothing will: its port stays bound (never listening) by this test
    process, so no server started meanwhile can take it (a free port just picked once was, by another xdist
    worker's server: the "unreachable" engine answered slowly, a 504 instead of a 503)."""
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.bind(("127.0.0.1", 0))
    _HELD_CLOSED.append(held)
    return f"http://127.0.0.1:{held.getsockname()[1]}"
