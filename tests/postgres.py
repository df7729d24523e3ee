"""A real PostgreSQL server for tests: :mod:`benchmarks.postgres` (the benchmarks start one too, and never import
tests/), here under the names the tests use. ``postgres_missing()`` says why none can run, for a skip."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from benchmarks.postgres import DATABASE, PostgresServer, postgres_missing, server_bin

__all__ = ["DATABASE", "PostgresServer", "own_postgres", "postgres_missing", "server_bin"]


def own_postgres() -> Iterator[PostgresServer]:
    """A fixture's body: a PostgreSQL server of its own, removed after; the test skipped, saying why, where none can run."""
    why = postgres_missing()
    if why is not None:
        pytest.skip(f"PostgreSQL tests skipped: {why}")
    server = PostgresServer()
    try:
        yield server.init()
    finally:
        server.remove()
