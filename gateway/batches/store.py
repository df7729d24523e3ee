"""Files, batches and their lines in the usage ledger's database (SQLite by default, PostgreSQL by URL).

Synchronous SQLAlchemy, called in a thread by the API and the runner (:class:`gateway.batches.calls.BatchCalls`:
bounded on PostgreSQL). Every line's end
is one transaction that also counts it on its batch, and only a line still ``queued`` can end: a line is counted
once whatever runs it, and a restarted gateway finds exactly the lines that never ended still queued.

A batch is run by one gateway at a time, the holder of its lease (:meth:`BatchStore.claim`): taken in one ``UPDATE``
whose ``WHERE`` admits only a batch unleased, leased by the same holder, or whose lease ran out (PostgreSQL re-reads
a row another transaction just changed before it updates it, SQLite writes one transaction at a time, so of two
claimers one wins), renewed while it runs, released at its end. Lease times are the database's clock, so replicas'
clocks need not agree.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    Connection,
    Engine,
    Float,
    and_,
    cast,
    delete,
    extract,
    func,
    insert,
    literal,
    or_,
    select,
    update,
)
from sqlalchemy.sql.elements import ColumnElement

from gateway.batches.shapes import ACTIVE, BatchObject, FileObject, RequestCounts
from gateway.tenants.batch_schema import batch_files, batch_lines, batches
from gateway.tenants.ledger_schema import migrate, open_engine

RESERVED = "reserved"  # a batch being created: counts against its key's limits and holds its input file; no API shows it
RESERVATION_S = 3600  # a reservation older than this was left by a process that died mid-create: no longer counted


@dataclass(frozen=True)
class LineEnd:
    """How one line ended: ``done`` (an HTTP answer, any status), ``failed`` (the gateway could not get one),
    ``expired`` or ``cancelled`` (never sent)."""

    state: str
    status_code: int | None = None
    request_id: str | None = None
    result: Any = None  # the answer's JSON body, or an error object {"code", "message"}
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class BatchStore:
    def __init__(self, url: str, timeout_s: float | None = None, statement_timeout_s: float | None = None) -> None:
        """``timeout_s``: the deadline of the calls (PostgreSQL's connect and pool timeouts, no ping at checkout),
        ``statement_timeout_s``: the server's own bound of a statement (that of the longest call):
        :func:`gateway.tenants.ledger_schema.open_engine`. SQLite's engine is the same with or without them."""
        self.engine: Engine = open_engine(url, write=True, timeout_s=timeout_s, statement_timeout_s=statement_timeout_s)
        migrate(self.engine)
        # Reads of SQLite in plain transactions: every write transaction is BEGIN IMMEDIATE, one at a time, so a
        # read in one would wait behind a create's insert of 50,000 lines; WAL readers wait for no writer.
        self.reads: Engine = open_engine(url, write=False) if self.engine.dialect.name == "sqlite" else self.engine

    def close(self) -> None:
        self.engine.dispose()
        self.reads.dispose()

    # ---------------------------------------------------------------- files
    def add_file(self, file_id: str, owner: str, purpose: str, filename: str, size: int) -> FileObject:
        """Record a written file (replacing a record of the same id: a finalization redone after a restart)."""
        row = {"id": file_id, "owner": owner, "purpose": purpose, "filename": filename[:256], "bytes": size, "created_at": int(time.time())}
        with self.engine.begin() as conn:
            conn.execute(delete(batch_files).where(batch_files.c.id == file_id))
            conn.execute(insert(batch_files).values(**row))
        return _file(row)

    def add_upload(self, file_id: str, owner: str, filename: str, size: int, max_files: int | None, max_bytes: int | None) -> FileObject | tuple[int, int]:
        """Record an uploaded file unless it takes ``owner`` over ``max_files`` files or ``max_bytes`` bytes kept
        (then its (files, bytes) kept before it), under the owner's lock."""
        row = {"id": file_id, "owner": owner, "purpose": "batch", "filename": filename[:256], "bytes": size, "created_at": int(time.time())}
        with self.engine.begin() as conn:
            if max_files is not None or max_bytes is not None:
                _lock_owner(conn, owner)
                count, kept = _usage(conn, owner)
                if (max_files is not None and count + 1 > max_files) or (max_bytes is not None and kept + size > max_bytes):
                    return count, kept
            conn.execute(insert(batch_files).values(**row))
        return _file(row)

    def file(self, file_id: str, owner: str | None) -> FileObject | None:
        """``file_id`` if ``owner`` holds it (None: whoever does)."""
        row = self._owned(batch_files, file_id, owner)
        return _file(row) if row is not None else None

    def files(self, owner: str, purpose: str | None, after: str | None, limit: int) -> tuple[list[FileObject], bool]:
        query = select(batch_files).where(batch_files.c.owner == owner)
        if purpose:
            query = query.where(batch_files.c.purpose == purpose)
        rows = self._page(query, batch_files, after, limit)
        return [_file(row) for row in rows[:limit]], len(rows) > limit

    def delete_file(self, file_id: str, free_bytes: Callable[[], None]) -> str | None:
        """Delete ``file_id`` unless a batch being created or not ended reads it (that batch's id is returned, nothing
        deleted). The bytes go first (``free_bytes``), then the row: on a full disk, the bytes' space is what lets
        the database write the row's delete. One transaction holding the file's row, so a create that reserves a
        batch of it (:meth:`reserve`) comes wholly before or after."""
        with self.engine.begin() as conn:
            if conn.execute(select(batch_files.c.id).where(batch_files.c.id == file_id).with_for_update()).first() is None:
                return None
            using = conn.execute(select(batches.c.id).where(batches.c.input_file_id == file_id, _holding(conn)).limit(1)).scalar()
            if using is not None:
                return str(using)
            free_bytes()
            conn.execute(delete(batch_files).where(batch_files.c.id == file_id))
        return None

    def usage(self, owner: str) -> tuple[int, int]:
        """(files, bytes) ``owner`` keeps (uploads and batches' result files): what its file quotas count."""
        with self.reads.begin() as conn:
            return _usage(conn, owner)

    # ---------------------------------------------------------------- batches
    def reserve(self, row: dict[str, Any], max_active: int, max_queued: int, input_owner: str | None) -> tuple[int, int] | None:
        """Record ``row`` as a reservation (status :data:`RESERVED`) if its owner has fewer than ``max_active``
        unfinished batches (reservations included) and fewer than ``max_queued`` lines queued, and, with
        ``input_owner``, its input file is still that owner's; None when reserved, else (unfinished batches, queued
        lines) of the owner ((-1, -1): the input file is gone). Under the owner's lock (PostgreSQL; SQLite writes one
        transaction at a time), so concurrent creates of one key are counted one after the other."""
        with self.engine.begin() as conn:
            _lock_owner(conn, row["owner"])
            if input_owner is not None:
                found = select(batch_files.c.id).where(batch_files.c.id == row["input_file_id"], batch_files.c.owner == input_owner)
                if conn.execute(found.with_for_update()).first() is None:
                    return -1, -1
            stale = and_(batches.c.owner == row["owner"], batches.c.status == RESERVED, batches.c.created_at < int(time.time()) - RESERVATION_S)
            conn.execute(delete(batches).where(stale))
            active, queued = _load(conn, row["owner"])
            if active >= max_active or queued >= max_queued:
                return active, queued
            conn.execute(insert(batches).values(**{**row, "status": RESERVED, "total": 0, "completed": 0, "failed": 0}))
        return None

    def create_batch(self, row: dict[str, Any], custom_ids: list[str]) -> BatchObject:
        """The batch and its lines (all queued), in one transaction, with no limit asked (a test's, a tool's)."""
        row = {**row, "total": len(custom_ids), "completed": 0, "failed": 0}
        lines = [{"batch_id": row["id"], "line": index, "custom_id": custom_id, "state": "queued"} for index, custom_id in enumerate(custom_ids)]
        with self.engine.begin() as conn:
            conn.execute(insert(batches).values(**row))
            for start in range(0, len(lines), 1000):
                conn.execute(insert(batch_lines), lines[start : start + 1000])
        return _batch(row)

    def fill_reservation(self, batch_id: str, custom_ids: list[str], max_queued: int) -> BatchObject | int:
        """Turn the reservation ``batch_id`` into a batch of ``custom_ids`` (all queued, status ``validating``), in one
        transaction under its owner's lock: the batch exists whole or not at all. The owner's queued lines instead
        (the reservation left as it is) when the new ones would take them over ``max_queued``."""
        lines = [{"batch_id": batch_id, "line": index, "custom_id": custom_id, "state": "queued"} for index, custom_id in enumerate(custom_ids)]
        with self.engine.begin() as conn:
            owner = conn.execute(select(batches.c.owner).where(batches.c.id == batch_id, batches.c.status == RESERVED)).scalar()
            if owner is None:
                raise LookupError(f"no reservation {batch_id}")
            _lock_owner(conn, owner)
            _, queued = _load(conn, owner)
            if queued + len(custom_ids) > max_queued:
                return queued
            conn.execute(update(batches).where(batches.c.id == batch_id).values(status="validating", total=len(custom_ids)))
            for start in range(0, len(lines), 1000):
                conn.execute(insert(batch_lines), lines[start : start + 1000])
            row = conn.execute(select(batches).where(batches.c.id == batch_id)).mappings().one()
        return _batch(row)

    def unreserve(self, batch_id: str) -> None:
        """Drop the reservation ``batch_id`` (its create was refused or failed)."""
        with self.engine.begin() as conn:
            conn.execute(delete(batches).where(batches.c.id == batch_id, batches.c.status == RESERVED))

    def batch(self, batch_id: str, owner: str | None) -> BatchObject | None:
        """``batch_id`` if ``owner`` holds it (None: whoever does)."""
        row = self._owned(batches, batch_id, owner)
        return _batch(row) if row is not None and row["status"] != RESERVED else None

    def owner_of(self, batch_id: str) -> tuple[str, str | None] | None:
        """(owner, key name) of a batch: whom its lines run as."""
        with self.reads.begin() as conn:
            row = conn.execute(select(batches.c.owner, batches.c.key_name).where(batches.c.id == batch_id)).first()
        return (row[0], row[1]) if row is not None else None

    def batches(
        self, owner: str | None, after: str | None, limit: int, endpoints: Iterable[str] | None = None, before: str | None = None
    ) -> tuple[list[BatchObject], bool]:
        """``owner``'s batches (of ``endpoints`` only, if given), newest first: those after the id ``after``, or the
        ``limit`` just before the id ``before``; and whether more lie beyond them."""
        query = select(batches).where(batches.c.status != RESERVED)
        if owner is not None:
            query = query.where(batches.c.owner == owner)
        if endpoints is not None:
            query = query.where(batches.c.endpoint.in_(tuple(endpoints)))
        rows = self._page(query, batches, after, limit, before)
        return [_batch(row) for row in rows[:limit]] if before is None else [_batch(row) for row in rows[-limit:]], len(rows) > limit

    def delete_batch(self, batch_id: str) -> None:
        """A batch and its lines (its files are the caller's to delete)."""
        with self.engine.begin() as conn:
            conn.execute(delete(batch_lines).where(batch_lines.c.batch_id == batch_id))
            conn.execute(delete(batches).where(batches.c.id == batch_id))

    def every_batch(self, after: str | None, limit: int) -> tuple[list[tuple[BatchObject, dict[str, Any]]], bool]:
        """Every key's batches, each with who owns it and runs it (``key``, ``leased_by``): the admin's list, one query."""
        rows = self._page(select(batches).where(batches.c.status != RESERVED), batches, after, limit)
        return [(_batch(row), {"key": row["key_name"], "leased_by": row["leased_by"]}) for row in rows[:limit]], len(rows) > limit

    def load(self, owner: str) -> tuple[int, int]:
        """(unfinished batches, lines still queued) of ``owner``: what the per-key limits count."""
        with self.engine.begin() as conn:
            return _load(conn, owner)

    def unfinished(self) -> list[BatchObject]:
        """Every batch not yet ended, oldest first: what the runner takes up (at start: what a restart resumes)."""
        query = select(batches).where(batches.c.status.in_(ACTIVE)).order_by(batches.c.created_at, batches.c.id)
        with self.reads.begin() as conn:
            return [_batch(row) for row in conn.execute(query).mappings()]

    def status(self, batch_id: str) -> str | None:
        with self.reads.begin() as conn:
            return conn.execute(select(batches.c.status).where(batches.c.id == batch_id)).scalar()

    def move(self, batch_id: str, to: str, only_from: Iterable[str], **values: Any) -> bool:
        """Set ``batch_id``'s status to ``to`` (with its ``<to>_at`` time and ``values``) if it is one of ``only_from``."""
        stamp = {f"{to}_at": int(time.time())} if f"{to}_at" in batches.c else {}
        query = update(batches).where(batches.c.id == batch_id, batches.c.status.in_(tuple(only_from)))
        with self.engine.begin() as conn:
            return conn.execute(query.values(status=to, **stamp, **values)).rowcount == 1

    # ---------------------------------------------------------------- leases
    def claim(self, batch_id: str, holder: str, lease_s: float) -> bool:
        """Take ``batch_id``'s lease for ``lease_s`` if the batch is unfinished and its lease is free, ``holder``'s
        already, or ran out; True if taken (one claimer of several wins)."""
        with self.engine.begin() as conn:
            now = _now(conn)
            free = or_(batches.c.leased_by.is_(None), batches.c.leased_by == holder, batches.c.lease_until.is_(None), batches.c.lease_until < now)
            query = update(batches).where(batches.c.id == batch_id, batches.c.status.in_(ACTIVE), free)
            return conn.execute(query.values(leased_by=holder, lease_until=now + literal(float(lease_s)))).rowcount == 1

    def renew(self, batch_id: str, holder: str, lease_s: float) -> bool:
        """Extend ``holder``'s lease by ``lease_s`` from now; False if another holds it (``holder``'s ran out and
        was taken over: it must start no more line of the batch)."""
        with self.engine.begin() as conn:
            query = update(batches).where(batches.c.id == batch_id, batches.c.leased_by == holder)
            return conn.execute(query.values(lease_until=_now(conn) + literal(float(lease_s)))).rowcount == 1

    def release(self, batch_id: str, holder: str) -> None:
        """Give up ``holder``'s lease (another gateway may take the batch up at once)."""
        with self.engine.begin() as conn:
            conn.execute(update(batches).where(batches.c.id == batch_id, batches.c.leased_by == holder).values(leased_by=None, lease_until=None))

    def lease(self, batch_id: str) -> tuple[str | None, float | None]:
        """(holder, seconds left on the database's clock; negative: ran out) of ``batch_id``'s lease."""
        with self.reads.begin() as conn:
            row = conn.execute(select(batches.c.leased_by, batches.c.lease_until - _now(conn)).where(batches.c.id == batch_id)).first()
        return (row[0], float(row[1]) if row[1] is not None else None) if row is not None else (None, None)

    # ---------------------------------------------------------------- lines
    def queued(self, batch_id: str) -> list[int]:
        query = select(batch_lines.c.line).where(batch_lines.c.batch_id == batch_id, batch_lines.c.state == "queued")
        with self.reads.begin() as conn:
            return sorted(conn.execute(query).scalars())

    def end_line(self, batch_id: str, line: int, end: LineEnd) -> bool:
        """Record how a queued line ended and count it on its batch (one transaction); False if it had ended already."""
        values = {
            "state": end.state, "status_code": end.status_code, "request_id": end.request_id,
            "result": json.dumps(end.result) if end.result is not None else None,
            "prompt_tokens": end.prompt_tokens, "completion_tokens": end.completion_tokens,
        }  # fmt: skip
        where = and_(batch_lines.c.batch_id == batch_id, batch_lines.c.line == line, batch_lines.c.state == "queued")
        with self.engine.begin() as conn:
            if conn.execute(update(batch_lines).where(where).values(**values)).rowcount != 1:
                return False
            counted = _counted_as(end)
            if counted is not None:
                column = batches.c[counted]
                conn.execute(update(batches).where(batches.c.id == batch_id).values({column: column + 1}))
        return True

    def end_queued(self, batch_id: str, state: str, error: dict[str, str]) -> int:
        """Every line still queued ends as ``state`` (expired, cancelled) with ``error``; how many."""
        where = and_(batch_lines.c.batch_id == batch_id, batch_lines.c.state == "queued")
        with self.engine.begin() as conn:
            return conn.execute(update(batch_lines).where(where).values(state=state, result=json.dumps(error))).rowcount

    def ended_lines(self, batch_id: str, after_line: int = -1, limit: int | None = None) -> list[dict[str, Any]]:
        """Every line that ended (or the first ``limit`` after the line ``after_line``), in input order, with its answer."""
        where = and_(batch_lines.c.batch_id == batch_id, batch_lines.c.state != "queued", batch_lines.c.line > after_line)
        query = select(batch_lines).where(where).order_by(batch_lines.c.line).limit(limit)
        with self.reads.begin() as conn:
            return [dict(row) for row in conn.execute(query).mappings()]

    def _owned(self, table: Any, object_id: str, owner: str | None) -> Any:
        """The row ``object_id`` of ``table`` (files, batches) if ``owner`` holds it (None: whoever does)."""
        query = select(table).where(table.c.id == object_id)
        if owner is not None:
            query = query.where(table.c.owner == owner)
        with self.reads.begin() as conn:
            return conn.execute(query).mappings().first()

    def _page(self, query: Any, table: Any, after: str | None, limit: int, before: str | None = None) -> list[Any]:
        """Newest first, ``limit`` + 1 rows (the extra one says ``has_more``), starting after the id ``after``; with
        ``before``, the ``limit`` + 1 rows just newer than that id (the extra one, the first, saying more are newer)."""
        if before is not None:
            with self.reads.begin() as conn:
                cursor = conn.execute(select(table.c.created_at).where(table.c.id == before)).scalar()
            if cursor is not None:
                query = query.where(or_(table.c.created_at > cursor, and_(table.c.created_at == cursor, table.c.id > before)))
            query = query.order_by(table.c.created_at.asc(), table.c.id.asc()).limit(limit + 1)
            with self.reads.begin() as conn:
                return list(reversed(list(conn.execute(query).mappings())))
        if after is not None:
            with self.reads.begin() as conn:
                cursor = conn.execute(select(table.c.created_at).where(table.c.id == after)).scalar()
            if cursor is not None:
                query = query.where(or_(table.c.created_at < cursor, and_(table.c.created_at == cursor, table.c.id < after)))
        query = query.order_by(table.c.created_at.desc(), table.c.id.desc()).limit(limit + 1)
        with self.reads.begin() as conn:
            return list(conn.execute(query).mappings())


def _holding(conn: Connection) -> ColumnElement[bool]:
    """Batches that hold their input file: not ended, or reserved by a create still under way."""
    recent = and_(batches.c.status == RESERVED, batches.c.created_at >= int(time.time()) - RESERVATION_S)
    return or_(batches.c.status.in_(ACTIVE), recent)


def _load(conn: Connection, owner: str) -> tuple[int, int]:
    """(unfinished batches, reservations included; lines still queued) of ``owner``."""
    active = and_(batches.c.owner == owner, _holding(conn))
    count = conn.execute(select(func.count()).where(active)).scalar() or 0
    queued = conn.execute(select(func.coalesce(func.sum(batches.c.total - batches.c.completed - batches.c.failed), 0)).where(active)).scalar()
    return int(count), int(queued or 0)


def _usage(conn: Connection, owner: str) -> tuple[int, int]:
    """(files, bytes) ``owner`` keeps."""
    query = select(func.count(), func.coalesce(func.sum(batch_files.c.bytes), 0)).where(batch_files.c.owner == owner)
    count, size = conn.execute(query).one()
    return int(count), int(size)


def _lock_owner(conn: Connection, owner: str) -> None:
    """Hold ``owner``'s lock to the end of the transaction (PostgreSQL: an advisory lock; SQLite's write
    transactions, ``BEGIN IMMEDIATE``, run one at a time already)."""
    if conn.dialect.name == "postgresql":
        key = int.from_bytes(hashlib.blake2b(f"batches:{owner}".encode(), digest_size=8).digest(), "big", signed=True)
        conn.execute(select(func.pg_advisory_xact_lock(literal(key))))


def _now(conn: Connection) -> ColumnElement[float]:
    """The database's clock in unix seconds, as an SQL expression (every replica reads the same clock)."""
    if conn.dialect.name == "postgresql":
        return cast(extract("epoch", func.clock_timestamp()), Float)
    return (func.julianday("now") - 2440587.5) * 86400.0  # SQLite: one host's clock, to the millisecond


def _counted_as(end: LineEnd) -> str | None:
    """Which request count a line's end adds to: a 200 answer is completed; any other answer, or none, failed;
    a line never sent (expired, cancelled) neither."""
    if end.state == "done" and end.status_code == 200:
        return "completed"
    if end.state in ("done", "failed"):
        return "failed"
    return None


def _file(row: Any) -> FileObject:
    return FileObject(id=row["id"], bytes=row["bytes"], created_at=row["created_at"], filename=row["filename"], purpose=row["purpose"])


def _batch(row: Any) -> BatchObject:
    times = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at")
    return BatchObject(
        id=row["id"], endpoint=row["endpoint"], input_file_id=row["input_file_id"], completion_window=row["completion_window"],
        status=row["status"], output_file_id=row.get("output_file_id"), error_file_id=row.get("error_file_id"),
        created_at=row["created_at"], expires_at=row["expires_at"], **{name: row.get(name) for name in times},
        errors=json.loads(row["errors"]) if row.get("errors") else None,
        request_counts=RequestCounts(total=row["total"], completed=row["completed"], failed=row["failed"]),
        metadata=json.loads(row["metadata"]) if row.get("metadata") else None,
    )  # fmt: skip
