"""A real PostgreSQL server for tests: :mod:`benchmarks.postgres` (the benchmarks start one too, and never import
tests/), here under the names the tests use. ``postgres_missing()`` says why none can run, for a skip."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from benchmarks.postgres import DATABASE, PostgresServer, postgres_missing, server_bin

__all__ = ["DATABASE", "PostgresServer", "frozen", "own_postgres", "postgres_missing", "server_bin"]


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


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (PostgreSQL's backends: each in a session of its own)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


@contextmanager
def frozen(server: PostgresServer) -> Iterator[None]:
    """The server and every backend stopped by SIGSTOP for the block (what a frozen host or a network black hole
    looks like: connections are accepted by the kernel, nothing answers), always continued (SIGCONT) at its end."""
    postmaster = server.postmaster_pid()
    assert postmaster is not None, "PostgreSQL is not running"
    stopped = [postmaster]
    try:
        os.kill(postmaster, signal.SIGSTOP)  # first: no backend is started meanwhile
        for pid in _children(postmaster):
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
        yield
    finally:
        for pid in reversed(stopped):
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
