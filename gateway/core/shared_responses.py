"""Stored Responses API objects shared by replicas (``gateway.replicas.shared``): which upstream stored which id, and
which key owns it, in the shared store beside each replica's own index (:mod:`gateway.core.responses_index`).

A response created through this replica is published when it is created: a plain answer once the store has it
(before the client gets the id, so that any replica finds it next), a stream's as soon as its id is seen (while the
stream goes on). One insert is in flight at a time, carrying every publication that came while the last one ran. A replica looks up the store only for an id its own index does not know; what it finds is kept
in its index. The first owner of an id stays its owner (the store keeps the first row).

The store unreachable: creating a response still works (its publication waits, retried every round, at most
:data:`MAX_PENDING`); an id this replica does not know answers 503 (never a 404 that may be wrong), and one it
knows is served as usual. Once a call failed (a refused connection, or no answer within the store's deadline),
neither waits on the store: the rounds try it, and the first answer makes creates and lookups use it again. Records older than :data:`KEEP_DAYS` are deleted (every replica tries once an hour).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import time
from functools import partial

from loguru import logger
from sqlalchemy import Connection, delete, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert

from gateway.core.responses_index import StoredResponse
from gateway.core.shared_store import SharedStore, StoreUnavailable, responses

MAX_PENDING = 10_000  # publications waiting for the store; beyond, the oldest are given up (said once per outage)
KEEP_DAYS = 30  # a record older than this is deleted (the response's engine has most likely forgotten it too)
PRUNE_EVERY_S = 3600.0


class SharedResponses:
    """The shared store's side of the responses index (``ResponseIndex.remote``)."""

    def __init__(self, store: SharedStore) -> None:
        self.store = store
        self._pending: dict[str, StoredResponse] = {}  # not in the store yet
        self._dropped = False
        self._next: dict[str, StoredResponse] = {}  # to go in the writer's next insert
        self._waiting: list[asyncio.Future[None]] = []  # plain creates waiting for that insert
        self._writer: asyncio.Task[None] | None = None
        self._pruned_at = -math.inf

    async def publish(self, response_id: str, stored: StoredResponse) -> None:
        """Put ``response_id`` in the store, and return once it is there (or kept for the next round: the store did
        not answer, or is known down: then it waits for the rounds, and a create does not wait a deadline each)."""
        if self.store.down:
            self._keep(response_id, stored)
            return
        done = asyncio.get_running_loop().create_future()
        self._waiting.append(done)
        self.publish_soon(response_id, stored)
        await done

    def publish_soon(self, response_id: str, stored: StoredResponse) -> None:
        """:meth:`publish` without waiting (a stream's id, seen in a callback of the relay)."""
        self._next[response_id] = stored
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write(), name="shared responses")

    async def _write(self) -> None:
        """One insert at a time, of every publication that came meanwhile: under load, one transaction (and one of the
        pool's connections) for many creates, instead of one each."""
        while self._next:
            entries, self._next = self._next, {}
            waiting, self._waiting = self._waiting, []
            try:
                await self.store.run(partial(_insert, entries=entries))
            except StoreUnavailable:
                for response_id, stored in entries.items():
                    self._keep(response_id, stored)
            finally:
                for done in waiting:
                    if not done.done():
                        done.set_result(None)

    async def find(self, response_id: str) -> StoredResponse | None:
        """The store's record of ``response_id`` (None: no replica created it); :class:`StoreUnavailable` when the
        store does not answer, or is known down (the rounds find when it answers again)."""
        if self.store.down:
            raise StoreUnavailable(self.store.error or "unreachable")
        return await self.store.run(lambda conn: _select(conn, response_id))

    async def round(self) -> None:
        """Publish what waits (a round of :meth:`SharedStore.rounds`); now and then, forget the records older than
        :data:`KEEP_DAYS`."""
        if time.monotonic() - self._pruned_at > PRUNE_EVERY_S:
            await self.store.run(_prune)
            self._pruned_at = time.monotonic()
        if not self._pending:
            return
        pending = dict(self._pending)
        await self.store.run(lambda conn: _insert(conn, pending))
        for response_id in pending:
            self._pending.pop(response_id, None)
        self._dropped = False

    def _keep(self, response_id: str, stored: StoredResponse) -> None:
        self._pending[response_id] = stored
        if len(self._pending) > MAX_PENDING:
            del self._pending[next(iter(self._pending))]
            if not self._dropped:
                self._dropped = True
                logger.error("shared store: more than {} stored responses wait to be published; the oldest are given up "
                             "(other replicas will answer 404 for them)", MAX_PENDING)  # fmt: skip

    async def close(self) -> None:
        """Wait for the publications in flight (each bounded by the store's deadline), then try once to publish what
        waits, unless the store is known down (a shutdown does not wait on it twice)."""
        if self._writer is not None:
            await asyncio.gather(self._writer, return_exceptions=True)
        try:
            if self.store.down:
                raise StoreUnavailable(self.store.error or "unreachable")
            await self.round()
        except StoreUnavailable:
            if self._pending:
                logger.error("shared store: {} stored responses not published at shutdown", len(self._pending))


def _insert(conn: Connection, entries: dict[str, StoredResponse]) -> None:
    rows = [{"id": rid, "model": s.model, "backend": s.backend, "owner": s.owner} for rid, s in entries.items()]
    conn.execute(pg_insert(responses).on_conflict_do_nothing(index_elements=[responses.c.id]), rows)


def _prune(conn: Connection) -> None:
    conn.execute(delete(responses).where(responses.c.created_at < func.now() - dt.timedelta(days=KEEP_DAYS)))


def _select(conn: Connection, response_id: str) -> StoredResponse | None:
    row = conn.execute(select(responses.c.model, responses.c.backend, responses.c.owner).where(responses.c.id == response_id)).first()
    return StoredResponse(row.model, row.backend, row.owner) if row is not None else None
