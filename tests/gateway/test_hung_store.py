"""A replica whose shared store hangs (``gateway.replicas.shared``): a real PostgreSQL frozen by SIGSTOP, server and
backends (what a frozen host or a network black hole looks like: the kernel accepts the connections, nothing answers),
for longer than ``usage.database_timeout_s``, under a ``sglang-gateway serve`` process with the FAKE engine as its
``url:`` model.

Every call of the store and the ledger is bounded on the gateway's side, so while the store is frozen: a lookup of a
response this replica does not know answers 503 within the deadline, a stored-Responses create is answered, chat
requests are served, ``/ready`` and ``gateway_shared_store_up`` say the store is down, a limited key gets its local
share (1/expected), and SIGTERM ends the process (ledger rows it cannot write given up after the ledger's 15 s) --
each while PostgreSQL is still frozen: nothing waits for the thaw. Durations are printed (``-s``), not asserted: the
bound the test holds is the freeze itself, which lasts until the test has seen everything."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
import yaml

from launch.ports import pick_free_port
from tests.fake_engine import running_fake_engine
from tests.postgres import PostgresServer, frozen, own_postgres
from tests.servers import CLI, ServerProcess
from tests.waiting import wait_until

DEADLINE_S = 1.0
KEY, SHARE_KEY, ADMIN = "sk-hung-store", "sk-hung-share", "sk-hung-admin"
SHARE_RPM = 20  # while the store is down a replica keeps 1/2 of it
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
HANG_S = 20  # a client's wait that only a hang reaches (the deadline is DEADLINE_S)


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    yield from own_postgres()


@pytest.fixture()
def replica(tmp_path: Path, postgres: PostgresServer) -> Iterator[ServerProcess]:
    with running_fake_engine(tmp_path / "engine", "m") as upstream:
        gateway = {
            "keys": [
                {"name": "plain", "key": KEY},
                {"name": "share", "key": SHARE_KEY, "limits": {"requests_per_minute": SHARE_RPM}},
            ],
            "admin_keys": [ADMIN],
            "shutdown_grace_s": 5,
            "usage": {"database_url": postgres.url, "flush_interval_s": 0.2, "database_timeout_s": DEADLINE_S},
            "replicas": {"shared": True, "name": "a", "expected": 2, "sync_interval_s": 0.1},
        }
        config = tmp_path / "gateway.yaml"
        config.write_text(yaml.safe_dump({"models": {"m": {"url": upstream}}, "gateway": gateway}))
        port = pick_free_port()
        env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}
        server = ServerProcess([*CLI, "serve", str(config), "--port", str(port)], log_path=tmp_path / "gateway.log", env=env, port=port)
        try:
            server.wait_http("/ready", timeout_s=120)
            yield server
        finally:
            server.stop(grace_s=30)


def _store(url: str) -> dict:
    return httpx.get(url + "/ready", timeout=HANG_S).json()["shared_store"]


def _down(status: dict) -> dict | None:
    return status if not status["reachable"] else None


def _timed(call: object) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = call()  # type: ignore[operator]
    return response, time.monotonic() - started


def test_a_frozen_store_never_stalls_the_replica_and_sigterm_ends_it(replica: ServerProcess, postgres: PostgresServer) -> None:
    url = f"http://127.0.0.1:{replica.port}"
    wait_until(lambda: _store(url)["reachable"], "the store reachable", 60)
    plain = httpx.Client(base_url=url, headers={"authorization": f"Bearer {KEY}"}, timeout=HANG_S)
    share = httpx.Client(base_url=url, headers={"authorization": f"Bearer {SHARE_KEY}"}, timeout=HANG_S)
    known = plain.post("/v1/responses", json={"model": "m", "input": "Keep this.", "max_output_tokens": 4})
    assert known.status_code == 200, known.text
    timings: dict[str, float] = {}
    with frozen(postgres):
        froze = time.monotonic()
        # at once: the store is not known down yet, the lookup's call is cut at the deadline
        first, timings["lookup at the freeze"] = _timed(lambda: plain.get("/v1/responses/resp_elsewhere_first"))
        assert first.status_code == 503 and first.json()["error"]["code"] == "shared_store_unavailable", first.text
        # /ready says the store is down (the next round's call is cut at the deadline)
        status = wait_until(lambda: _down(_store(url)), "/ready to say the store is down", HANG_S)
        timings["/ready down after"] = time.monotonic() - froze
        assert "no answer from the database" in status["error"], status
        assert status["limits"] == "local share: 1/2 of each key's limits", status
        metrics = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {ADMIN}"}, timeout=HANG_S).text
        assert "gateway_shared_store_up 0.0" in metrics
        # known down: a response another replica may have stored is a 503 without waiting on the store
        unknown, timings["lookup, the store known down"] = _timed(lambda: plain.get("/v1/responses/resp_elsewhere"))
        assert unknown.status_code == 503 and unknown.json()["error"]["code"] == "shared_store_unavailable", unknown.text
        # a create: answered without waiting on the store (its publication waits for the rounds), the response known
        # here served as usual
        created, timings["stored-Responses create"] = _timed(
            lambda: plain.post("/v1/responses", json={"model": "m", "input": "Hello.", "max_output_tokens": 4})
        )
        assert created.status_code == 200, created.text
        assert plain.get(f"/v1/responses/{known.json()['id']}").status_code == 200
        # the ledger's reads are bounded too: /admin/usage says the database cannot be read now
        usage, timings["/admin/usage"] = _timed(lambda: httpx.get(url + "/admin/usage", headers={"authorization": f"Bearer {ADMIN}"}, timeout=HANG_S))
        assert usage.status_code == 503 and usage.json()["error"]["code"] == "usage_unavailable", usage.text
        # requests that need no shared state are served; a limited key gets its local share of its limit
        chat, timings["chat"] = _timed(lambda: plain.post("/v1/chat/completions", json=CHAT))
        assert chat.status_code == 200, chat.text
        started = time.monotonic()
        admitted = sum(share.post("/v1/chat/completions", json=CHAT).status_code == 200 for _ in range(SHARE_RPM))
        refilled = int((time.monotonic() - started) * SHARE_RPM / 60 / 2) + 1
        assert SHARE_RPM // 2 <= admitted <= SHARE_RPM // 2 + refilled, admitted
        # SIGTERM: the process ends while the store is still frozen (the ledger gives its rows up after 15 s)
        signalled = time.monotonic()
        replica.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: replica.proc.poll() is not None, lambda: f"the replica still runs after SIGTERM:\n{replica.log(3000)}", 5 + 15 + HANG_S)
        timings["SIGTERM to exit"] = time.monotonic() - signalled
        assert replica.proc.returncode == 0, replica.log(3000)
        assert postgres.postmaster_pid() is not None  # still frozen: the exit did not wait for the thaw
    print({name: round(seconds, 2) for name, seconds in timings.items()})
    log = replica.log()
    assert "shared store: unreachable (DeadlineExceeded: no answer from the database in 1 s)" in log, log[-3000:]
    assert "Traceback" not in log, log[-5000:]


def test_a_frozen_ledger_fails_its_writes_at_the_deadline_and_loses_no_row_once_thawed(postgres: PostgresServer) -> None:
    """The ledger's writer against the frozen server: each flush fails at the deadline (its connection cut, the rows
    kept), nothing hangs; after the thaw the pool holds no stuck connection and every row is written once."""
    from gateway.config import UsageSettings
    from gateway.tenants.ledger import Ledger, UsageRow

    def row(rid: str) -> UsageRow:
        return UsageRow(time.time(), "k", "m", "/v1/chat/completions", 1, 2, None, 200, 1.0, None, rid, None, False, None)

    async def scenario() -> tuple[list[tuple[bool, int, float]], bool, int]:
        ledger = Ledger(UsageSettings(database_timeout_s=DEADLINE_S), postgres.url)
        try:
            ledger.record(row("frozen-before"))
            assert await ledger.flush()  # the schema made, a connection pooled
            tries = []
            with frozen(postgres):
                for index in range(3):
                    ledger.record(row(f"frozen-{index}"))
                    started = time.monotonic()
                    tries.append((await ledger.flush(), ledger.buffered, time.monotonic() - started))
            return tries, await ledger.flush(), ledger.failed_writes
        finally:
            await ledger.close()

    tries, after, failed = asyncio.run(scenario())
    print({"flushes while frozen (ok, buffered, seconds)": [(ok, buffered, round(s, 2)) for ok, buffered, s in tries]})
    assert [(ok, buffered) for ok, buffered, _ in tries] == [(False, 1), (False, 2), (False, 3)]
    assert after is True and failed == 3
    ids = ["frozen-before", "frozen-0", "frozen-1", "frozen-2"]
    with psycopg.connect(f"host=127.0.0.1 port={postgres.port} user=postgres dbname=ledger") as conn:
        written = [rid for (rid,) in conn.execute("SELECT request_id FROM usage_rows WHERE request_id LIKE 'frozen-%' ORDER BY id")]
    assert sorted(written) == sorted(ids), written  # each once


def test_the_store_said_down_by_its_deadline_answers_again_after_the_thaw(postgres: PostgresServer) -> None:
    """The shared store's call cut at the deadline marks it down; after the thaw the next call answers on a fresh
    connection (the cut one was discarded, none waits in the pool on the old socket)."""
    from sqlalchemy import text

    from gateway.core.shared_store import SharedStore, StoreUnavailable

    async def scenario() -> tuple[str, bool, int]:
        store = SharedStore(postgres.url, "t", 0.25, 2, deadline_s=DEADLINE_S)
        try:
            assert await store.run(lambda conn: conn.execute(text("SELECT 1")).scalar()) == 1
            with frozen(postgres):
                with pytest.raises(StoreUnavailable) as failed:
                    await store.run(lambda conn: conn.execute(text("SELECT 1")).scalar())
                down = store.down
            answer = await store.run(lambda conn: conn.execute(text("SELECT 2")).scalar())
            return str(failed.value), down and store.reachable, answer
        finally:
            await store.close()

    reason, went_down_and_back, answer = asyncio.run(scenario())
    assert reason == f"DeadlineExceeded: no answer from the database in {DEADLINE_S:g} s" and went_down_and_back and answer == 2
