"""A batch's lease and files' bytes in the database, on the store itself (SQLite and a real PostgreSQL): of two
claimers one wins; a lease that ran out is taken over and its old holder can no longer renew it; the same holder
takes its own lease back (a lone gateway after a restart); a database of schema version 2 is brought up to 3 with its
batches kept; a file written in chunks reads back whole, line by line, from any store of the same database."""

from __future__ import annotations

import io
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select, text, update

from gateway.batches.files import CHUNK, DatabaseFiles, jsonl_lines
from gateway.batches.store import BatchStore, LineEnd
from gateway.tenants.batch_schema import batch_file_chunks, batches
from gateway.tenants.ledger_schema import LATEST, schema_version
from tests.batches.helpers import new_database


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'usage.sqlite3'}"
    return new_database(request.getfixturevalue("postgres"))


@pytest.fixture
def store(url: str) -> Iterator[BatchStore]:
    opened = BatchStore(url)
    try:
        yield opened
    finally:
        opened.close()


def _batch(store: BatchStore, lines: int = 2) -> str:
    now = int(time.time())
    batch_id = "batch_" + secrets.token_hex(12)
    row = {
        "id": batch_id, "owner": "o", "key_name": None, "endpoint": "/v1/chat/completions", "input_file_id": "file-x",
        "completion_window": "24h", "status": "in_progress", "created_at": now, "expires_at": now + 86400,
    }  # fmt: skip
    store.create_batch(row, [f"line-{i}" for i in range(lines)])
    return batch_id


def _run_out(store: BatchStore, batch_id: str) -> None:
    """The lease's time passes (as a holder that stopped renewing it lets it): its end moved a minute back."""
    with store.engine.begin() as conn:
        conn.execute(update(batches).where(batches.c.id == batch_id).values(lease_until=batches.c.lease_until - 60))


def test_of_two_claimers_at_once_one_wins(url: str) -> None:
    stores = [BatchStore(url), BatchStore(url)]
    try:
        ids = [_batch(stores[0]) for _ in range(20)]
        wins: dict[str, list[str]] = {batch_id: [] for batch_id in ids}
        start = threading.Barrier(2)

        def claimer(store: BatchStore, holder: str) -> None:
            start.wait()
            for batch_id in ids:
                if store.claim(batch_id, holder, 30):
                    wins[batch_id].append(holder)

        threads = [threading.Thread(target=claimer, args=(store, name)) for store, name in zip(stores, ("a", "b"), strict=True)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert all(len(winners) == 1 for winners in wins.values()), wins
        for batch_id, winners in wins.items():
            holder, left = stores[0].lease(batch_id)
            assert holder == winners[0] and left is not None and 25 < left <= 30, (holder, left)
    finally:
        for store in stores:
            store.close()


def test_a_lease_that_ran_out_is_taken_over_and_its_old_holder_stops(store: BatchStore) -> None:
    batch_id = _batch(store)
    assert store.claim(batch_id, "a", 30)
    assert not store.claim(batch_id, "b", 30)  # held
    assert store.renew(batch_id, "a", 30)
    _run_out(store, batch_id)
    left = store.lease(batch_id)[1]
    assert left is not None and left < 0
    assert store.claim(batch_id, "b", 30)  # ran out: taken over
    assert store.lease(batch_id)[0] == "b"
    assert not store.renew(batch_id, "a", 30)  # the old holder learns it lost the batch
    store.release(batch_id, "a")  # and cannot release another's lease
    assert store.lease(batch_id)[0] == "b" and not store.claim(batch_id, "a", 30)
    store.release(batch_id, "b")
    assert store.lease(batch_id) == (None, None)
    assert store.claim(batch_id, "a", 30)  # released: free at once


def test_a_holder_takes_its_own_lease_back_and_an_ended_batch_is_not_claimed(store: BatchStore) -> None:
    batch_id = _batch(store, lines=1)
    assert store.claim(batch_id, "local", 30)
    assert store.claim(batch_id, "local", 30)  # a lone gateway restarted after a kill: its lease is its own
    assert store.end_line(batch_id, 0, LineEnd("done", 200, "r", {"ok": True}))
    assert store.move(batch_id, "completed", ("in_progress",))
    store.release(batch_id, "local")
    assert not store.claim(batch_id, "other", 30)


def test_a_version_2_database_is_brought_up_to_date_with_its_batches(url: str) -> None:
    old = BatchStore(url)
    batch_id = _batch(old)
    with old.engine.begin() as conn:  # as a gateway of schema 2 left it
        conn.execute(text("DROP TABLE batch_file_chunks"))
        conn.execute(text("ALTER TABLE batches DROP COLUMN leased_by"))
        conn.execute(text("ALTER TABLE batches DROP COLUMN lease_until"))
        conn.execute(update(schema_version).values(version=2))
    old.close()
    store = BatchStore(url)  # migrates
    try:
        with store.engine.begin() as conn:
            assert conn.execute(select(schema_version.c.version)).scalars().all() == [LATEST] and LATEST >= 3
            assert conn.execute(select(batch_file_chunks.c.seq)).all() == []
        assert store.batch(batch_id, None) is not None and store.lease(batch_id) == (None, None)
        assert store.claim(batch_id, "a", 30) and store.lease(batch_id)[0] == "a"
    finally:
        store.close()


def test_a_file_in_the_database_reads_back_whole_from_another_store(url: str) -> None:
    writer, reader = BatchStore(url), BatchStore(url)
    try:
        written, read = DatabaseFiles(lambda: writer.engine), DatabaseFiles(lambda: reader.engine)
        line = b'{"custom_id": "c", "body": "' + b"x" * 1000 + b'"}\n'
        data = line * (2 * CHUNK // len(line) + 7)  # three chunks, lines across their edges
        assert written.write("file-big", io.BytesIO(data)) == len(data)
        with read.open("file-big") as stream:
            assert stream.read() == data
        with read.open("file-big") as stream:
            assert [raw + b"\n" for _, _, raw in jsonl_lines(stream)] == data.splitlines(keepends=True)
        with reader.engine.begin() as conn:
            assert len(conn.execute(select(batch_file_chunks.c.seq).where(batch_file_chunks.c.file_id == "file-big")).all()) == 3
        assert written.write("file-big", b"again\n") == 6  # a rewrite (a finalization redone) replaces it
        with read.open("file-big") as stream:
            assert stream.read() == b"again\n"
        assert written.write("file-empty", b"") == 0
        with read.open("file-empty") as stream:
            assert stream.read() == b""
        written.delete("file-big")
        with pytest.raises(FileNotFoundError):
            read.open("file-big")
        with pytest.raises(FileNotFoundError):
            read.open("file-never")
    finally:
        writer.close()
        reader.close()


def test_of_many_reservations_at_once_no_more_pass_than_the_key_may_have(url: str) -> None:
    """Below the API: 4 stores (as 4 worker processes or replicas) reserve 10 batches each for
    one key at once, with 3 unfinished batches allowed: the count and the insert are one step under the key's lock,
    so exactly 3 pass (PostgreSQL's advisory lock; SQLite's one writer)."""
    stores = [BatchStore(url) for _ in range(4)]
    try:
        start = threading.Barrier(len(stores))
        passed: list[str] = []

        def reserver(store: BatchStore) -> None:
            start.wait()
            for _ in range(10):
                now = int(time.time())
                row = {
                    "id": "batch_" + secrets.token_hex(12), "owner": "o", "key_name": None, "endpoint": "/v1/chat/completions",
                    "input_file_id": "file-x", "completion_window": "24h", "status": "validating", "created_at": now, "expires_at": now + 86400,
                }  # fmt: skip
                if store.reserve(row, 3, 10**6, None) is None:
                    passed.append(row["id"])

        threads = [threading.Thread(target=reserver, args=(store,)) for store in stores]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert len(passed) == 3, passed
        assert stores[0].load("o") == (3, 0)
        assert stores[0].batches("o", None, 10) == ([], False)  # reservations: shown by no API
    finally:
        for store in stores:
            store.close()
