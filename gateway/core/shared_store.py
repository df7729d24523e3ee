"""The store replicas share (``gateway.replicas.shared``): the usage ledger's PostgreSQL database, its own tables.

One job: reach the database off the event loop and say whether it answers. :meth:`SharedStore.run` runs one
transaction in a thread (the event loop never waits on it), bounded by ``usage.database_timeout_s`` on the gateway's
side (:mod:`gateway.core.bounded_calls`: a frozen server fails the call at that deadline, as a refused connection
does); every call that fails marks the store unreachable and raises :class:`StoreUnavailable`, every call that succeeds marks it reachable again. A change is said once, in one log
line per transition, in the gauge ``gateway_shared_store_up`` (0/1) and in ``/ready``'s ``shared_store`` field
(:meth:`SharedStore.status`). Nothing on the request path calls it except a stored response that this replica does not
know (:mod:`gateway.core.shared_responses`); :meth:`SharedStore.rounds` runs the exchanges every ``sync_interval_s``.

Its tables are created at the first answer (``CREATE TABLE IF NOT EXISTS`` under an advisory lock), beside the
ledger's, and versioned apart from them: they hold what the replicas exchange now, nothing a migration must keep.
"""

from __future__ import annotations

import asyncio
import math
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from loguru import logger
from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    DateTime,
    Engine,
    Index,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    func,
    text,
)
from sqlalchemy.exc import DBAPIError

from gateway.core.bounded_calls import BoundedCalls

T = TypeVar("T")

DEADLINE_S = 5.0  # the longest one call waits (usage.database_timeout_s): then the store counts as unreachable
POOL_SIZE, MAX_OVERFLOW = 2, 4
_LOCK = 0x5347_5348  # the advisory lock under which the tables are created ("SGSH")

metadata = MetaData()

# Each replica's last sign of life (written every round): replicas not seen for a few rounds are gone.
replicas = Table(
    "gateway_replicas",
    metadata,
    Column("name", String(200), primary_key=True),
    Column("seen_at", DateTime(timezone=True), nullable=False),
)

# Per-key usage reports (gateway.tenants.shared_quotas): one row per replica and round that saw use.
quota_reports = Table(
    "gateway_quota_reports",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("replica", String(200), nullable=False),
    # when the row was written (not its transaction's start: readers look back a few seconds for late commits)
    Column("at", DateTime(timezone=True), nullable=False, server_default=func.clock_timestamp()),
    Column("used", Text, nullable=False),  # JSON: key -> [requests admitted, tokens charged, in flight now]
    Index("gateway_quota_reports_at", "at"),
)

# Stored Responses API objects: who stored which id where (gateway.core.shared_responses).
responses = Table(
    "gateway_responses",
    metadata,
    Column("id", String(200), primary_key=True),
    Column("model", String(200), nullable=False),
    Column("backend", String(1000), nullable=False),
    Column("owner", String(200), nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Index("gateway_responses_created", "created_at"),
)

# Quarantined request shapes (gateway.core.shared_quarantine), by a digest of (model, shape).
quarantine = Table(
    "gateway_quarantine",
    metadata,
    Column("digest", String(64), primary_key=True),
    Column("model", String(200), nullable=False),
    Column("shape", Text, nullable=False),
    Column("record", Text, nullable=False),  # JSON of the suspect: who it is refused for, its evidence
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)


class StoreUnavailable(RuntimeError):
    """The shared store did not answer (the reason is in the message)."""


def replica_name(configured: str | None) -> str:
    """This replica's name in the store: ``gateway.replicas.name``, else the host name and process id."""
    return configured or f"{socket.gethostname()}:{os.getpid()}"


class SharedStore:
    """The shared store's connection, its reachability, and the rounds run against it."""

    def __init__(
        self, url: str, replica: str, interval_s: float, expected: int, gauge: Any = None, deadline_s: float = DEADLINE_S
    ) -> None:
        self.replica = replica
        self.interval_s = interval_s
        self.expected = expected
        self.reachable = False  # until the first answer
        self.error: str | None = "not reached yet"
        self.since = time.time()  # of the current reachability
        self.live: list[str] = [replica]  # the replicas seen in the last rounds (the quota exchange sets it)
        self._gauge = gauge
        self._said: bool | None = None  # the reachability the log last said (None: nothing said yet)
        self.deadline_s = deadline_s
        # the server's own timeouts too (a live but slow server ends the statement itself); libpq's connect_timeout is
        # whole seconds, at least 2: the call's deadline comes first where it is shorter
        self._engine: Engine = create_engine(
            url, pool_size=POOL_SIZE, max_overflow=MAX_OVERFLOW, pool_recycle=1800, pool_timeout=deadline_s,
            connect_args={"connect_timeout": max(2, math.ceil(deadline_s)), "options": f"-c statement_timeout={math.ceil(deadline_s * 1000)}"},
        )  # fmt: skip
        self._calls = BoundedCalls(self._engine, deadline_s, name="shared-store", workers=POOL_SIZE + MAX_OVERFLOW)
        self._tables = False  # created (or found)
        self._stopping = asyncio.Event()
        if gauge is not None:
            gauge.set(0)

    async def run(self, work: Callable[[Connection], T]) -> T:
        """``work`` in one transaction, in a thread; :class:`StoreUnavailable` when the store fails it or does not
        answer within the deadline."""
        try:
            result = await self._calls.run(self._transaction, work)
        except Exception as error:  # noqa: BLE001 - any failure of the database or its driver: the store is down
            reason = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
            self._mark(False, reason)
            raise StoreUnavailable(reason) from None
        self._mark(True, None)
        return result

    def _transaction(self, work: Callable[[Connection], T]) -> T:
        if not self._tables:
            with self._engine.begin() as conn:
                conn.execute(text("SELECT pg_advisory_xact_lock(:lock)"), {"lock": _LOCK})
                metadata.create_all(conn, checkfirst=True)
            self._tables = True
        try:
            with self._engine.begin() as conn:
                return work(conn)
        except DBAPIError as error:
            if not error.connection_invalidated:
                raise
        with self._engine.begin() as conn:  # a pooled connection the server had closed (a restart): once more, on a new one
            return work(conn)

    def _mark(self, reachable: bool, error: str | None) -> None:
        self.error = error
        if reachable == self.reachable and self._said is not None:
            return
        self.reachable, self.since = reachable, time.time()
        if self._gauge is not None:
            self._gauge.set(1 if reachable else 0)
        if reachable:
            if self._said is not None:  # the first answer at start is no news
                logger.info("shared store: reachable again; per-key limits are shared by the replicas again")
        else:
            logger.error(
                "shared store: unreachable ({}); each key keeps 1/{} of its limits here until it answers, stored "
                "responses of other replicas answer 503", error, self.expected,
            )  # fmt: skip
        self._said = reachable

    @property
    def down(self) -> bool:
        """The last call failed (not merely: none answered yet). What may answer without the store does, until a
        round's call answers again."""
        return not self.reachable and self._said is not None

    def status(self) -> dict[str, Any]:
        """What ``/ready`` says of the store."""
        status: dict[str, Any] = {"reachable": self.reachable, "replica": self.replica, "since": round(self.since, 3)}
        if self.reachable:
            status["replicas"] = len(self.live)
        else:
            status["error"] = self.error
            status["limits"] = f"local share: 1/{self.expected} of each key's limits"
        return status

    async def rounds(self, steps: list[Callable[[], Awaitable[None]]]) -> None:
        """Run ``steps`` in order every ``interval_s`` until :meth:`stop_rounds`; a step whose store call fails ends its
        round (said by :meth:`run`), the next round tries again."""
        while not self._stopping.is_set():
            for step in steps:
                try:
                    await step()
                except StoreUnavailable:
                    break
                except Exception:  # noqa: BLE001 - a bug in one round must not stop the exchange
                    logger.exception("shared store: a round failed")
                    break
            try:
                await asyncio.wait_for(self._stopping.wait(), self.interval_s)
            except TimeoutError:
                pass

    def stop_rounds(self) -> None:
        """End :meth:`rounds` (at its next wait)."""
        self._stopping.set()

    async def close(self) -> None:
        """Release the connections (after the last call), within the deadline whatever the server does."""
        self._stopping.set()
        try:
            await self._calls.run(self._engine.dispose)
        except Exception:  # noqa: BLE001,S110 - the connections are given up with the process
            pass
        self._calls.close()
