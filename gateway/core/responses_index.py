"""Which engine holds which stored response, and which client key owns it, kept across gateway restarts.

SGLang keeps Responses API state (``--enable-response-store``) in the memory of the engine that created the
response, and serves it to anyone who names its id. With several models or engines behind the gateway,
``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel`` and a new request's ``previous_response_id``
must go back to that engine, and only for the key that created the response: the gateway remembers
``id -> (model, backend identity, owner)`` for every response it relayed. An id it does not know, or that
another key owns, is the same 404 (existence is never revealed); one whose engine is gone is a 404 too.

The index lives in ``<gateway.state_dir>/responses.sqlite3`` (WAL), so that a restarted gateway still routes
(and refuses) the responses of the external engines it serves; it is bounded, oldest forgotten first. The
event loop never waits on a disk write: :meth:`ResponseIndex.record` puts the entry in a small in-memory map
(which answers at once) and hands it to one writer thread. A lookup that misses the map is one primary-key
read of the local file (WAL readers never wait on the writer): microseconds. It happens on the stored-
response calls and once per response created (the first record of an id wins), never on other requests. Without a state directory the index is memory only.

Replicas sharing a store (``gateway.replicas.shared``) publish every new id there too and look it up there on a
local miss (``remote``: :mod:`gateway.core.shared_responses`); :meth:`ResponseIndex.find_shared` is that lookup.
"""

from __future__ import annotations

import asyncio
import queue
import sqlite3
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from loguru import logger

FILE_NAME = "responses.sqlite3"
_SCHEMA_VERSION = 1
_RECENT = 4096  # entries kept in memory next to the file: those not written yet, and the likeliest reads
_BATCH = 256  # entries written in one transaction at most
# After the first entry of a batch, the writer waits up to this long for others (not once a flush is asked for):
# at hundreds of new responses a second each one's own transaction took ~10% of the gateway's CPU
_GATHER_S = 0.005
_CLOSE = None  # the writer's stop signal


@dataclass(frozen=True)
class StoredResponse:
    model: str  # the route's model name
    backend: str  # the ``Backend.identity`` of the upstream that created it
    owner: str  # the identity of the client key that created it (``gateway.edge.auth.key_owner``)


class RemoteIndex(Protocol):
    """Where replicas sharing a store publish and look up stored responses (:mod:`gateway.core.shared_responses`)."""

    async def publish(self, response_id: str, stored: StoredResponse) -> None: ...

    def publish_soon(self, response_id: str, stored: StoredResponse) -> None: ...

    async def find(self, response_id: str) -> StoredResponse | None:
        """The store's record (None: no replica created it); raises when the store does not answer."""
        ...


class ResponseIndex:
    """``response id -> StoredResponse``, bounded to ``max_entries``; persisted under ``path`` when given."""

    def __init__(self, path: Path | None = None, max_entries: int = 100_000) -> None:
        self.max_entries = max_entries
        self.path = path
        self.shared = False  # worker processes read the file too (set by a worker's app)
        self.remote: RemoteIndex | None = None  # replicas sharing a store (gateway.replicas.shared): set by the lifespan
        self._recent: OrderedDict[str, StoredResponse] = OrderedDict()
        self._recent_max = max_entries if path is None else min(max_entries, _RECENT)
        self._reader: sqlite3.Connection | None = None
        self._read_lock = threading.Lock()
        # entries to write, flush markers (set once written), and None to stop
        self._queue: queue.SimpleQueue[tuple[str, StoredResponse] | threading.Event | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        if path is not None:
            writer = _connect(path, create=True)  # fails here (at startup) if the directory is unusable
            writer.close()
            self._reader = _connect(path)
            self._writer = threading.Thread(target=self._write_loop, name="responses-index-writer", daemon=True)
            self._writer.start()

    def record(self, response_id: str, model: str, backend: str, owner: str) -> None:
        """Remember who created ``response_id`` where. The first record of an id wins: an id is never
        handed to another owner (engines choose ids at random, and clients cannot choose them). Replicas sharing a
        store publish it there too, in a task (a stream's id: the stream goes on meanwhile)."""
        stored = self._remember(response_id, model, backend, owner)
        if stored is not None and self.remote is not None:
            self.remote.publish_soon(response_id, stored)

    def _remember(self, response_id: str, model: str, backend: str, owner: str) -> StoredResponse | None:
        """Keep a new id here (None: it was known already)."""
        if self._find(response_id) is not None:
            return None
        stored = StoredResponse(model, backend, owner)
        self._keep(response_id, stored)
        if self._writer is not None:
            self._queue.put((response_id, stored))
        return stored

    def _keep(self, response_id: str, stored: StoredResponse) -> None:
        self._recent[response_id] = stored
        while len(self._recent) > self._recent_max:
            self._recent.popitem(last=False)

    async def publish(self, response_id: str, model: str, backend: str, owner: str) -> None:
        """:meth:`record`, and wait until the others can read it: with worker processes (``shared``) until it is in
        the file, with replicas sharing a store (``remote``) until the store has it (or could not take it: then
        published later): the client that gets the id next may ask any worker or replica for it."""
        stored = self._remember(response_id, model, backend, owner)
        if self.shared and self._writer is not None:
            await asyncio.to_thread(self.flush, 2.0)
        if stored is not None and self.remote is not None:
            await self.remote.publish(response_id, stored)

    def find(self, response_id: str, owner: str) -> StoredResponse | None:
        """The response ``owner`` created as ``response_id``; None when absent or another owner's (alike)."""
        stored = self._find(response_id)
        return stored if stored is not None and stored.owner == owner else None

    async def find_shared(self, response_id: str, owner: str) -> StoredResponse | None:
        """:meth:`find`, then (replicas sharing a store) the store for an id this replica does not know: what
        another replica created. Raises what the store raises when it does not answer (never a wrong None)."""
        stored = self._find(response_id)
        if stored is None and self.remote is not None:
            stored = await self.remote.find(response_id)
            if stored is not None:
                self._keep(response_id, stored)  # asked again soon (a conversation goes on): answered here
        return stored if stored is not None and stored.owner == owner else None

    def _find(self, response_id: str) -> StoredResponse | None:
        stored = self._recent.get(response_id)
        if stored is not None or self._reader is None:
            return stored
        try:
            with self._read_lock:
                row = self._reader.execute("SELECT model, backend, owner FROM responses WHERE id = ?", (response_id,)).fetchone()
        except sqlite3.Error as error:
            logger.error("responses index: cannot read {}: {}", self.path, error)
            return None
        return StoredResponse(*row) if row is not None else None

    def __len__(self) -> int:
        if self._reader is None:
            return len(self._recent)
        self.flush()
        with self._read_lock:
            return int(self._reader.execute("SELECT COUNT(*) FROM responses").fetchone()[0])

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until everything recorded so far is in the file (``close`` does it too)."""
        if self._writer is None:
            return
        written = threading.Event()
        self._queue.put(written)
        written.wait(timeout_s)

    def close(self) -> None:
        """Write what is pending and release the file (blocking: call it off the event loop)."""
        writer, self._writer = self._writer, None
        if writer is not None:
            self._queue.put(_CLOSE)
            writer.join(30)
        reader, self._reader = self._reader, None
        if reader is not None:
            with self._read_lock:
                reader.close()

    def _write_loop(self) -> None:
        """Write what :meth:`record` queued, in batches (one transaction each), until :meth:`close`."""
        assert self.path is not None
        db = _connect(self.path)
        try:
            closing = False
            while not closing:
                batch = [self._queue.get()]
                # an entry lets the next ones join it for _GATHER_S; a flush someone waits for (publish) does not wait
                gather_until = time.monotonic() + _GATHER_S if isinstance(batch[0], tuple) else 0.0
                while batch[-1] is not _CLOSE and len(batch) < _BATCH:
                    if isinstance(batch[-1], threading.Event):
                        gather_until = 0.0
                    left = gather_until - time.monotonic()
                    try:
                        batch.append(self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait())
                    except queue.Empty:
                        break
                closing = batch[-1] is _CLOSE
                now = time.time()
                rows = [(rid, stored.model, stored.backend, stored.owner, now) for rid, stored in (i for i in batch if isinstance(i, tuple))]
                if rows:
                    try:
                        self._write(db, rows)
                    except sqlite3.Error as error:  # a full disk: the recent map still answers; never crash the gateway
                        logger.error("responses index: cannot write {}: {}", self.path, error)
                for item in batch:
                    if isinstance(item, threading.Event):
                        item.set()
        finally:
            db.close()

    def _write(self, db: sqlite3.Connection, rows: list[tuple[str, str, str, str, float]]) -> None:
        """Insert ``rows`` (an id already there keeps its first owner) and forget the oldest beyond the bound."""
        with db:
            db.executemany("INSERT OR IGNORE INTO responses (id, model, backend, owner, created) VALUES (?, ?, ?, ?, ?)", rows)
            db.execute("DELETE FROM responses WHERE seq <= (SELECT MAX(seq) FROM responses) - ?", (self.max_entries,))


def _connect(path: Path, *, create: bool = False) -> sqlite3.Connection:
    """A connection to the index file (``create``: make the directory, private to this user, and the table)."""
    if create:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.touch(mode=0o600, exist_ok=True)
    db = sqlite3.connect(path, timeout=5.0, isolation_level=None if create else "DEFERRED", check_same_thread=False)
    db.execute("PRAGMA busy_timeout = 5000")
    if create:
        db.execute("PRAGMA journal_mode = WAL")
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, _SCHEMA_VERSION):
            db.close()
            raise sqlite3.DatabaseError(f"{path}: schema version {version}, expected {_SCHEMA_VERSION}")
        db.execute(
            "CREATE TABLE IF NOT EXISTS responses (seq INTEGER PRIMARY KEY, id TEXT NOT NULL UNIQUE, model TEXT NOT NULL,"
            " backend TEXT NOT NULL, owner TEXT NOT NULL, created REAL NOT NULL)"
        )
        db.execute(f"PRAGMA user_version = {_SCHEMA_VERSION}")
    db.execute("PRAGMA synchronous = NORMAL")  # WAL: durable across a crash of the process, cheap commits
    return db


def open_response_index(state_dir: Path | None, max_entries: int = 100_000) -> ResponseIndex:
    """The index of a gateway whose state lives in ``state_dir`` (None: memory only)."""
    if state_dir is None:
        return ResponseIndex(max_entries=max_entries)
    try:
        return ResponseIndex(Path(state_dir) / FILE_NAME, max_entries)
    except (OSError, sqlite3.Error) as error:
        raise RuntimeError(f"gateway.state_dir: cannot open the responses index in {state_dir}: {error}") from None
