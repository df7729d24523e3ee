"""Where every call of the batch database runs (the store's and :class:`gateway.batches.files.DatabaseFiles`'s):
threads of pools of the batch API's own, never the event loop's default ones, so a hung call holds no thread that the
rest of the gateway uses.

On PostgreSQL each call is bounded on the gateway's side (:class:`gateway.core.bounded_calls.BoundedCalls`): past
``usage.database_timeout_s`` its caller gets :class:`DeadlineExceeded` (the store is down: the API answers 503
``batches_unavailable``, the runner pauses and holds the answers it could not record) and its connections are cut. A
frozen server (SIGSTOP, a network black hole) answers nothing, and its own timeouts never fire.

Creates do more work in one call (the check of up to ``batches.max_lines`` lines, read from the database when files
are kept there, and their insert in one transaction, 1,000 rows a statement), and so do a whole file's write and a
finished batch's lines read for its result files: those calls get :data:`CREATE_DEADLINES` deadlines (60 s at the
default 5 s). The biggest create on a healthy local PostgreSQL, at a load average of 15 on 2 cores: a 100 MB file
written in 1.6 s and read in 2.6 s, 50,000 lines reserved and inserted in 2.3 s, their checks about 3 s (2 ms per 32
lines): some 10 s, a sixth of the bound, while a frozen server still fails the create within it. A call that also
reads a request's body as it arrives (the Message Batch create) gets the body's own bound (``http.body_deadline_s``)
on top. The reservation and the other small calls of a create keep the plain deadline (a reservation waits at most
for one other create of its key, two running at once), so a create on a frozen server is refused as fast as a read.

SQLite (a local file, a lone gateway) gets no deadline: no server can freeze there, its locks wait at most its busy
timeout (10 s), and cutting a big create on a slow disk would refuse a batch that is being written fine. Its calls run
in the same pools of their own as PostgreSQL's.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from sqlalchemy import Engine

from gateway.core.bounded_calls import BoundedCalls, DeadlineExceeded

T = TypeVar("T")
CALL_THREADS = 8  # the API's and the runner's calls at once (the PostgreSQL pool holds 4 connections; more wait in it)
CREATE_THREADS = 2  # creates at work at once (reserving, checking, inserting their lines); more wait
CREATE_DEADLINES = 12  # a create's big calls: this many deadlines (60 s at the default 5 s)

__all__ = ["BatchCalls", "DeadlineExceeded"]


class BatchCalls:
    """The batch database's calls: :meth:`run` (any call), :meth:`create` (a create's work, in threads of its own so
    creates of big files never queue other keys' calls)."""

    def __init__(self, engine: Engine, deadline_s: float, body_s: float) -> None:
        self.bounded = engine.dialect.name != "sqlite"
        self.deadline_s = deadline_s if self.bounded else None
        self.create_s = CREATE_DEADLINES * deadline_s if self.bounded else None
        self.body_s = body_s
        if self.bounded:
            self._calls: BoundedCalls | ThreadPoolExecutor = BoundedCalls(engine, deadline_s, name="batch-db", workers=CALL_THREADS)
            self._creates: BoundedCalls | ThreadPoolExecutor = BoundedCalls(engine, deadline_s, name="batch-create", workers=CREATE_THREADS)
        else:
            self._calls = ThreadPoolExecutor(CALL_THREADS, thread_name_prefix="batch-db")
            self._creates = ThreadPoolExecutor(CREATE_THREADS, thread_name_prefix="batch-create")

    async def run(self, work: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``work(*args, **kwargs)`` in a thread, bounded by the deadline (PostgreSQL)."""
        return await _run(self._calls, functools.partial(work, *args, **kwargs), self.deadline_s)

    async def run_big(self, work: Callable[..., T], *args: Any) -> T:
        """A call that moves a whole file or batch (a file's bytes written, the lines of a batch read for its result
        files): in the same threads as :meth:`run`, bounded as a create's big call."""
        return await _run(self._calls, functools.partial(work, *args), self.create_s)

    async def create(self, work: Callable[..., T], *args: Any, big: bool = True, reads_body: bool = False) -> T:
        """A create's ``work(*args)`` in the creates' threads: bounded by :data:`CREATE_DEADLINES` deadlines when
        ``big`` (plus the body's bound when it ``reads_body``), else by one."""
        bound = self.create_s if big else self.deadline_s
        if bound is not None and reads_body:
            bound += self.body_s
        return await _run(self._creates, functools.partial(work, *args), bound)

    def close(self) -> None:
        """Stop the threads once their calls ended (a hung one is not waited for)."""
        for pool in (self._calls, self._creates):
            if isinstance(pool, BoundedCalls):
                pool.close()
            else:
                pool.shutdown(wait=False, cancel_futures=True)


async def _run(pool: BoundedCalls | ThreadPoolExecutor, work: Callable[[], T], deadline_s: float | None) -> T:
    if isinstance(pool, BoundedCalls):
        return await pool.run(work, deadline_s=deadline_s)
    return await asyncio.get_running_loop().run_in_executor(pool, work)
