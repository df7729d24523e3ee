"""Database calls bounded on the gateway's side: a server that stops answering (a frozen host, a network black hole)
fails a call within ``deadline_s`` instead of holding its caller, a pooled connection and a thread for as long as it
stays frozen.

PostgreSQL's own timeouts do not cover that case: ``statement_timeout`` runs in the server (a frozen one never fires
it), ``connect_timeout`` covers new connections only, and the kernel of a stopped server still acknowledges its TCP
traffic (keepalives and ``tcp_user_timeout`` see nothing wrong). So each call runs in a thread of a pool of its own
(a hung call never takes the event loop's default threads), its caller waits at most ``deadline_s``, and past it the
connections the call took are cut: a PostgreSQL connection's socket is shut (the blocked driver call returns with an
error and SQLAlchemy discards the connection, so none stays stuck in the pool), a SQLite one is interrupted. The caller
gets :class:`DeadlineExceeded` at the deadline, whatever the thread does after.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from sqlalchemy import Engine, event

T = TypeVar("T")


class DeadlineExceeded(TimeoutError):
    """A database call did not end within its deadline (the server is down or hung)."""


class _Call:
    """One call: the DBAPI connections its thread took (cut at the deadline), and whether its caller gave up."""

    __slots__ = ("abandoned", "connections")

    def __init__(self) -> None:
        self.connections: list[Any] = []
        self.abandoned = False


class BoundedCalls:
    """Runs blocking calls on ``engine`` in ``workers`` threads, each bounded by ``deadline_s`` (see the module)."""

    def __init__(self, engine: Engine, deadline_s: float, *, name: str, workers: int) -> None:
        self.deadline_s = deadline_s
        self._local = threading.local()
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix=name)
        for hook in ("first_connect", "connect", "checkout"):  # every way a call's thread comes to hold a connection
            event.listen(engine, hook, self._took)

    def _took(self, dbapi_connection: Any, *_: Any) -> None:
        call: _Call | None = getattr(self._local, "call", None)
        if call is not None:
            call.connections.append(dbapi_connection)
            if call.abandoned:  # taken after the deadline: cut it too (the call's thread must not hang on it)
                _cut(dbapi_connection)

    def _in_thread(self, call: _Call, work: Callable[..., T], args: tuple[Any, ...]) -> T:
        if call.abandoned:  # waited in the queue past its deadline: never run
            raise DeadlineExceeded("not started before its deadline")
        self._local.call = call
        try:
            return work(*args)
        finally:
            self._local.call = None

    async def run(self, work: Callable[..., T], *args: Any, deadline_s: float | None = None) -> T:
        """``work(*args)`` in a thread; :class:`DeadlineExceeded` once ``deadline_s`` (default: the pool's) passed.
        Cancelling the caller cuts the call's connections too."""
        deadline = self.deadline_s if deadline_s is None else deadline_s
        call = _Call()
        future = asyncio.get_running_loop().run_in_executor(self._executor, self._in_thread, call, work, args)
        try:
            return await asyncio.wait_for(asyncio.shield(future), deadline)
        except TimeoutError:
            if future.done():  # it ended as the deadline passed (or raised its own TimeoutError): its outcome, as it is
                return future.result()
            self._abandon(call, future)
            raise DeadlineExceeded(f"no answer from the database in {deadline:g} s") from None
        except asyncio.CancelledError:
            self._abandon(call, future)
            raise

    def _abandon(self, call: _Call, future: asyncio.Future[Any]) -> None:
        call.abandoned = True
        for connection in list(call.connections):
            _cut(connection)
        future.add_done_callback(_retrieved)

    def close(self) -> None:
        """Stop the threads once their calls ended (calls still queued never run)."""
        self._executor.shutdown(wait=False, cancel_futures=True)


def _retrieved(future: asyncio.Future[Any] | Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # the cut call's error: expected, and said by the caller already


def _cut(dbapi_connection: Any) -> None:
    """Make the call blocked on ``dbapi_connection`` return: shut its socket (psycopg), or interrupt it (sqlite3)."""
    pgconn = getattr(dbapi_connection, "pgconn", None)
    if pgconn is not None:
        try:
            fd = pgconn.socket
        except Exception:  # noqa: BLE001 - closed already: nothing blocks on it
            return
        with contextlib.suppress(OSError):
            # a duplicate of the descriptor: shutting it down shuts the connection's socket, closing it leaves the driver's
            with socket.socket(fileno=os.dup(fd)) as duplicate:
                duplicate.shutdown(socket.SHUT_RDWR)
        return
    interrupt = getattr(dbapi_connection, "interrupt", None)
    if interrupt is not None:
        with contextlib.suppress(Exception):
            interrupt()
