"""uvicorn's request-response cycle with a cheaper response: the same checks, head and body, in fewer steps.

uvicorn's ``send`` checks each response header's name and value with a regular expression of its own, one search per
name and one per value (about twelve for a proxied answer, whose every request pays them). Each expression is a
class of single characters, so one search over all the names joined (and one over the values) finds what the
per-header searches find: a header with a character that would break the response head is refused the same way
(``RuntimeError``). The head written is uvicorn's, byte for byte, and so is a body's (in one write, without the
coroutine uvicorn's ``send`` is); every other message (one while writing is paused, after a disconnect or the
response's end, a HEAD response's body) goes to uvicorn's own ``send``.

It also tells what waits on the client's behalf (a stream's relay, a plain request's exchange) when its client leaves
(:meth:`GatewayCycle.on_disconnect`, :class:`CancelOnLeave`), from the connection's loss, without a task waiting on
``receive()``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE, RequestResponseCycle

HTTP_CYCLE = "gateway.http_cycle"
"""``scope["extensions"]`` key of uvicorn's request-response cycle: a stream relay writes its events to the
client's transport through it (:class:`gateway.data.relay.SSEProxyResponse`) instead of one ASGI message each. The
cycle holds the scope: the key is taken out once a response the cycle writes itself is complete
(:meth:`GatewayCycle._write_body`), so that the two are freed by their counts, not left as a reference cycle (a dozen
objects a request) for the collector. A response that uvicorn's own ``send`` ends (HEAD, one ended while writing was
paused) or that its client left keeps the key, and the collector frees the pair as before."""

_SPECIAL = frozenset({b"content-length", b"transfer-encoding", b"connection"})  # the names uvicorn's start acts on
_LENGTH = frozenset({b"content-length"})
_NONE: dict[str, Any] = {}
_FIELD = b"%s: %s\r\n"  # a head's field, formatted in C over the start's (name, value) pairs


class GatewayCycle(RequestResponseCycle):
    """:class:`RequestResponseCycle` (its class replaced once uvicorn made it: the gateway's protocol,
    :mod:`gateway.edge.connection`) with :meth:`send` writing the response start (checked in two searches) and body
    as uvicorn does, and a callback for the client leaving (:meth:`on_disconnect`)."""

    _on_disconnect: Callable[[], None] | None = None  # (a class default: uvicorn's __init__ has run, not ours)

    def on_disconnect(self, callback: Callable[[], None] | None) -> None:
        """Have ``callback`` called (from the event loop, once) when the client goes away before the response is
        complete; None: no longer. A client gone already is told at the loop's next pass.

        What a task awaiting ``receive()`` for ``http.disconnect`` would learn, without the task: one made, run,
        cancelled and collected per stream cost more than the rest of a short answer's relay. Reading from the client
        is resumed, as that ``receive()`` would (a paused socket would not report the client leaving)."""
        self._on_disconnect = callback
        if callback is None:
            return
        if self.disconnected:
            self._on_disconnect = None
            asyncio.get_running_loop().call_soon(callback)
        elif not self.response_complete:
            self.flow.resume_reading()

    def whole_body(self) -> bytes | None:
        """The request's body when all of it is here (what ``receive()`` would return without waiting), taken as
        ``receive()`` takes it; None when ``receive()`` must be awaited: more to come, a ``100 Continue`` owed, the
        client gone, or nothing read yet. Spares a request the coroutine, the event's wait and the message around a
        body that came with its head."""
        if self.more_body or self.waiting_for_100_continue or self.disconnected or self.response_complete or not self.message_event.is_set():
            return None
        self.flow.resume_reading()
        self.message_event.clear()
        body, self.body = bytes(self.body), bytearray()
        return body

    def client_gone(self) -> None:
        """The connection was lost (the protocol's ``connection_lost``): the callback, once, if the response was not
        complete."""
        callback, self._on_disconnect = self._on_disconnect, None
        if callback is not None and self.disconnected:
            callback()

    def send(self, message: Any) -> Awaitable[None]:  # type: ignore[override]
        """uvicorn's ``send`` (its coroutine), or, for a start or a body written at once, nothing left to wait for."""
        if self.disconnected or self.flow.write_paused or self.response_complete:
            return super().send(message)  # (uvicorn waits for the drain, or drops or refuses the message)
        if self.response_started:
            if message["type"] != "http.response.body" or self.scope["method"] == "HEAD":
                return super().send(message)
            self._write_body(message.get("body", b""), message.get("more_body", False))
            return _WRITTEN
        if self.access_log or message["type"] != "http.response.start":
            return super().send(message)
        self.response_started = True  # (before the checks, as uvicorn: a refused head is not followed by a 500)
        self.waiting_for_100_continue = False
        status_code = message["status"]
        headers = self.default_headers + list(message.get("headers", []))
        names, values = zip(*headers, strict=True) if headers else ((), ())
        if HEADER_RE.search(b"".join(names)):
            raise RuntimeError("Invalid HTTP header name.")
        if HEADER_VALUE_RE.search(b"".join(values)):
            raise RuntimeError("Invalid HTTP header value.")
        lowered = b"\0".join(names).lower().split(b"\0") if names else []  # (a name with a NUL was refused above)
        special = _SPECIAL.intersection(lowered)
        if special and special != _LENGTH:
            return self._start_in_order(status_code, headers)
        if special and self.chunked_encoding is None:  # content-length (the first one, where there are several)
            self.expected_content_length = int(values[lowered.index(b"content-length")].decode())
            self.chunked_encoding = False
        return self._write_head([STATUS_LINE[status_code], *map(_FIELD.__mod__, zip(lowered, values, strict=True))], status_code, False)

    def _start_in_order(self, status_code: int, headers: list[tuple[bytes, bytes]]) -> Awaitable[None]:
        """The head of a start whose fields frame the body or the connection otherwise than by a content-length
        (transfer-encoding, connection): read in order, as uvicorn reads them (a chunked encoding wins over an earlier
        length, not over a later one)."""
        content = [STATUS_LINE[status_code]]
        has_connection_close = False
        for name, value in headers:
            name = name.lower()
            if name in _SPECIAL:
                if name == b"content-length" and self.chunked_encoding is None:
                    self.expected_content_length = int(value.decode())
                    self.chunked_encoding = False
                elif name == b"transfer-encoding" and value.lower() == b"chunked":
                    self.expected_content_length = 0
                    self.chunked_encoding = True
                elif name == b"connection" and b"close" in [token.lower().strip() for token in value.split(b",")]:
                    self.keep_alive = False
                    has_connection_close = True
            content += (name, b": ", value, b"\r\n")
        return self._write_head(content, status_code, has_connection_close)

    def _write_head(self, content: list[bytes], status_code: int, has_connection_close: bool) -> Awaitable[None]:
        """The head's fields ``content`` (after its status line) ended as uvicorn ends them, and written."""
        if not self.keep_alive and not has_connection_close:
            content.append(b"connection: close\r\n")
        if self.chunked_encoding is None and self.scope["method"] != "HEAD" and status_code not in (204, 304):
            self.chunked_encoding = True  # neither content-length nor transfer-encoding given
            content.append(b"transfer-encoding: chunked\r\n")
        content.append(b"\r\n")
        self.transport.write(b"".join(content))
        return _WRITTEN

    def _write_body(self, body: bytes, more_body: bool) -> None:
        """uvicorn's body write (not for HEAD), in one write: a chunk or the bytes of the declared length, and at the
        end the last chunk, the checks of the length and the response's completion."""
        if self.chunked_encoding:
            if more_body:
                if body:
                    self.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
            else:
                self.transport.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body) if body else b"0\r\n\r\n")
        else:
            if len(body) > self.expected_content_length:
                raise RuntimeError("Response content longer than Content-Length")
            self.expected_content_length -= len(body)
            self.transport.write(body)
        if not more_body:
            if self.expected_content_length != 0:
                raise RuntimeError("Response content shorter than Content-Length")
            self.response_complete = True
            self.message_event.set()
            if not self.keep_alive:
                self.transport.close()
            self.on_response()
            self.scope.get("extensions", _NONE).pop(HTTP_CYCLE, None)  # (read only as the request starts)


class _Written:
    """An awaitable with nothing to wait for (the start is written when ``send`` returns it)."""

    __slots__ = ()

    def __await__(self) -> Iterator[None]:
        return iter(())


_WRITTEN = _Written()


class CancelOnLeave:
    """A client-leaving callback (:meth:`GatewayCycle.on_disconnect`, or a watcher task's end) that cancels the task
    that made it, while that task still waits on the client's behalf: an answer then stops where it waits, in the
    request's own task, with no task of its own to make and collect."""

    __slots__ = ("task", "waiting", "gone")

    def __init__(self) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self.waiting = True
        self.gone = False  # the client left, and the task was cancelled for it

    def __call__(self) -> None:
        if self.waiting:
            self.gone = True
            self.task.cancel()

    def done(self) -> None:
        """No longer waiting: a client leaving from now on cancels nothing."""
        self.waiting = False

    def was_the_cause(self) -> bool:
        """In an ``except CancelledError``: whether the client's leaving alone cancelled the task (then taken back, and
        the task goes on to note it); False: another cancellation, which must propagate."""
        return self.gone and self.task.uncancel() == 0
