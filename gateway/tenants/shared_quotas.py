"""Per-key limits shared by replicas (``gateway.replicas.shared``), through the shared store.

The worker processes' mechanism (:mod:`gateway.tenants.quotas`), with the store in place of the control process:
each replica keeps the sums of every replica's use itself (``total``, share 1), and the requests it serves draw on
its share (1/``expected``) of what they leave (``local``, the app's quotas). Every ``sync_interval_s`` one round:

1. its own report (what its keys used since the last one, :meth:`Quotas.report`) goes into its sums, and into
   ``gateway_quota_reports`` (what the store did not take is added to the next round's report);
2. the reports the other replicas wrote since the last round come back and go into the sums
   (:meth:`Quotas.absorb`); the replicas not seen for :data:`GONE_ROUNDS` rounds have nothing in flight any more;
3. the requests it serves get their share of the sums (:meth:`Quotas.apply`).

No store round trip on the request path. Tolerance: between two rounds each replica admits at most its share of
what a bucket held (so the replicas together admit no more than the limit, plus what refills); a burst on one
replica may be refused early, until the next rounds hand it the rest. Budgets and concurrency are checked against
the sums as of the last round: passed by at most what the other replicas admitted in one round (``sync_interval_s``
plus the store's round trip), and, as on one process, by one request larger than what was left.

The store unreachable: no sums come; each replica goes on with its share, 1/``expected`` of each bucket, of what a
budget had left, and of each key's concurrency (:meth:`Quotas.on_its_own`), until the store answers again.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from sqlalchemy import Connection, delete, func, insert, select
from sqlalchemy.dialects.postgresql import insert as pg_insert

from gateway.config import KeyLimits
from gateway.core.shared_store import SharedStore, StoreUnavailable, quota_reports, replicas
from gateway.tenants.quotas import Quotas

HELD = "\0held\0"  # a stored report's entry for the tokens a key's requests hold: [0, 0, tokens] (older replicas skip it)
GONE_ROUNDS = 4  # a replica not seen for this many rounds (at least GONE_MIN_S) has nothing in flight any more
GONE_MIN_S = 2.0
LOOK_BACK_S = 5.0  # reports are read again this far behind the last read (stamped when written, seen once committed)
KEEP_REPORTS_S = 600.0  # older reports are deleted


@dataclass(frozen=True)
class _Exchanged:
    others: list[tuple[str, dict[str, Any]]]  # the other replicas' new reports: (replica, key -> counts)
    live: set[str]  # the replicas seen lately, this one included
    now: dt.datetime  # the store's time of the exchange
    absorbed: dict[int, dt.datetime]  # the reports counted, as of this exchange (id -> when written)


class SharedQuotas:
    """The exchange of one replica: ``local`` (the app's quotas, 1/``expected`` each) and ``total`` (the sums)."""

    def __init__(self, local: Quotas, store: SharedStore, limited: Callable[[], dict[str, KeyLimits]]) -> None:
        self.local = local
        self.total = Quotas(clock=local.clock)  # every replica's use, as far as this one knows
        self.store = store
        self.limited = limited  # the limited named keys in force (a reload changes them)
        self._numbers: dict[str, int] = {store.replica: 0}  # replica -> its number in the sums' in-flight counts
        self._pending: dict[str, list[int]] = {}  # what the store did not take yet: key -> [requests, tokens, in flight, held]
        self._absorbed: dict[int, dt.datetime] = {}  # the other replicas' report ids already counted -> their time
        self._read_from: dt.datetime | None = None  # None: the first round reads only what comes after it
        self._last_number = 0
        self._alone = False  # the store failed: serving with the local share
        self._pruned_at = 0.0

    async def round(self) -> None:
        """One exchange with the store (:class:`StoreUnavailable` when it fails: the local share stands)."""
        limits = self.limited()
        report = self.local.report()
        if report is not None:
            number, used = report
            self._last_number = number
            self.total.absorb(0, number, used, limits)
            self.local.counted(number)  # in the sums now: a long outage keeps no list of reports
            for name, (requests, tokens, in_flight, reserved) in used.items():  # one report, however long the store was down
                held = self._pending.setdefault(name, [0, 0, 0, 0])
                held[0], held[1], held[2], held[3] = held[0] + requests, held[1] + tokens, in_flight, reserved
        pending = orjson.dumps(_written(self._pending)).decode() if self._pending else None
        try:
            exchanged = await self.store.run(lambda conn: self._exchange(conn, pending))
        except StoreUnavailable:
            if not self._alone:
                self._alone = True
                self.local.on_its_own()
            raise
        self._pending.clear()  # written (only a round adds to it)
        self._alone = False
        others, live = exchanged.others, exchanged.live
        self._read_from, self._absorbed = exchanged.now, exchanged.absorbed
        if exchanged.now.timestamp() - self._pruned_at > 60:
            self._pruned_at = exchanged.now.timestamp()
        gone = [name for name in self._numbers if name != self.store.replica and name not in live]
        for name in gone:
            self.total.forget_worker(self._numbers.pop(name))
        self.store.live = sorted(live)
        for replica, used in others:
            self.total.absorb(self._number(replica), 0, _read(used), limits)
        self.local.apply(self.total.snapshot(limits), 0, self._last_number)

    def _number(self, replica: str) -> int:
        number = self._numbers.get(replica)
        if number is None:
            number = self._numbers[replica] = max(self._numbers.values()) + 1
        return number

    def _exchange(self, conn: Connection, pending: str | None) -> _Exchanged:
        """In the store's transaction: write this replica's report and heartbeat, read the others' new reports and
        which replicas are alive. Changes nothing here (what it read is kept once the transaction committed)."""
        now = conn.execute(select(func.now())).scalar_one()
        me = self.store.replica
        if pending is not None:
            conn.execute(insert(quota_reports).values(replica=me, used=pending))
        upsert = pg_insert(replicas).values(name=me, seen_at=now)
        conn.execute(upsert.on_conflict_do_update(index_elements=[replicas.c.name], set_={"seen_at": now}))
        gone_s = max(GONE_MIN_S, GONE_ROUNDS * self.store.interval_s)
        live = set(conn.execute(select(replicas.c.name).where(replicas.c.seen_at > now - dt.timedelta(seconds=gone_s))).scalars())
        live.add(me)
        others: list[tuple[str, dict[str, Any]]] = []
        absorbed = self._absorbed
        if self._read_from is not None:  # the first round reads nothing: what came before is in the ledger or refilled
            since = self._read_from - dt.timedelta(seconds=LOOK_BACK_S)
            rows = conn.execute(
                select(quota_reports.c.id, quota_reports.c.replica, quota_reports.c.at, quota_reports.c.used)
                .where(quota_reports.c.at > since, quota_reports.c.replica != me)
                .order_by(quota_reports.c.id)
            ).all()
            absorbed = {rid: at for rid, at in absorbed.items() if at > since}
            for row in rows:
                if row.id not in absorbed:
                    absorbed[row.id] = row.at
                    others.append((row.replica, orjson.loads(row.used)))
        if now.timestamp() - self._pruned_at > 60:  # now and then, whichever replica comes first
            conn.execute(delete(quota_reports).where(quota_reports.c.at < now - dt.timedelta(seconds=KEEP_REPORTS_S)))
            conn.execute(delete(replicas).where(replicas.c.seen_at < now - dt.timedelta(seconds=KEEP_REPORTS_S)))
        return _Exchanged(others, live, now, absorbed)



def _written(pending: dict[str, list[int]]) -> dict[str, list[int]]:
    """A report as stored: three counts a key (as older replicas read them), and what its requests hold apart."""
    stored = {name: counts[:3] for name, counts in pending.items()}
    stored.update((HELD + name, [0, 0, counts[3]]) for name, counts in pending.items() if counts[3])
    return stored


def _read(stored: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """A stored report as :meth:`Quotas.absorb` takes it (key -> requests, tokens, in flight, held)."""
    used = {name: (*counts[:3], 0) for name, counts in stored.items() if not name.startswith(HELD)}
    for name, counts in stored.items():
        if name.startswith(HELD) and name[len(HELD) :] in used:
            used[name[len(HELD) :]] = (*used[name[len(HELD) :]][:3], counts[2])
    return used
