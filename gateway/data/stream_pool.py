"""Requests to the engines over pooled HTTP/1.1 connections whose body bytes arrive by callback: streams relayed as
they come, plain answers read whole (a pool of their own, which keeps each answer's ``Content-Type``).

A GPU engine at high batch sends one SSE event per running request per decode step: hundreds of streams,
each a small write every 10-30 ms. Relaying that through a client library's stream reader costs a task
wake-up, a future and a few coroutine frames per event. Here the response is parsed by ``httptools`` (the
C parser uvicorn uses) inside the socket's ``data_received``, and what each read brought goes straight to the
exchange's sink, which relays it in the same callback (:mod:`gateway.relay`): no task runs per event, and
events that arrived together leave together. Only while the process falls behind its own work (its loop runs
timers late: :mod:`gateway.data.loop_lag`) does each stream rest a while after a read, so that its next read
and write carry several events: the gap that adds follows the lag the process already has.

Everything else about the exchange keeps the guarantees of the pooled client: connections are kept alive and
reused (idle ones for :data:`KEEPALIVE_S`, under the engines' own keep-alive), a connection that breaks is
never reused, a stream cut short closes its connection (the engine aborts the request), the read timeout is
the longest silence between upstream bytes, and every read is acknowledged at once where the OS allows it
(``TCP_QUICKACK``, set once per response: an upstream without ``TCP_NODELAY``, such as SGLang's router,
otherwise holds each small write for the gateway's delayed ACK). There is no cap on concurrent connections unless one is configured;
waiting for a slot under a configured cap is :class:`UpstreamPoolFull`, never an engine timeout.
"""

from __future__ import annotations

import asyncio
import math
import os
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import httptools
from loguru import logger

from gateway.data.loop_lag import PROBE_S, LagGauge, LoopLag
from gateway.data.native_streams import BUILT as NATIVE_BUILT
from gateway.data.native_streams import NativeOwner, NativeStreams

KEEPALIVE_S = 4.0  # idle connections kept this long: under uvicorn's (SGLang's server) 5 s keep-alive
_MAX_IDLE_PER_HOST = 1024
_DNS_TTL_S = 300.0
_REST_TICK_S = PROBE_S  # rests end on a grid of 5 ms ticks (each up to a tick late): one timer per tick, not per rest
_LAG_FLOOR_S = 0.005  # below this mean loop lag the process keeps up: every event goes as it comes
_REST_PER_LAG = 8.0  # a rest is this many times the mean lag (at the floor, 40 ms: two 20 ms decode steps)
_AFTER_REST_S = 0.05  # a silence check that falls in a rest waits this long past its end (the read comes first)
_MAX_RAW = 64 * 1024  # a response's bytes kept until its stream is handed to the native relay (beyond: stays in Python)


class UpstreamUnreachable(ConnectionError):
    """The engine's address refused or could not be resolved: nothing was sent."""


class UpstreamConnectTimeout(TimeoutError):
    """No TCP connection to the engine within the connect timeout: nothing was sent."""


class UpstreamReadTimeout(TimeoutError):
    """The engine sent nothing for the read timeout."""


class UpstreamConnectionLost(ConnectionError):
    """The connection broke (or the engine closed it) before the response was complete."""


class UpstreamPoolFull(ConnectionError):
    """Every connection the configured cap (``upstream_max_connections``) allows is busy, for the connect timeout."""


_QUICKACK = hasattr(socket, "TCP_QUICKACK")


class QuickAck:
    """Acknowledge every read of a TCP connection at once (Linux ``TCP_QUICKACK``), cheaply.

    An upstream that does not set ``TCP_NODELAY`` (SGLang's router) holds each small write, such as one SSE
    event, until its previous one is acknowledged; Linux delays that ACK (up to 40 ms) on a reused connection.
    What sends the kernel back to delayed ACKs ("pingpong" mode) is the gateway sending data soon after it
    received some: the request written on a reused connection. Nothing the gateway does while it reads a
    response does, so the flag is set once per response, at its first read (which also sends an ACK still
    pending), unless that read held the whole response (nothing is left to acknowledge early); from then on the kernel acknowledges each small segment as it is read. (Set at every read, it cost
    a system call per relayed event.) The calls go through a duplicate of the socket made once: uvloop's
    ``get_extra_info("socket")`` builds and discards a socket object on every call."""

    __slots__ = ("_sock",)

    def __init__(self, transport: asyncio.BaseTransport) -> None:
        self._sock: socket.socket | None = None
        sock = transport.get_extra_info("socket")
        if _QUICKACK and sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                self._sock = socket.socket(sock.family, sock.type, sock.proto, fileno=os.dup(sock.fileno()))
            except OSError:
                self._sock = None

    def rearm(self) -> None:
        if self._sock is not None:
            try:
                self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
            except OSError:  # a socket closing under us: nothing left to acknowledge
                self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


Sink = Callable[[bytes], None]  # one read's body
Finishing = Callable[[bytes], bool]  # whether a read says the stream is finishing (asked only when a rest would follow)
EndSink = Callable[[BaseException | None], None]


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection to an engine; one request at a time, its response parsed as bytes arrive."""

    def __init__(self, pool: StreamPool, key: tuple[str, str, int], quickack: bool = True) -> None:
        self.pool = pool
        self.key = key
        self.quickack = quickack
        self.transport: asyncio.Transport | None = None
        self._ack: QuickAck | None = None
        self.exchange: StreamExchange | None = None
        self.sink: Sink | None = None  # the exchange's relay, called once per read with what the read brought
        self.finishing: Finishing | None = None  # the relay's: does a read say the stream is finishing (no rest then)
        self._pieces: list[bytes] = []  # the body pieces (HTTP chunks) of the read being parsed
        # httptools' body callback, the list's own append: no Python runs per HTTP chunk (a streamed answer's every event)
        self.on_body = self._pieces.append
        self.parser: Any = None
        self.raw: list[bytes] | None = None  # the response's bytes so far, while it may still go native
        self._raw_size = 0
        self.idle_since = 0.0
        self.used = False  # has carried a request before (a broken reuse may be retried once)
        self.lost = False

    # -------------------------------------------------------------- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self.quickack:
            self._ack = QuickAck(transport)

    def data_received(self, data: bytes) -> None:
        exchange = self.exchange
        if exchange is None or self.parser is None:  # bytes nobody asked for: the connection cannot be trusted
            self.abort()
            return
        exchange.last_read = time.monotonic()
        raw = self.raw
        if raw is not None:  # (one append per read, until the stream goes native: its first read or two)
            raw.append(data)
            self._raw_size += len(data)
            if self._raw_size > _MAX_RAW:
                self.raw = None
        first = not exchange.received
        exchange.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._deliver(rest=False)  # the events before the malformed bytes, then the failure
            exchange.failed(UpstreamConnectionLost(f"malformed response from the engine: {error}"))
            self.abort()
            return
        if first and self._ack is not None and not exchange.is_complete:  # once per response: see QuickAck
            self._ack.rearm()  # (an answer whole in its first read leaves nothing to acknowledge at once)
        self._deliver(rest=True)

    def _deliver(self, rest: bool) -> None:
        """What one read brought, to the relay in one call: an engine that got ahead (several events waiting
        in the socket, as under load) costs one write to the client, not one per event. While the process falls
        behind (:meth:`StreamPool.rest_for`), the exchange then rests (reads nothing) for a while, so that what
        the engine sends meanwhile comes in one read; unless the read says the stream is finishing (its end, and
        the engine's slot, then come without the wait). That is asked only when a rest would follow: while the
        process keeps up, a read costs no scan for it."""
        pieces = self._pieces
        if pieces:
            body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            pieces.clear()
            sink = self.sink
            if sink is None:  # before the relay (an error answer, or what came with a stream's head): kept for it
                if self.exchange is not None:
                    self.exchange.body(body)
            else:
                sink(body)
                exchange = self.exchange
                if rest and exchange is not None and exchange.native is None:
                    pool = self.pool
                    pool.lag.start()  # a stream still coming in: its rests follow the loop's lag (an answer whole in its first read never asks)
                    seconds = pool.rest_for()
                    finishing = self.finishing
                    if seconds and not (finishing is not None and finishing(body)):
                        exchange.rest(seconds)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self._ack is not None:
            self._ack.close()
        self.pool.forget(self)
        exchange, self.exchange = self.exchange, None
        if exchange is not None:
            exchange.failed(UpstreamConnectionLost("the engine closed the connection" + (f": {exc}" if exc else "")))

    # -------------------------------------------------------------- httptools callbacks
    def on_headers_complete(self) -> None:
        if self.exchange is not None:
            self.exchange.headers_done(self.parser.get_status_code(), self.parser.should_keep_alive())

    def on_message_complete(self) -> None:
        exchange = self.exchange
        if exchange is not None:
            exchange.ending = True  # (the relay may keep these last events to write them with the end)
        self._deliver(rest=False)  # the last events before the end
        if exchange is not None:
            exchange.complete()

    # -------------------------------------------------------------- used by the exchange and the pool
    def send(self, exchange: StreamExchange, request: bytes) -> None:
        assert self.transport is not None
        self.exchange = exchange
        self.sink = self.finishing = None
        self._pieces.clear()
        self.raw, self._raw_size = ([] if self.pool.native_enabled else None), 0
        self.parser = httptools.HttpResponseParser(self)
        self.transport.write(request)

    def abort(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()

    def reusable(self) -> bool:
        return not self.lost and self.transport is not None and not self.transport.is_closing()


_FRAMING = frozenset({b"content-length", b"transfer-encoding"})  # the headers that say where an answer's body ends


class _TypedConnection(_Connection):
    """A connection whose responses keep their ``Content-Type`` (a plain answer goes back with it; a stream's is the
    relay's own, so stream connections run no Python per header), and whose body may end where the connection does.

    An answer with neither a length nor chunks (HTTP/1.0's way, still allowed in 1.1) ends when the server closes the
    connection: that close is its end, not a loss, as for any HTTP client. The parser is never told of the close
    (``httptools`` has no call for it), so the connection completes such an answer itself."""

    framed = False  # the answer being read declared its length or its chunks

    def send(self, exchange: StreamExchange, request: bytes) -> None:
        self.framed = False
        super().send(exchange, request)

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-type":
            if self.exchange is not None:
                self.exchange.content_type = value.decode("latin-1")
        elif name in _FRAMING:
            self.framed = True

    def connection_lost(self, exc: Exception | None) -> None:
        exchange = self.exchange
        if exc is None and exchange is not None and self._ends_at_close(exchange):
            self.on_message_complete()  # (what came since the last read, then the exchange completes)
        super().connection_lost(exc)

    def _ends_at_close(self, exchange: StreamExchange) -> bool:
        """Whether the answer being read is one whose body the server's close ends: its head came (a status), it declared
        no length and no chunks, and it may have a body (not 1xx, 204 or 304)."""
        status = exchange.status
        return not self.framed and status >= 200 and status not in (204, 304) and not exchange.is_complete


class StreamExchange:
    """One streamed request: await :meth:`head`, then :meth:`read` (an error answer) or :meth:`relay` (a 200)."""

    __slots__ = (
        "connection", "status", "keep_alive", "last_read", "received", "_head", "_buffer", "_end",
        "_complete", "_error", "_done", "_timer", "_read_timeout_s", "_released", "_holds", "_rest_until", "native", "ending",
        "content_type",
    )  # fmt: skip

    def __init__(self, connection: _Connection, read_timeout_s: float) -> None:
        self.connection = connection
        self.status = 0
        self.keep_alive = False
        self.last_read = time.monotonic()
        self.received = False  # any byte of the response came
        loop = asyncio.get_running_loop()
        self._head: asyncio.Future[None] = loop.create_future()
        self._done: asyncio.Future[None] | None = None  # for read()
        self._buffer: list[bytes] = []
        self._end: EndSink | None = None
        self._complete = False
        self.ending = False  # the response's end has been read: what is delivered now is its last (set before it)
        self._error: BaseException | None = None
        self._read_timeout_s = read_timeout_s
        self._timer: asyncio.TimerHandle | None = loop.call_later(read_timeout_s, self._check_silence)
        self._released = False
        self._holds: set[str] = set()  # why reading is paused: "client" (its socket is full), "rest" (coalescing)
        self._rest_until: float | None = None  # resting until this loop time (its wake-up tick in the pool)
        self.native: tuple[NativeStreams, int] | None = None  # relayed by the native thread: (its streams, this one)
        self.content_type: str | None = None  # the response's, in a pool of plain answers

    @property
    def is_complete(self) -> bool:
        """The whole response came (its end was read)."""
        return self._complete

    # -------------------------------------------------------------- what the connection reports
    def headers_done(self, status: int, keep_alive: bool) -> None:
        self.status = status
        self.keep_alive = keep_alive
        if not self._head.done():
            self._head.set_result(None)

    def body(self, data: bytes) -> None:
        """A body piece before :meth:`relay` (an error answer, or what came with a stream's head)."""
        self._buffer.append(data)

    def complete(self) -> None:
        self._complete = True
        self._stop_timer()
        self._stop_rest()
        self._finish(None)

    def failed(self, error: BaseException) -> None:
        if self._complete or self._error is not None:
            return
        self.leave_native()
        self._error = error
        self._stop_timer()
        self._stop_rest()
        if not self._head.done():
            self._head.set_exception(error)
        self._finish(error)

    def _finish(self, error: BaseException | None) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_result(None)
        end, self._end = self._end, None
        if end is not None:
            end(error)

    def _check_silence(self) -> None:
        if self.native is not None:  # the native thread reads: its last read counts
            at = self.native[0].last_read(self.native[1])
            if at is not None and at > self.last_read:
                self.last_read = at
        if self._rest_until is not None:  # not reading on purpose: look again once what came meanwhile has been read
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self._rest_until - loop.time() + _AFTER_REST_S, self._check_silence)
            return
        silent = time.monotonic() - self.last_read
        if silent < self._read_timeout_s:
            self._timer = asyncio.get_running_loop().call_later(self._read_timeout_s - silent, self._check_silence)
            return
        self._timer = None
        self.failed(UpstreamReadTimeout(f"no bytes from the engine for {self._read_timeout_s:g}s"))
        self.connection.abort()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -------------------------------------------------------------- what the proxy uses
    async def head(self) -> None:
        await self._head

    async def read(self) -> bytes:
        """The whole body (an error answer); raises what broke the exchange."""
        if not self._complete and self._error is None:
            self._done = asyncio.get_running_loop().create_future()
            await self._done
        if self._error is not None:
            raise self._error
        return b"".join(self._buffer)

    def relay(self, on_data: Sink, on_end: EndSink, finishing: Finishing | None = None) -> None:
        """From now on each body piece goes to ``on_data`` as it is parsed; ``on_end(None | error)`` once at the end.
        Pieces that came with the head are handed over first, together. ``finishing`` says whether a read shows the
        stream finishing (a finish reason: its last events follow at once): such a read is not followed by a rest."""
        buffered, self._buffer = self._buffer, []
        if buffered:  # what came with the head (an engine that answered at once: often the whole stream), in one call
            on_data(buffered[0] if len(buffered) == 1 else b"".join(buffered))
        if self._complete or self._error is not None:
            on_end(self._error)
            return
        self._end = on_end
        self.connection.sink = on_data
        self.connection.finishing = finishing

    def pause_reading(self, why: str = "client") -> None:
        """Read nothing from the engine until :meth:`resume_reading` with the same ``why`` (and every other
        reason to pause is gone): the client's socket is full ("client"), or the exchange rests ("rest")."""
        if not self._holds:
            transport = self.connection.transport
            if transport is not None and not transport.is_closing():
                transport.pause_reading()
        self._holds.add(why)

    def resume_reading(self, why: str = "client") -> None:
        if why not in self._holds:
            return
        self._holds.remove(why)
        if not self._holds:
            transport = self.connection.transport
            if transport is not None and not transport.is_closing():
                transport.resume_reading()

    def rest(self, seconds: float) -> None:
        """Read nothing for ``seconds`` (:meth:`StreamPool.rest_for`): what the engine sends meanwhile waits in
        the socket and is then read, and relayed, in one read and one write."""
        if self._rest_until is None and not self._released and not self._complete:
            self.pause_reading("rest")
            self._rest_until = self.connection.pool.wake_later(self, seconds)

    def rested(self, at: float) -> None:
        """The wake-up tick ``at`` came (the pool's): read again, unless this exchange stopped resting meanwhile."""
        if self._rest_until == at:
            self._rest_until = None
            self.resume_reading("rest")

    def _stop_rest(self) -> None:
        self._rest_until = None
        self.resume_reading("rest")

    def close(self) -> None:
        """Cut the exchange: the connection is closed (the engine sees the client go and aborts the request)."""
        if self._released:
            return
        self.leave_native()
        self._released = True
        self._stop_timer()
        self._stop_rest()
        self._end = None
        self.connection.exchange = self.connection.sink = self.connection.finishing = None
        self.connection.abort()
        self.connection.pool.release(self.connection, reuse=False)

    # -------------------------------------------------------------- the native relay (gateway.data.native_streams)
    @property
    def can_go_native(self) -> bool:
        """Whether the stream may still be handed to the native relay (its bytes so far are kept)."""
        return self.native is None and self.connection.raw is not None and self.connection.pool.native_enabled

    def go_native(
        self, client_fd: int, pending: bytes, needles: list[list[bytes]], kind: int, chunked: bool, owner: NativeOwner
    ) -> bool:
        """Hand the rest of the body to the native relay, which writes its events to ``client_fd`` (a duplicate is
        taken) after ``pending`` (the partial event the relay holds), and hands back to ``owner`` the events holding
        one of ``needles[kind]``: True once it reads instead of the loop. Only for a chunked body that goes on, over
        plain TCP, while nothing pauses reading; False leaves everything as it was (``can_go_native`` says whether a
        later try may succeed). The thread replays the body so far through its own chunk parser: a body that ended or
        broke in it (asked from inside the parser's last callbacks) is refused there."""
        connection = self.connection
        if (
            self._holds or self._complete or self._error is not None or self._released
            or self.native is not None or connection.transport is None or connection.key[0] != "http"
        ):  # fmt: skip
            return False
        raw, connection.raw = connection.raw, None
        if raw is None:
            return False
        data = b"".join(raw)
        head_end = data.find(b"\r\n\r\n")
        sock = connection.transport.get_extra_info("socket")
        if head_end < 0 or b"\r\ntransfer-encoding: chunked" not in data[:head_end].lower() or sock is None:
            return False
        native = connection.pool.native_streams(needles)
        if native is None:
            return False
        try:
            upstream_fd = os.dup(sock.fileno())
        except OSError:  # out of descriptors: this stream stays in Python
            return False
        try:
            client_dup = os.dup(client_fd)
        except OSError:
            os.close(upstream_fd)
            return False
        self.pause_reading("native")  # before the thread reads: one reader of the socket at a time
        stream = native.attach(upstream_fd, client_dup, data[head_end + 4 :], pending, kind, chunked, owner)
        if stream is None:
            os.close(upstream_fd)
            os.close(client_dup)
            self.resume_reading("native")
            return False
        self.native = (native, stream)
        return True

    def leave_native(self) -> None:
        """Take the stream back from the native relay (cut or failed here): its owner gets what was relayed."""
        if self.native is None:
            return
        (native, stream), self.native = self.native, None
        native.detach(stream)

    def native_ended(self, outcome: str, detail: str, reusable: bool) -> None:
        """The native relay read the body to its end ("end": the connection goes back to the loop, kept alive when
        ``reusable``), or it broke ("lost", "malformed")."""
        self.native = None
        if outcome == "end":
            self.keep_alive = self.keep_alive and reusable
            self.resume_reading("native")
            self.complete()
        elif outcome == "lost":
            self.failed(UpstreamConnectionLost("the engine closed the connection" + (f": {detail}" if detail else "")))
        else:
            self.failed(UpstreamConnectionLost(f"malformed response from the engine: {detail}"))

    def release(self) -> None:
        """Done with it: a complete response gives its connection back to the pool; anything else closes it."""
        if self._released:
            return
        if not (self._complete and self.keep_alive and self.connection.reusable()):
            self.close()
            return
        self._released = True
        self._end = None
        self.resume_reading("client")  # (a client still reading the end: the next request must be read)
        self.connection.exchange = self.connection.sink = self.connection.finishing = None
        self.connection.pool.release(self.connection, reuse=True)


class StreamPool:
    """Keep-alive connections to the engines, by (scheme, host, port); unbounded unless ``max_connections``."""

    def __init__(
        self,
        connect_timeout_s: float,
        read_timeout_s: float,
        max_connections: int | None = None,
        coalesce_s: float = 0.0,
        coalesce_min_streams: int = 0,
        lag: LagGauge | None = None,
        native: bool = False,
        plain: bool = False,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        # plain: a pool of plain answers, read whole. Each keeps its Content-Type (it goes back with the answer). And a
        # kept-alive connection that breaks before any byte of the answer came is not taken for one the engine closed as
        # it was reused (a stream's request is then sent once more on a new one): an engine sends nothing of a plain
        # answer before it is whole, so the break may be the engine dying under a request it ran.
        self.plain = plain
        self._connection_class = _TypedConnection if plain else _Connection
        self.coalesce_s = coalesce_s  # gateway.stream_coalesce_ms: the longest rest after a read, while behind
        self.coalesce_min_streams = coalesce_min_streams  # gateway.stream_coalesce_min_streams: from how many streams on
        self.read_timeout_s = read_timeout_s
        self.max_connections = max_connections
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._busy = 0
        self._slot_freed: asyncio.Event | None = None
        self._dns: dict[tuple[str, int], tuple[float, str]] = {}
        self._targets: dict[str, tuple[tuple[str, str, int], str, str]] = {}  # base URL -> (key, path prefix, Host)
        self._ssl: ssl.SSLContext | None = None
        self._closed = False
        # resting exchanges by wake-up tick: one timer per tick, not per rest, and the streams woken together are
        # read in one turn of the loop
        self._wakeups: dict[float, list[StreamExchange]] = {}
        self.lag: LagGauge = lag or LoopLag(self._may_rest)  # probed while a stream may rest
        # gateway.relay_native, where the extension is built: streams go to a native relay thread once their head passed
        self.native_enabled = native and NATIVE_BUILT
        self._native: NativeStreams | None = None

    def native_stats(self) -> dict[str, int] | None:
        """The native relay thread's counts (live streams, events and reads it relayed); None until it started."""
        return self._native.stats() if self._native is not None else None

    def native_streams(self, needles: list[list[bytes]]) -> NativeStreams | None:
        """The native relay thread of this pool (started at its first stream, with the relay's ``needles``); None
        when it cannot start (said once: every stream is then relayed in Python)."""
        if self._native is None and self.native_enabled:
            try:
                self._native = NativeStreams(needles)
            except OSError as error:
                self.native_enabled = False
                logger.error("native relay: its thread did not start ({}): streams are relayed in Python", error)
        return self._native

    @property
    def busy(self) -> int:
        """Connections carrying a request now."""
        return self._busy

    def wake_later(self, exchange: StreamExchange, seconds: float) -> float:
        """Have ``exchange.rested`` called ``seconds`` from now, rounded up to a 5 ms tick: returns the tick's
        loop time."""
        loop = asyncio.get_running_loop()
        at = math.ceil((loop.time() + seconds) / _REST_TICK_S) * _REST_TICK_S
        resting = self._wakeups.get(at)
        if resting is None:
            resting = self._wakeups[at] = []
            loop.call_at(at, self._wake, at)
        resting.append(exchange)
        return at

    def _wake(self, at: float) -> None:
        for exchange in self._wakeups.pop(at, ()):
            exchange.rested(at)

    def _may_rest(self) -> bool:
        """Whether a stream may rest now (what the loop's lag is measured for): one is relayed in Python (a stream's
        first reads, or every read where the native relay is off), rests are on, and enough streams run. Streams the
        native thread relays never rest: a gateway whose streams are all there wakes its loop only for their reports."""
        native = self._native.live if self._native is not None else 0
        return self.coalesce_s > 0 and self._busy > native and self._busy >= self.coalesce_min_streams

    def rest_for(self) -> float:
        """How long a stream rests after a read now: 0 while the process keeps up (its loop's mean lag under 5 ms),
        or when ``stream_coalesce_ms`` is 0 or the pool carries fewer than ``stream_coalesce_min_streams`` streams;
        else 8x the lag, up to ``stream_coalesce_ms``. So the gap a rest adds follows how far behind the process
        already is, and a rest is only taken when it spans a few decode steps (one shorter than the engine's next
        event costs a pause, a resume and a timer, and saves no read)."""
        lag = self.lag.lag_s
        if lag < _LAG_FLOOR_S or self._busy < self.coalesce_min_streams:
            return 0.0
        return min(self.coalesce_s, lag * _REST_PER_LAG)

    async def request(
        self, base_url: str, path: str, payload: bytes, headers: dict[str, str], *, quickack: bool = True
    ) -> StreamExchange:
        """Send ``POST base_url+path`` and wait for the response head; raises the Upstream* errors above.

        ``quickack=False``: the upstream is known to send each write at once (``TCP_NODELAY``, as SGLang's own
        server does), so acknowledging every read at once (one more system call per event) buys nothing."""
        key, prefix, netloc = self._target(base_url)
        head = [f"POST {(prefix + path) or '/'} HTTP/1.1\r\nHost: {netloc}\r\nContent-Length: {len(payload)}\r\n"]
        head += [f"{name}: {value}\r\n" for name, value in headers.items()]
        request = "".join(head).encode("latin-1") + b"\r\n" + payload
        await self._take_slot()
        for attempt in (1, 2):
            try:
                connection = self._idle_connection(key) or await self._connect(key, quickack)
            except BaseException:
                self._give_slot()
                raise
            exchange = StreamExchange(connection, self.read_timeout_s)  # holds the slot from here on
            reused, connection.used = connection.used, True
            connection.send(exchange, request)
            try:
                await exchange.head()
                return exchange
            except UpstreamConnectionLost:
                exchange.close()
                # A stream's kept-alive connection the engine closed just as it was reused: nothing was processed.
                if self.plain or not (reused and attempt == 1 and not exchange.received):
                    raise
            except BaseException:
                exchange.close()
                raise
            await self._take_slot()
        raise AssertionError("unreachable: the second attempt returns or raises")

    def release(self, connection: _Connection, reuse: bool) -> None:
        self._give_slot()
        if reuse and not self._closed and connection.reusable():
            idle = self._idle.setdefault(connection.key, [])
            if len(idle) < _MAX_IDLE_PER_HOST:
                connection.idle_since = time.monotonic()
                idle.append(connection)
                return
        connection.abort()

    def forget(self, connection: _Connection) -> None:
        """A connection is gone: never hand it out again."""
        self._open.discard(connection)
        idle = self._idle.get(connection.key)
        if idle and connection in idle:
            idle.remove(connection)

    async def close(self) -> None:
        self._closed = True
        if self._native is not None:
            self._native.close()
        for connection in list(self._open):
            connection.abort()
        self._idle.clear()

    # -------------------------------------------------------------- internals
    def _target(self, base_url: str) -> tuple[tuple[str, str, int], str, str]:
        """(scheme, host, port), path prefix and Host header of ``base_url``, parsed once per URL."""
        target = self._targets.get(base_url)
        if target is None:
            if len(self._targets) > 1024:  # backends come and go with swaps; never grow without bound
                self._targets.clear()
            parts = urlsplit(base_url)
            scheme = parts.scheme or "http"
            key = (scheme, parts.hostname or "127.0.0.1", parts.port or (443 if scheme == "https" else 80))
            target = self._targets[base_url] = (key, parts.path.rstrip("/"), parts.netloc)
        return target

    def _idle_connection(self, key: tuple[str, str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            connection = idle.pop()  # the most recently used: the least likely to be closing
            if connection.reusable() and now - connection.idle_since < KEEPALIVE_S:
                return connection
            connection.abort()
        return None

    async def _connect(self, key: tuple[str, str, int], quickack: bool) -> _Connection:
        scheme, host, port = key
        loop = asyncio.get_running_loop()
        connection = self._connection_class(self, key, quickack)
        try:
            # One deadline for the name and the connection, as a scope rather than wait_for: wait_for runs what it
            # waits for as a task of its own, one more pass of the loop per new connection, and a pass of a loop
            # relaying a thousand streams takes tens of milliseconds (every new stream's time to first token).
            async with asyncio.timeout(self.connect_timeout_s):
                address = await self._resolve(host, port)  # (a cached name returns without suspending)
                tls: dict[str, Any] = {}
                if scheme == "https":
                    self._ssl = self._ssl or ssl.create_default_context()
                    tls = {"ssl": self._ssl, "server_hostname": host}
                await loop.create_connection(lambda: connection, address, port, **tls)
        except TimeoutError:
            raise UpstreamConnectTimeout(f"no connection to {host}:{port} within {self.connect_timeout_s:g}s") from None
        except OSError as error:
            raise UpstreamUnreachable(f"cannot connect to {host}:{port}: {error}") from None
        self._open.add(connection)
        return connection

    async def _resolve(self, host: str, port: int) -> str:
        cached = self._dns.get((host, port))
        now = time.monotonic()
        if cached is not None and cached[0] > now:
            return cached[1]
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        if not infos:
            raise OSError(f"cannot resolve {host}")
        address = infos[0][4][0]
        if len(self._dns) > 1024:
            self._dns.clear()
        self._dns[(host, port)] = (now + _DNS_TTL_S, address)
        return address

    async def _take_slot(self) -> None:
        if self.max_connections is None:
            self._busy += 1
            return
        deadline = time.monotonic() + self.connect_timeout_s
        while self._busy >= self.max_connections:
            self._slot_freed = self._slot_freed or asyncio.Event()
            left = deadline - time.monotonic()
            if left <= 0:
                raise UpstreamPoolFull(
                    f"all {self.max_connections} upstream connections (upstream_max_connections) were busy for {self.connect_timeout_s:g}s"
                )
            try:
                await asyncio.wait_for(self._slot_freed.wait(), left)
            except TimeoutError:
                continue
        self._busy += 1

    def _give_slot(self) -> None:
        self._busy -= 1
        if self._slot_freed is not None:
            self._slot_freed.set()
            self._slot_freed = None
