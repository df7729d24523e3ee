"""Reading the usage ledger: totals by key, model and day, within a time range (``GET /admin/usage``, ``sglang-gateway usage``).

Both read the database, not a gateway's memory: with worker processes, a row reaches it within
``usage.flush_interval_s`` of its request's end.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Engine, Integer, case, cast, func, literal_column, or_, select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql import ColumnElement

from gateway.tenants.ledger_schema import open_engine, read_version, sqlite_file, usage_rows

GROUPS = ("key", "model", "day")
COLUMNS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "errors")
_NUMBER = re.compile(r"^-?\d+(\.\d+)?$")


class BadParameter(ValueError):
    """A query parameter that cannot be read; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


@dataclass(frozen=True)
class UsageQuery:
    key: str | None = None
    model: str | None = None
    since: datetime | None = None  # inclusive
    until: datetime | None = None  # exclusive
    group_by: tuple[str, ...] = field(default=())

    def filters(self) -> dict[str, Any]:
        """The query as given, for the answer (times in ISO 8601, UTC)."""
        return {
            "key": self.key, "model": self.model,
            "since": self.since.isoformat() if self.since else None, "until": self.until.isoformat() if self.until else None,
            "group_by": list(self.group_by),
        }  # fmt: skip


def parse_time(param: str, text: str) -> datetime:
    """ISO 8601 (a date, or a date and time; without an offset it is UTC) or unix seconds."""
    value = text.strip()
    try:
        if _NUMBER.match(value):
            return datetime.fromtimestamp(float(value), UTC)
        parsed = datetime.fromisoformat(value)
    except (ValueError, OverflowError, OSError):
        raise BadParameter(param, f"{text!r} is not an ISO 8601 time nor unix seconds") from None
    return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)


def parse_group_by(param: str, text: str) -> tuple[str, ...]:
    """A comma list of ``key``, ``model``, ``day`` (each once)."""
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [name for name in names if name not in GROUPS]
    if unknown:
        raise BadParameter(param, f"{unknown[0]!r} is not one of {', '.join(GROUPS)}")
    if len(set(names)) != len(names):
        raise BadParameter(param, "a name is given twice")
    return names


def parse_query(key: str | None, model: str | None, since: str | None, until: str | None, group_by: str | None,
                names: dict[str, str] | None = None) -> UsageQuery:  # fmt: skip
    """A query from its text parameters; :class:`BadParameter` names the first bad one (by ``names``: a CLI's flags)."""
    names = names or {}
    query = UsageQuery(
        key=key or None, model=model or None,
        since=parse_time(names.get("since", "since"), since) if since else None,
        until=parse_time(names.get("until", "until"), until) if until else None,
        group_by=parse_group_by(names.get("group_by", "group_by"), group_by) if group_by else (),
    )  # fmt: skip
    if query.since and query.until and query.since >= query.until:
        raise BadParameter(names.get("until", "until"), "must be later than since")
    return query


def _day(conn: Connection) -> ColumnElement[Any]:
    at = usage_rows.c.at
    if conn.dialect.name == "postgresql":
        # literals, not bound parameters: GROUP BY must repeat the selected expression exactly
        return func.to_char(func.timezone(literal_column("'UTC'"), at), literal_column("'YYYY-MM-DD'"))
    return func.date(at)  # SQLite keeps the UTC time as text


def run_query(conn: Connection, query: UsageQuery) -> list[dict[str, Any]]:
    """One row per group (one row in all without ``group_by``): requests, tokens, errors (status >= 400, or an
    error noted after the status, such as a cut stream); groups in the order of their names."""
    if read_version(conn) == 0:
        return run_query_empty(query)
    t = usage_rows.c
    groups = {"key": t.key_name, "model": t.model, "day": _day(conn)}
    chosen = [groups[name].label(name) for name in query.group_by]
    failed = case((or_(t.status >= 400, t.error.is_not(None)), 1), else_=0)
    totals = [
        func.count().label("requests"),
        func.coalesce(func.sum(t.prompt_tokens), 0).label("prompt_tokens"),
        func.coalesce(func.sum(t.completion_tokens), 0).label("completion_tokens"),
        func.coalesce(func.sum(t.cached_tokens), 0).label("cached_tokens"),
        func.coalesce(func.sum(cast(failed, Integer)), 0).label("errors"),
    ]
    statement = select(*chosen, *totals)
    if query.key is not None:
        statement = statement.where(t.key_name == query.key)
    if query.model is not None:
        statement = statement.where(t.model == query.model)
    if query.since is not None:
        statement = statement.where(t.at >= query.since)
    if query.until is not None:
        statement = statement.where(t.at < query.until)
    if chosen:
        statement = statement.group_by(*chosen).order_by(*chosen)
    rows = [dict(row._mapping) for row in conn.execute(statement)]
    return [{**row, **{name: int(row[name]) for name in COLUMNS}} for row in rows]


class UsageReader:
    """Reads one usage database (its own connections, read-only for SQLite); blocking: call it off the event loop."""

    def __init__(self, url: str, timeout_s: float | None = None) -> None:
        self.url = url
        self.timeout_s = timeout_s  # its calls bounded by a deadline (gateway.core.bounded_calls): see open_engine
        self._engine: Engine | None = None

    def engine(self) -> Engine:
        """Its engine (opened at the first call)."""
        if self._engine is None:
            self._engine = open_engine(self.url, write=False, timeout_s=self.timeout_s)
        return self._engine

    def read(self, query: UsageQuery) -> list[dict[str, Any]]:
        file = sqlite_file(self.url)
        if file is not None and not file.exists():  # no gateway wrote here yet
            return run_query_empty(query)
        try:
            with self.engine().connect() as conn:
                return run_query(conn, query)
        except DBAPIError as error:
            if not error.connection_invalidated:
                raise
        with self.engine().connect() as conn:  # a pooled connection the server had closed (a restart): once more
            return run_query(conn, query)

    def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.dispose()


def run_query_empty(query: UsageQuery) -> list[dict[str, Any]]:
    """The answer with no rows at all: no groups, or one total of zeros."""
    return [] if query.group_by else [{name: 0 for name in COLUMNS}]
