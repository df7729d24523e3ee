"""The usage ledger's tables, its versioned schema, and the database connections (SQLite or PostgreSQL).

Every gateway worker process writes its own rows to one database, so the schema is brought up to date under a
lock when a writer first connects: ``usage_schema_version`` holds the version, :data:`MIGRATIONS` are applied in
order, each once (SQLite: ``BEGIN IMMEDIATE``; PostgreSQL: a transaction-scoped advisory lock). A database
written by a newer gateway (a version this code does not know) is left alone: :class:`SchemaError`.

A plain list of migrations rather than Alembic: a few tables, applied at open by every writer, no separate tool or
migration scripts to ship. The batch API's tables (:mod:`gateway.tenants.batch_schema`) live in the same database and
come with migration 2, which also marks a row made by a batch line (``usage_rows.batch_id``); migration 3 adds a
batch's lease and the table of file chunks (replicas sharing one database keep files' bytes there).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Connection,
    DateTime,
    Engine,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    event,
    func,
    insert,
    inspect,
    select,
    text,
    update,
)
from sqlalchemy.engine import make_url

from gateway.tenants import batch_schema

SQLITE_FILE = "usage.sqlite3"
ERROR_CHARS = 300  # a row's error: a short reason
ROUTE_CHARS = 256  # a request path is the client's choice: bounded

metadata = MetaData()

schema_version = Table("usage_schema_version", metadata, Column("version", Integer, nullable=False))

usage_rows = Table(
    "usage_rows",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("at", DateTime(timezone=True), nullable=False),  # when the request arrived (UTC)
    Column("key_name", String(200)),  # None: an unnamed key, or an open gateway
    Column("model", String(200)),  # the route's model name; None when the request named none the gateway serves
    Column("route", String(ROUTE_CHARS), nullable=False),  # the request's path
    Column("prompt_tokens", Integer),
    Column("completion_tokens", Integer),
    Column("cached_tokens", Integer),
    Column("status", Integer, nullable=False),  # HTTP status (499: the client went away)
    Column("latency_ms", Float, nullable=False),
    Column("ttft_ms", Float),
    Column("request_id", String(128), nullable=False),
    Column("replica", Integer),
    Column("stream", Boolean, nullable=False),
    Column("error", String(ERROR_CHARS)),
    Column("batch_id", String(64)),  # the batch a row's request was a line of (None: a live request); migration 2
    Index("usage_rows_at", "at"),
    Index("usage_rows_key_at", "key_name", "at"),
    Index("usage_rows_model_at", "model", "at"),
)


class SchemaError(RuntimeError):
    """The database's schema is one this gateway cannot write (written by a newer gateway)."""


@dataclass(frozen=True)
class Migration:
    version: int
    what: str
    apply: Callable[[Connection], None]


def _v1_usage_rows(conn: Connection) -> None:
    usage_rows.create(conn, checkfirst=True)  # with its indexes (time; key and time; model and time)


def _v2_batches(conn: Connection) -> None:
    if "batch_id" not in {column["name"] for column in inspect(conn).get_columns(usage_rows.name)}:  # a v1 table
        conn.execute(text(f"ALTER TABLE {usage_rows.name} ADD COLUMN batch_id VARCHAR(64)"))
    for table in batch_schema.TABLES:
        table.create(conn, checkfirst=True)


def _v3_batch_leases(conn: Connection) -> None:
    present = {column["name"] for column in inspect(conn).get_columns(batch_schema.batches.name)}
    for name, kind in batch_schema.LEASE_COLUMNS.items():
        if name not in present:  # a v2 table (one made by migration 2 of this code has them already)
            conn.execute(text(f"ALTER TABLE {batch_schema.batches.name} ADD COLUMN {name} {kind}"))
    batch_schema.batch_file_chunks.create(conn, checkfirst=True)


MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "usage_rows: one row per request, indexed by time, key and model", _v1_usage_rows),
    Migration(2, "batches: files, batches and their lines; usage_rows.batch_id marks a batch line's row", _v2_batches),
    Migration(3, "batch leases (batches.leased_by, lease_until): one gateway runs a batch; batch_file_chunks: files' bytes", _v3_batch_leases),
)
LATEST = MIGRATIONS[-1].version
_PG_LOCK = 0x5553_4147_4531  # pg_advisory_xact_lock id of the ledger's migrations ("USAGE1")


def open_engine(url: str, *, write: bool, timeout_s: float | None = None, statement_timeout_s: float | None = None) -> Engine:
    """An engine for ``url``. SQLite: WAL (readers never wait for writers), a busy timeout (the workers' writers
    take turns), and with ``write`` every transaction ``BEGIN IMMEDIATE`` (no deadlock upgrading a read lock);
    a reader opens the file read-only and never creates it. PostgreSQL: a short connect timeout, so a down
    server fails a flush in seconds (the rows stay buffered) rather than hanging it.

    ``timeout_s``: for calls bounded by :mod:`gateway.core.bounded_calls` (its deadline): the server's statement
    timeout and the pool's wait too, and no ping at checkout (a ping on a frozen server would block where the deadline
    cannot cut it; a connection the server closed fails its call, which the caller tries once more).
    ``statement_timeout_s``: the server's statement timeout instead, where some calls are bounded longer (the batch
    store's big calls: :mod:`gateway.batches.calls`)."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        if timeout_s is None:
            return create_engine(url, pool_size=2, max_overflow=2, pool_pre_ping=True, pool_recycle=1800, connect_args={"connect_timeout": 5})
        return create_engine(
            url, pool_size=2, max_overflow=2, pool_recycle=1800, pool_timeout=timeout_s,
            connect_args={
                "connect_timeout": max(2, math.ceil(timeout_s)),
                "options": f"-c statement_timeout={math.ceil((statement_timeout_s or timeout_s) * 1000)}",
            },
        )  # fmt: skip
    path = Path(parsed.database or "")
    if write:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.touch(mode=0o600, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 10, "check_same_thread": False})
    else:
        engine = create_engine(f"sqlite:///file:{path.resolve()}?mode=ro&uri=true", connect_args={"timeout": 10, "check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _connected(dbapi: Any, record: Any) -> None:
        dbapi.isolation_level = None  # SQLAlchemy emits BEGIN itself (below), not the sqlite3 module
        cursor = dbapi.cursor()
        cursor.execute("PRAGMA busy_timeout = 10000")
        if write:
            cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute("PRAGMA synchronous = NORMAL")  # WAL: durable across a crash of the process, cheap commits
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


def migrate(engine: Engine) -> int:
    """Bring the schema to :data:`LATEST` (each missing migration once, in order, under a lock); the version."""
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SET LOCAL statement_timeout = 0"))  # a migration may take longer than one call's timeout
            conn.execute(text("SELECT pg_advisory_xact_lock(:lock)"), {"lock": _PG_LOCK})
        schema_version.create(conn, checkfirst=True)
        current = conn.execute(select(schema_version.c.version)).scalar()
        if current is None:
            conn.execute(insert(schema_version).values(version=0))
            current = 0
        if current > LATEST:
            raise SchemaError(f"usage database schema version {current} is newer than this gateway's ({LATEST})")
        for migration in MIGRATIONS:
            if migration.version > current:
                migration.apply(conn)
                conn.execute(update(schema_version).values(version=migration.version))
                current = migration.version
    return current


def read_version(conn: Connection) -> int:
    """The schema version a reader finds: 0 when no gateway wrote here yet; SchemaError when newer than known."""
    if not conn.dialect.has_table(conn, schema_version.name):
        return 0
    version = conn.execute(select(func.max(schema_version.c.version))).scalar() or 0
    if version > LATEST:
        raise SchemaError(f"usage database schema version {version} is newer than this gateway's ({LATEST})")
    return int(version)


def sqlite_file(url: str) -> Path | None:
    """The file of a SQLite URL (None for another database)."""
    parsed = make_url(url)
    return Path(parsed.database or "") if parsed.get_backend_name() == "sqlite" else None


def safe_url(url: str) -> str:
    """``url`` fit for a log line (no password)."""
    return make_url(url).render_as_string(hide_password=True)
