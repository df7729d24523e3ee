"""A real PostgreSQL server for tests: :mod:`benchmarks.postgres` (the benchmarks start one too, and never import
tests/), here under the names the tests use. ``postgres_missing()`` says why none can run, for a skip."""

from __future__ import annotations

from benchmarks.postgres import DATABASE, PostgresServer, postgres_missing, server_bin

__all__ = ["DATABASE", "PostgresServer", "postgres_missing", "server_bin"]
