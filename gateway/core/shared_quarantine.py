"""The quarantine shared by replicas (``gateway.replicas.shared``): a request shape refused through one replica is
refused through every other, and one cleared on one is cleared on all.

Each replica's :class:`~gateway.core.poison.Quarantine` stays the one its requests are checked against (no store
on the request path). What it refuses goes to ``gateway_quarantine`` as soon as it changes (a shape newly refused, a
clear: ``Quarantine.on_change``), and every round it takes what the others put there: records are merged (whom a
shape is refused for, and the evidence, add up), a record deleted there (cleared by another replica) is forgotten
here. Tolerance: a shape refused through one replica reaches the others within one round (``sync_interval_s``);
while the store is unreachable each replica refuses what it knew, and what changed meanwhile is exchanged once it
answers again.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import orjson
from sqlalchemy import Connection, delete, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert

from gateway.core.poison import Quarantine, Suspect
from gateway.core.shared_store import SharedStore, StoreUnavailable, quarantine

Key = tuple[str, str]  # (model, request shape)


def _digest(key: Key) -> str:
    return hashlib.sha256(f"{key[0]}\0{key[1]}".encode()).hexdigest()


def _encode(record: Suspect) -> str:
    return orjson.dumps({
        "strikes": record.strikes, "blocked": record.blocked, "fields": list(record.fields), "cause": record.last_cause,
        "since": record.since, "keys": sorted(([who, strikes] for who, strikes in record.keys.items()), key=lambda item: (item[0] is not None, item[0] or "")),
        "refused_for": sorted(record.refused_for, key=lambda who: (who is not None, who or "")),
    }).decode()  # fmt: skip


def _decode(text: str) -> Suspect:
    data = orjson.loads(text)
    return Suspect(
        strikes=data["strikes"], blocked=data["blocked"], fields=tuple(data["fields"]), last_cause=data["cause"],
        since=data["since"], keys={who: strikes for who, strikes in data["keys"]}, refused_for=set(data["refused_for"]),
    )  # fmt: skip


def _merged(ours: Suspect, theirs: Suspect) -> Suspect:
    both = Quarantine()
    both.merge({("", ""): ours})
    both.merge({("", ""): theirs})
    return both.refusing()[("", "")]


class SharedQuarantine:
    """The exchange of one replica's quarantine with the store."""

    def __init__(self, local: Quarantine, store: SharedStore) -> None:
        self.local = local
        self.store = store
        self._agreed: dict[Key, str] = {}  # what the store and this replica last agreed on (encoded records)
        self._lock = asyncio.Lock()  # one exchange at a time
        self._tasks: set[asyncio.Task[None]] = set()
        local.on_change = self.push_soon

    def push_soon(self) -> None:
        """A change here: exchange now (a shape newly refused reaches the others at their next round)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on the replica's loop (a test's thread): the next round pushes it
            return
        task = loop.create_task(self._push())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _push(self) -> None:
        try:
            await self.round()
        except StoreUnavailable:
            pass  # said by the store; the next round tries again

    async def round(self) -> None:
        """Push what changed here since the last agreement, take what changed there."""
        async with self._lock:
            mine = {key: _encode(record) for key, record in self.local.refusing().items()}
            changed = {key: text for key, text in mine.items() if self._agreed.get(key) != text}
            cleared = [key for key in self._agreed if key not in mine]
            stored = await self.store.run(lambda conn: _exchange(conn, changed, cleared))
            # records cleared there, that this replica had agreed on and not changed since
            gone = [key for key, text in self._agreed.items() if key not in stored and mine.get(key) == text]
            self.local.merge({key: _decode(text) for key, text in stored.items() if mine.get(key) != text}, gone)
            self._agreed = stored

    async def close(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self.local.on_change = None


def _exchange(conn: Connection, changed: dict[Key, str], cleared: list[Key]) -> dict[Key, str]:
    """Write ``changed`` (merged with what the store holds), delete ``cleared``; every record the store holds."""
    if cleared:
        conn.execute(delete(quarantine).where(quarantine.c.digest.in_([_digest(key) for key in cleared])))
    if changed:
        digests = {_digest(key): key for key in changed}
        held = dict(conn.execute(
            select(quarantine.c.digest, quarantine.c.record).where(quarantine.c.digest.in_(list(digests))).with_for_update()
        ).tuples().all())  # fmt: skip
        rows: list[dict[str, Any]] = []
        for digest, key in digests.items():
            text = changed[key] if digest not in held else _encode(_merged(_decode(changed[key]), _decode(held[digest])))
            rows.append({"digest": digest, "model": key[0], "shape": key[1], "record": text})
        upsert = pg_insert(quarantine)
        conn.execute(upsert.on_conflict_do_update(
            index_elements=[quarantine.c.digest], set_={"record": upsert.excluded.record, "updated_at": func.now()}
        ), rows)  # fmt: skip
    return {(row.model, row.shape): row.record for row in conn.execute(select(quarantine.c.model, quarantine.c.shape, quarantine.c.record))}
