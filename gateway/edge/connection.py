"""uvicorn's HTTP protocol with the limits a gateway facing the network needs, at the connection level.

uvicorn (httptools) has no limit on header size or count, no deadline for a request's headers, no idle
timeout for a connection that never sends a request, no write timeout towards a client that stops
reading, and answers malformed requests in plain text. Each of these lets an unauthenticated peer hold
memory, sockets or (through a stalled stream) a model's concurrency slot. :func:`guarded_protocol`
makes a subclass of uvicorn's ``HttpToolsProtocol`` that enforces :class:`HttpSettings`:

- more than ``max_connections`` open connections: the new one gets 503 and is closed at once; a key whose requests
  hold ``max_connections_per_key`` of them (unset: half) gets 503 for a request on another connection, so that one
  key's streams cannot take every connection (an fd-starved process has few);
- request line over ``max_url_bytes`` (414), head over ``max_header_bytes`` or ``max_headers`` (431):
  counted as bytes arrive while the head is incomplete, so a never-ending header cannot grow memory, and
  field by field as the parser hands them over, so a head that arrives whole in one read is counted too;
- a connection idle for ``keepalive_timeout_s`` (new or between requests) is closed; a request whose
  headers are not complete ``header_timeout_s`` after its first byte gets 408;
- a client that accepts no bytes for ``write_timeout_s`` while a response waits is disconnected (the
  app sees a disconnect: the stream stops, its upstream request and admission slot are released).

While the gateway drains (SIGTERM with ``gateway.shutdown_delay_s``) every response closes its connection, so that a
client holding a keep-alive connection opens its next one through the load balancer, to another replica.

Every rejection is OpenAI-shaped JSON with ``Connection: close``, followed by a lingering close: the gateway stops
writing, then reads and drops what the client still sends until it closes (at most :data:`LINGER_S` and
:data:`LINGER_BYTES`), because
closing a socket with unread bytes (a request body sent at once) sends a reset, and the client's TCP stack drops the
answer it had not read yet. The body timeout lives in the app
(:class:`gateway.edge.middleware.BodyLimitMiddleware`), which can still answer 408 there.
"""

from __future__ import annotations

import asyncio
import secrets
from itertools import chain
from typing import Any

import orjson
from loguru import logger
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from gateway.config import HttpSettings
from gateway.core.endpoints import dialect_for_path
from gateway.core.errors import Dialect, GatewayError
from gateway.core.headers import HEADER_MAP, first_values
from gateway.core.state import GatewayState
from gateway.edge.cycle import HTTP_CYCLE, GatewayCycle

LINGER_S = 2.0  # after a rejection, how long what the client still sends is read and dropped before the socket closes
LINGER_BYTES = 1 << 20  # ... and how much of it (a request body; a head that never ends is cut off sooner)


class _Rejected(Exception):
    """Raised from a parser callback to stop parsing; the answer is in ``protocol._rejection``."""


def rejection_bytes(error: GatewayError, dialect: Dialect = Dialect.OPENAI) -> bytes:
    """A complete HTTP/1.1 response for ``error`` that closes the connection (written to the transport)."""
    body = orjson.dumps(error.body(dialect))
    head = [
        STATUS_LINE[error.status],
        b"content-type: application/json\r\n",
        b"content-length: " + str(len(body)).encode() + b"\r\n",
        b"x-request-id: " + secrets.token_hex(16).encode() + b"\r\n",
        b"connection: close\r\n",
    ]
    head += [f"{name.lower()}: {value}\r\n".encode("latin-1") for name, value in error.headers.items()]
    return b"".join([*head, b"\r\n", body])


class GuardedHttpProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` plus the limits of ``limits`` (set on the subclass by :func:`guarded_protocol`)."""

    limits: HttpSettings = HttpSettings()
    gateway: GatewayState | None = None  # whose ``draining`` makes every response close its connection
    by_key: dict[int, int] = {}  # a hash of each key presented -> the open connections whose last request carried it

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._awaiting_head = True  # between requests, or inside a request line / headers
        self._head_bytes = 0  # bytes received while the head is incomplete
        self._parsed_head_bytes = 0  # the request target, as the parser hands it over (the fields: counted once whole)
        self._rejection: GatewayError | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._key: int | None = None  # (a hash of) the key this connection's last request presented, counted in by_key
        self._lingering = False  # rejected: what comes is read and dropped until the client closes
        self._dropped = 0  # bytes dropped while lingering

    # ------------------------------------------------------------------ connection
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            logger.warning("http: {} open connections (max_connections); refusing a new one", len(self.connections) - 1)
            message = f"the gateway has too many open connections ({self.limits.max_connections}); retry later"
            self._reject(GatewayError(503, message, code="too_many_connections", headers={"Retry-After": "1"}))
            return
        self._arm_head_timer(self.limits.keepalive_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        self._count_key(None)
        super().connection_lost(exc)
        if isinstance(self.cycle, GatewayCycle):
            self.cycle.client_gone()

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            self._dropped += len(data)
            if self._dropped > LINGER_BYTES:
                self.transport.close()
            return
        super().data_received(data)
        if not self._awaiting_head or self.transport.is_closing():
            return
        # Still inside a request line or headers: everything in this chunk was head.
        if self._head_bytes == 0:
            self._arm_head_timer(self.limits.header_timeout_s)
        self._head_bytes += len(data)
        if self._head_bytes > self.limits.max_header_bytes:
            self._reject(self._head_too_large())

    # ------------------------------------------------------------------ parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._awaiting_head = True
        self._parsed_head_bytes = 0

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._parsed_head_bytes += len(url)
        if len(self.url) > self.limits.max_url_bytes:
            self._rejection = GatewayError(414, f"request target is longer than {self.limits.max_url_bytes} bytes", code="uri_too_long")
            raise _Rejected

    def on_header(self, name: bytes, value: bytes) -> None:
        # uvicorn's, less its Expect check per field: the head's fields are checked once, as it completes (a client
        # SDK sends 15-20 of them, each through this callback)
        self.headers.append((name.lower(), value.rstrip(b" \t")))

    def on_headers_complete(self) -> None:
        self._awaiting_head = False
        self._head_bytes = 0
        self._cancel_head_timer()
        headers = self.headers
        # A head that arrived in one read was parsed whole before data_received could count it: counted here, in C
        # (a field's trailing whitespace, which its value drops, is not; the read that held it bounds it)
        if len(headers) > self.limits.max_headers:
            self._rejection = GatewayError(431, f"more than {self.limits.max_headers} header fields", code="headers_too_large")
            raise _Rejected
        if self._parsed_head_bytes + sum(map(len, chain.from_iterable(headers))) + 4 * len(headers) > self.limits.max_header_bytes:
            self._rejection = self._head_too_large()  # (4: ": " and CRLF)
            raise _Rejected
        found = self.scope[HEADER_MAP] = first_values(headers)  # every layer's header lookups (gateway.core.headers)
        if b"expect" in found:
            self.expect_100_continue = any(name == b"expect" and value.lower() == b"100-continue" for name, value in headers)
        self._hold_key_share(found)
        super().on_headers_complete()
        cycle = getattr(self, "cycle", None)
        if cycle is not None and cycle.scope is self.scope:
            cycle.__class__ = GatewayCycle  # uvicorn's, with a cheaper response start (its task has not run yet)
            self.scope.setdefault("extensions", {})[HTTP_CYCLE] = cycle
            if self.gateway is not None and self.gateway.draining:
                cycle.keep_alive = False  # uvicorn answers with "connection: close" and closes after the response

    def on_response_complete(self) -> None:
        # uvicorn's, less its keep-alive timer: the head timer armed below closes an idle connection (the same
        # keepalive_timeout_s), so a second timer armed and cancelled per request bought nothing
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self._unset_keepalive_if_required()
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
        if not self.transport.is_closing():
            self._awaiting_head = True
            self._head_bytes = 0
            # uvicorn's own keep-alive timer is cancelled by any byte; this one is not (slow headers).
            self._arm_head_timer(self.limits.keepalive_timeout_s)

    def send_400_response(self, msg: str) -> None:
        """uvicorn calls this on any parser error (ours included): answer in JSON, not plain text."""
        error, self._rejection = self._rejection, None
        self._reject(error or GatewayError(400, "invalid HTTP request", code="invalid_http_request"))

    # ------------------------------------------------------------------ writing
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.limits.write_timeout_s, self._write_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_timed_out(self) -> None:
        self._write_timer = None
        if not self.transport.is_closing():
            client = f"{self.client[0]}:{self.client[1]}" if self.client else "client"
            logger.warning("http: {} accepted no data for {:g}s; disconnecting it", client, self.limits.write_timeout_s)
            self.transport.abort()  # connection_lost() follows: the app sees http.disconnect

    # ------------------------------------------------------------------ a key's share of the connections
    def _hold_key_share(self, headers: dict[bytes, bytes]) -> None:
        """Count this connection for the key its request presents; refuse the request (503) when that key already
        holds its share of the connections on others. A request without a key is not counted (it is refused later)."""
        presented = headers.get(b"authorization")
        if presented is None:
            presented = headers.get(b"x-api-key")
        key = None if presented is None else hash(presented)
        if key is None or key == self._key:
            return
        share = self.limits.max_connections_per_key or max(1, self.limits.max_connections // 2)
        held = self.by_key.get(key, 0)
        if held >= share:
            logger.warning("http: a key holds {} open connections (its share of max_connections); refusing its request on another", held)
            message = f"this key holds {held} of the gateway's open connections, its share; close some or retry later"
            self._rejection = GatewayError(503, message, code="too_many_connections", headers={"Retry-After": "1"})
            raise _Rejected
        self._count_key(key)

    def _count_key(self, key: int | None) -> None:
        if self._key is not None:
            left = self.by_key[self._key] - 1
            if left:
                self.by_key[self._key] = left
            else:
                del self.by_key[self._key]
        self._key = key
        if key is not None:
            self.by_key[key] = self.by_key.get(key, 0) + 1

    # ------------------------------------------------------------------ helpers
    def _head_too_large(self) -> GatewayError:
        return GatewayError(431, f"request headers are larger than {self.limits.max_header_bytes} bytes", code="headers_too_large")

    def _arm_head_timer(self, delay_s: float) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(delay_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._awaiting_head or self.transport.is_closing():
            return
        if self._head_bytes == 0:
            self.transport.close()  # idle: nothing to answer
            return
        timeout = self.limits.header_timeout_s
        self._reject(GatewayError(408, f"request headers not received within {timeout:g}s", code="request_timeout"))

    def _reject(self, error: GatewayError) -> None:
        self._cancel_timers()
        if not self.transport.is_closing():
            # The request line may be known by now: answer in that route's dialect.
            path = getattr(self, "url", b"").split(b"?", 1)[0].decode("latin-1", errors="replace")
            self.transport.write(rejection_bytes(error, dialect_for_path(path)))
            self._linger()

    def _linger(self) -> None:
        """Stop writing (the client reads the answer, then the end), drop what it still sends, close once it closes
        (``eof_received``) or after :data:`LINGER_S`: a close with unread bytes would reset the connection."""
        self._lingering = True
        transport = self.transport
        try:
            transport.resume_reading()
            if transport.can_write_eof():
                transport.write_eof()
        except (OSError, RuntimeError):
            transport.close()
            return
        self.loop.call_later(LINGER_S, transport.close)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _cancel_timers(self) -> None:
        self._cancel_head_timer()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None


def guarded_protocol(limits: HttpSettings, gateway: GatewayState | None = None) -> type[GuardedHttpProtocol]:
    """A protocol class for ``uvicorn.Config(http=...)`` enforcing ``limits``; connections close after each response
    while ``gateway`` drains."""
    return type("GatewayHttpProtocol", (GuardedHttpProtocol,), {"limits": limits, "gateway": gateway, "by_key": {}})
