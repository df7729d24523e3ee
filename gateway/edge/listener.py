"""The listening socket: every connection waiting in the accept queue is taken in one pass of the loop.

uvloop (its libuv) accepts one connection per pass of the event loop, so that processes sharing a socket
take turns. A gateway relaying a decode step's events to a thousand streams spends 10-20 ms per pass, so new
connections are taken at 50-100 a second while hundreds wait in the listen queue, and a new stream's first token
waits a second or more for its accept (measured: 300 waiting connections take 301 passes under uvloop). Here
the socket's readiness callback accepts up to :data:`ACCEPTS_PER_PASS` at once and hands each to the loop as an
accepted socket with uvicorn's protocol, so those connections wait a pass or two at most. Worker processes each
listen on a socket of their own (``SO_REUSEPORT``): the kernel, not turn-taking, spreads connections among them.

:class:`ManyAcceptServer` is uvicorn's server with these listeners in place of the ``asyncio.Server`` objects it
keeps (``close``, ``wait_closed``, ``sockets``), so uvicorn's shutdown stops them the same way; the port is still
bound only once the lifespan (the engines' start) is done.
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import sys
from collections.abc import Callable

from loguru import logger
from uvicorn.server import STARTUP_FAILURE

from gateway.edge.ticks import TickServer

ACCEPTS_PER_PASS = 512  # the most connections taken per readiness callback: a full queue drains in a few passes
_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_RETRY_AFTER_S = 0.5  # out of descriptors: stop accepting this long (the connections wait in the listen queue)

ProtocolFactory = Callable[[], asyncio.Protocol]


class ManyAcceptListener:
    """Accept every waiting connection of ``sock`` per readiness, each served by a protocol from ``factory``."""

    def __init__(self, sock: socket.socket, factory: ProtocolFactory, *, owns_socket: bool) -> None:
        self._sock = sock
        self._factory = factory
        self._owns_socket = owns_socket  # a socket it bound (closed here) or one handed to it (closed by its owner)
        self._loop = asyncio.get_running_loop()
        self._serving = False
        self._pending: set[asyncio.Task[object]] = set()  # connections being attached to the loop
        self._closed = asyncio.Event()
        sock.setblocking(False)
        self._start()

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        return (self._sock,)

    def is_serving(self) -> bool:
        return self._serving

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def _start(self) -> None:
        if not self._serving and not self._closed.is_set():
            self._loop.add_reader(self._sock.fileno(), self._accept_waiting)
            self._serving = True

    def _stop(self) -> None:
        if self._serving:
            self._loop.remove_reader(self._sock.fileno())
            self._serving = False

    def _accept_waiting(self) -> None:
        for _ in range(ACCEPTS_PER_PASS):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:  # the peer gave up while it waited: take the next one
                continue
            except OSError as error:
                if error.errno in _OUT_OF_RESOURCES:  # they wait in the queue until descriptors are freed
                    logger.warning("gateway: cannot accept connections: {}; retrying in {:g} s", error, _RETRY_AFTER_S)
                    self._stop()
                    self._loop.call_later(_RETRY_AFTER_S, self._start)
                else:
                    logger.error("gateway: accept failed: {}", error)
                return
            conn.setblocking(False)
            task = self._loop.create_task(self._attach(conn))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def _attach(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._factory, conn)
        except OSError:  # reset before it could be served: nothing to answer
            conn.close()

    def close(self) -> None:
        """Stop accepting (connections already accepted are uvicorn's to finish)."""
        self._stop()
        self._closed.set()
        if self._owns_socket:
            self._sock.close()

    async def wait_closed(self) -> None:
        await self._closed.wait()


def bind_listening_sockets(host: str, port: int, backlog: int) -> list[socket.socket]:
    """Bound, listening sockets for ``host``:``port`` as ``loop.create_server`` makes them (one per address the host
    resolves to; ``SO_REUSEADDR``; IPv6 sockets IPv6 only); raises ``OSError`` naming what failed."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as error:
                raise OSError(error.errno, f"error while attempting to bind on address {address!r}: {error.strerror}") from None
            sock.listen(backlog)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def bind_unix_socket(path: str, backlog: int) -> socket.socket:
    """A listening Unix socket at ``path``, owner-only. Bound before the lifespan runs (the control process of
    workers): a worker's admin request that comes while the lifespan ends waits in the accept queue for the
    control's answer instead of finding no socket (uvicorn binds its own only after the lifespan)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


class ManyAcceptServer(TickServer):
    """uvicorn's server listening through :class:`ManyAcceptListener` on its host and port, or on the sockets it is
    handed (a worker process's); on a Unix socket or a descriptor (the control process of workers, which serves
    no streams) it listens as uvicorn does. Its housekeeping ticks once a second (:class:`TickServer`)."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if self.config.uds is not None or self.config.fd is not None:
            await super().startup(sockets)
            return
        await super().startup(sockets=[])  # the lifespan (it exits on failure) and no listener: ours follow
        self.started = False
        try:
            self.servers = self._listeners(sockets)  # type: ignore[assignment]
        except OSError as error:  # as uvicorn: the error, the lifespan's shutdown, exit 3
            logger.error("gateway: {}", error)
            await self.lifespan.shutdown()
            sys.exit(STARTUP_FAILURE)
        self.started = True

    def _listeners(self, sockets: list[socket.socket] | None) -> list[ManyAcceptListener]:
        config = self.config

        def create_protocol() -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.server_state, app_state=self.lifespan.state
            )

        if sockets is not None:  # a worker's socket: uvicorn's shutdown closes it
            return [ManyAcceptListener(sock, create_protocol, owns_socket=False) for sock in sockets]
        bound = bind_listening_sockets(config.host, config.port, config.backlog)
        return [ManyAcceptListener(sock, create_protocol, owns_socket=True) for sock in bound]
