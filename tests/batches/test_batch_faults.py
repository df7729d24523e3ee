"""The batch API when its storage fails under it (a FAKE engine that notes each answered prompt; the database a real
SQLite file whose writes are refused on demand by a trigger, as a full disk or a database blip refuses them): a
failed record pauses the batch and no line runs or is charged twice; a store gone after start answers 503; a store
frozen (a real PostgreSQL stopped by SIGSTOP) answers 503 at the deadline, loses no line and holds no shutdown."""

from __future__ import annotations

import collections
import os
import signal
import sqlite3
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from loguru import logger

from tests.batches.helpers import (
    ADMIN,
    ALPHA,
    chat_lines,
    jsonl,
    new_database,
    results,
    two_key_gateway,
    upload,
    wait_ended,
)
from tests.fake_engine import running_fake_engine
from tests.gateway_server import GatewayServer, serve
from tests.postgres import PostgresServer, frozen
from tests.servers import CLI, REPO, ServerProcess
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def gateway(fake: tuple[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    with two_key_gateway(fake[0], tmp_path_factory.mktemp("state"), max_concurrency=2, poll_interval_s=0.2, retry_backoff_s=0.1) as server:
        yield server


def _client(gateway: GatewayServer, key: str = ALPHA) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=60)


def _database(gateway: GatewayServer) -> Path:
    return Path(gateway.state.settings.state_dir) / "usage.sqlite3"


def _sql(gateway: GatewayServer, statement: str, *args: object) -> list[tuple[object, ...]]:
    with sqlite3.connect(_database(gateway), timeout=30) as conn:
        return conn.execute(statement, args).fetchall()


def test_a_failed_record_pauses_the_batch_and_no_line_runs_or_is_charged_twice(gateway: GatewayServer, fake: tuple[str, Path]) -> None:
    """With every line's record refused, the batch stops after the lines in flight (their
    answers held), and once the database takes writes again every line reached the engine once and has one ledger row."""
    client = _client(gateway)
    lines = chat_lines(20)
    for line in lines:
        line["body"]["messages"][0]["content"] = "paused-" + line["custom_id"]
    file_id = upload(client, lines)
    _sql(gateway, "CREATE TRIGGER refuse_ends BEFORE UPDATE ON batch_lines BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END")
    seen: list[str] = []
    sink = logger.add(lambda message: seen.append(str(message)), level="WARNING")
    try:
        batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")

        def answered() -> list[str]:
            return [text for text in fake[1].read_text().splitlines() if text.startswith("paused-")]

        wait_until(lambda: any("could not be recorded" in text for text in seen), lambda: f"no record refused; answered {answered()}")
        for _ in range(5):  # a few polls of the runner: the paused batch is taken up and stays paused
            time.sleep(0.2)
            assert client.batches.retrieve(batch.id).status == "in_progress"
        assert len(answered()) <= 2, answered()  # the lines in flight when the first record failed (max_concurrency)
    finally:
        _sql(gateway, "DROP TRIGGER IF EXISTS refuse_ends")
        logger.remove(sink)
    done = wait_ended(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 20, done
    assert sorted(answered()) == sorted(f"paused-line-{i}" for i in range(20)), answered()  # each line once
    assert sorted(line["custom_id"] for line in results(client, done.output_file_id)) == sorted(f"line-{i}" for i in range(20))
    rows = wait_until(
        lambda: (found := _sql(gateway, "SELECT request_id FROM usage_rows WHERE batch_id = ?", batch.id)) and len(found) >= 20 and found,
        "the ledger's rows of the batch", timeout_s=10, every_s=0.05,
    )  # fmt: skip
    assert sorted(row[0] for row in rows) == sorted(f"{batch.id}-{i}" for i in range(20))  # charged once each
    assert sum("could not be recorded" in text for text in seen) == 1, seen  # said once, when it paused
    assert not any("Task exception was never retrieved" in text for text in seen)


def test_the_cli_prints_server_text_as_it_is(gateway: GatewayServer, tmp_path: Path) -> None:
    """A custom_id of ``[/]`` in the server's error made rich raise MarkupError."""
    source = tmp_path / "bad.jsonl"
    source.write_bytes(jsonl([{**chat_lines(1)[0], "custom_id": "[/]", "body": {"model": "m", "messages": "x"}}]))
    env = {**os.environ, "SGLANG_GATEWAY_URL": gateway.url, "SGLANG_GATEWAY_KEY": ALPHA}
    ran = subprocess.run([*CLI, "batch", "submit", str(source)], capture_output=True, text=True, env=env, timeout=120, cwd=REPO)
    assert ran.returncode == 1, ran.stderr
    assert "Traceback" not in ran.stderr and "MarkupError" not in ran.stderr, ran.stderr
    assert "error: 400" in ran.stderr and "'[/]'" in ran.stderr, ran.stderr


def test_the_store_down_after_start_answers_503_on_a_kept_connection_and_the_runner_says_it_once(
    fake: tuple[str, Path], postgres: PostgresServer, tmp_path: Path
) -> None:
    """PostgreSQL stopped after the batch API opened it answers 503
    ``batches_unavailable`` (docs/batches.md) on a connection that stays open, not a 500 that drops it; the runner
    says so in one line, not a warning of several lines at every poll."""
    seen: list[str] = []
    settings = {"usage": {"database_url": new_database(postgres), "flush_interval_s": 0.05}, "batches": {"poll_interval_s": 0.1}}
    with serve({"m": {"url": fake[0]}}, {"state_dir": str(tmp_path), **settings}) as server:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            assert http.get("/v1/batches").status_code == 200  # the database opened
            sink = logger.add(lambda message: seen.append(str(message)), level="WARNING")
            postgres.stop()
            try:
                for path in ("/v1/batches", "/v1/files", "/v1/messages/batches"):  # the same connection answers each
                    answer = http.get(path)
                    assert answer.status_code == 503, answer.text
                    assert answer.headers.get("connection") != "close", answer.headers
                    error = answer.json()["error"]  # OpenAI's code; Anthropic's dialect on its own route
                    assert error.get("code") == "batches_unavailable" or error.get("type") == "overloaded_error", answer.text
                time.sleep(1)  # ten polls of the runner
            finally:
                logger.remove(sink)
                postgres.start()
            wait_until(lambda: http.get("/v1/batches").status_code == 200, "the batch API back once PostgreSQL is")
    runner = [text for text in seen if "batches:" in text]
    assert len(runner) == 1 and runner[0].count("\n") == 1, seen  # one line (and its newline)


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_concurrent_creates_of_one_key_hold_its_batch_limit(fake: tuple[str, Path], tmp_path: Path, database: str, request: pytest.FixtureRequest) -> None:
    """8 creates at once, with 3 unfinished batches allowed per key: the limit is
    taken before the lines are checked (under the key's lock: PostgreSQL's advisory lock, SQLite's one writer), so
    at most 3 are created (before: all 8, each checked while none existed)."""
    limits = {"max_active_batches_per_key": 3, "max_queued_lines_per_key": 10**6, "max_concurrency": 1, "poll_interval_s": 0.2}
    url = new_database(request.getfixturevalue("postgres")) if database == "postgresql" else None
    with two_key_gateway(fake[0], tmp_path, database_url=url, **limits) as server:
        client = _client(server)
        files = [upload(client, chat_lines(3000)) for _ in range(8)]  # one each: no create waits on another's file
        outcomes: list[object] = []

        def create(file_id: str) -> None:
            try:
                outcomes.append(client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h").id)
            except openai.APIStatusError as error:
                outcomes.append(error)

        threads = [threading.Thread(target=create, args=(file_id,)) for file_id in files]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        created = [item for item in outcomes if isinstance(item, str)]
        refused = [item for item in outcomes if not isinstance(item, str)]
        assert 1 <= len(created) <= 3 and len(created) + len(refused) == 8, outcomes
        assert all(isinstance(item, openai.RateLimitError) and item.body["code"] == "batch_limit_exceeded" for item in refused), refused
        assert len(client.batches.list(limit=20).data) == len(created)
        for batch_id in created:
            client.batches.cancel(batch_id)


def test_the_input_of_a_create_under_way_cannot_be_deleted(gateway: GatewayServer) -> None:
    """The file a create is checking is held by it (409 on delete), and the batch it makes runs."""
    client = _client(gateway)
    file_id = upload(client, chat_lines(20000))
    created: list[object] = []
    thread = threading.Thread(target=lambda: created.append(client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")))
    thread.start()
    try:
        wait_until(lambda: _sql(gateway, "SELECT id FROM batches WHERE input_file_id = ? AND status = 'reserved'", file_id), "the create's reservation", every_s=0.01)
        with pytest.raises(openai.ConflictError):
            client.files.delete(file_id)
    finally:
        thread.join(120)
    batch = created[0]
    assert client.files.retrieve(file_id).id == file_id
    client.batches.cancel(batch.id)  # type: ignore[attr-defined]
    assert wait_ended(client, batch.id).status == "cancelled"  # type: ignore[attr-defined]


def test_a_batch_whose_input_is_gone_fails_saying_why(gateway: GatewayServer) -> None:
    """A batch whose input file's bytes are gone (lost under the gateway) fails with a reason,
    instead of staying in_progress with a traceback at every poll."""
    client = _client(gateway)
    file_id = upload(client, chat_lines(3))
    (Path(gateway.state.settings.state_dir) / "batch_files" / f"{file_id}.jsonl").unlink()
    batches = gateway.app.state.batches
    now = int(time.time())
    row = {"id": "batch_gone" + file_id[-8:], "owner": _sql(gateway, "SELECT owner FROM batch_files WHERE id = ?", file_id)[0][0], "key_name": "alpha",
           "endpoint": "/v1/chat/completions", "input_file_id": file_id, "completion_window": "24h", "status": "validating",
           "created_at": now, "expires_at": now + 86400}  # fmt: skip
    batches.store.create_batch(row, ["line-0", "line-1", "line-2"])  # as a create that passed, before the bytes went
    batches.runner.wake()
    batch = wait_ended(client, row["id"], timeout_s=30)
    assert batch.status == "failed" and batch.failed_at, batch
    assert batch.errors.data[0].code == "input_file_missing" and file_id in batch.errors.data[0].message, batch.errors


def test_token_ids_are_checked_at_create(gateway: GatewayServer) -> None:
    """A line's token ids the engine's admission refuses are refused at the create."""
    client = _client(gateway)
    lines = [{"custom_id": "neg", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": [5, -1], "max_tokens": 2}}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(input_file_id=upload(client, lines), endpoint="/v1/completions", completion_window="24h")
    assert refused.value.body["code"] == "invalid_token_ids" and "neg" in refused.value.body["message"], refused.value.body


def test_a_key_keeps_no_more_files_than_its_quotas_and_an_upload_below_the_floor_is_refused(fake: tuple[str, Path], tmp_path: Path) -> None:
    """A key's ``limits.batch_files`` / ``batch_file_bytes`` refuse the upload that would take it
    over (413 ``file_quota_exceeded``, nothing kept), another key unaffected, a delete gives the room back; a free-space
    floor above what the disk has refuses every upload (507 ``insufficient_storage``) before a byte is written."""
    keys = [
        {"name": "alpha", "key": ALPHA, "models": ["m"], "limits": {"batch_files": 2, "batch_file_bytes": 3000}},
        {"name": "beta", "key": "sk-beta", "models": ["m"]},
    ]
    with serve({"m": {"url": fake[0]}}, {"keys": keys, "state_dir": str(tmp_path / "a")}) as server:
        alpha, beta = _client(server), _client(server, "sk-beta")
        kept = [upload(alpha, chat_lines(2)), upload(alpha, chat_lines(2))]
        with pytest.raises(openai.APIStatusError) as refused:
            upload(alpha, chat_lines(2))
        assert refused.value.status_code == 413 and refused.value.body["code"] == "file_quota_exceeded", refused.value.body
        assert len(list((tmp_path / "a" / "batch_files").iterdir())) == 2  # the refused bytes not kept
        upload(beta, chat_lines(30))  # another key: its own room
        alpha.files.delete(kept[0])
        with pytest.raises(openai.APIStatusError) as too_big:
            upload(alpha, chat_lines(30))  # one file, but over the bytes
        assert too_big.value.status_code == 413 and "batch_file_bytes" in too_big.value.body["message"], too_big.value.body
        upload(alpha, chat_lines(2))
    with serve({"m": {"url": fake[0]}}, {"keys": keys, "state_dir": str(tmp_path / "b"), "batches": {"min_free_bytes": 1 << 60}}) as server:
        with pytest.raises(openai.APIStatusError) as full:
            upload(_client(server, "sk-beta"), chat_lines(1))
        assert full.value.status_code == 507 and full.value.body["code"] == "insufficient_storage", full.value.body
        assert not list((tmp_path / "b" / "batch_files").iterdir())


def test_the_batch_queue_of_every_key_is_not_shown_to_a_client_key(gateway: GatewayServer) -> None:
    """The metric ``gateway_batch_queued_lines`` counts every key's waiting lines: the admin reads it, a
    client key's /metrics leaves it out (it had told each key how much the others had queued)."""
    def scrape(key: str) -> str:
        return httpx.get(gateway.url + "/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=30).text

    assert "gateway_batch_queued_lines" in scrape(ADMIN)
    client = scrape(ALPHA)
    assert "gateway_batch_queued_lines" not in client and "gateway_requests" in client


def test_a_delete_frees_the_bytes_before_it_needs_the_database(gateway: GatewayServer) -> None:
    """On a full disk the database cannot write the delete of a file's row until space is
    freed, so the bytes go first (before: the row first, which failed, and the bytes stayed: nothing could free
    space). Here the row's delete is refused (a trigger, as a full disk refuses it): the bytes are gone all the same,
    the answer is a 503, and a second delete, once the database writes, ends it; the content meanwhile is a 404."""
    client = _client(gateway)
    file_id = upload(client, chat_lines(3))
    path = Path(gateway.state.settings.state_dir) / "batch_files" / f"{file_id}.jsonl"
    _sql(gateway, "CREATE TRIGGER refuse_deletes BEFORE DELETE ON batch_files BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END")
    try:
        with pytest.raises(openai.APIStatusError) as refused:
            client.files.delete(file_id)
        assert refused.value.status_code == 503, refused.value.body
        assert not path.exists()  # the space is free
        with pytest.raises(openai.NotFoundError):
            client.files.content(file_id)
    finally:
        _sql(gateway, "DROP TRIGGER IF EXISTS refuse_deletes")
    assert client.files.delete(file_id).deleted
    assert file_id not in [item.id for item in client.files.list().data]


HANG_S = 30  # a client's wait that only a hang reaches (the deadline is 1 s)


def test_a_frozen_store_answers_503_at_its_deadline_loses_no_line_and_holds_no_shutdown(postgres: PostgresServer, tmp_path: Path) -> None:
    """PostgreSQL frozen by SIGSTOP (server and backends: the kernel accepts, nothing
    answers) for longer than ``usage.database_timeout_s`` (1 s) under a ``serve`` process running a batch. While
    frozen: the batch API and the Message Batches API answer 503 (each in its dialect) on a kept connection, a create
    too; the runner holds the answers it cannot record. Thawed: the API answers again and the batch completes with
    every line answered and recorded once. Frozen again: SIGTERM ends the process before the thaw. Before the batch
    store was bounded, each request waited for the thaw (the client's 30 s timeout) and SIGTERM did too. Durations are
    printed (``-s``), not asserted."""
    answers = tmp_path / "answers.txt"
    answers.touch()
    fake_env = {"FAKE_ENGINE_TOKEN_S": "0.05", "FAKE_ENGINE_ANSWERS": str(answers)}
    count = 40
    with running_fake_engine(tmp_path / "engine", env=fake_env) as upstream:
        gateway = {
            "state_dir": str(tmp_path / "state"), "shutdown_grace_s": 2,
            "usage": {"database_url": new_database(postgres), "flush_interval_s": 0.2, "database_timeout_s": 1},
            "batches": {"poll_interval_s": 0.2, "max_concurrency": 2},
        }  # fmt: skip
        config = tmp_path / "gateway.yaml"
        config.write_text(yaml.safe_dump({"models": {"m": {"url": upstream}}, "gateway": gateway}))
        server = ServerProcess([*CLI, "serve", str(config), "--port", "{port}"], log_path=tmp_path / "gateway.log")
        try:
            server.wait_http("/ready", timeout_s=120)
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=HANG_S, max_retries=0)
            file_id = upload(client, chat_lines(count))
            batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
            server.wait_until(lambda: len(answers.read_text().splitlines()) >= 3, HANG_S, "three lines answered")
            timings: dict[str, float] = {}
            with frozen(postgres), httpx.Client(base_url=server.url, timeout=HANG_S) as http:
                for method, path, body in (
                    ("GET", "/v1/batches", None), ("GET", "/v1/files", None), ("GET", "/v1/messages/batches", None),
                    ("POST", "/v1/batches", {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}),
                ):  # fmt: skip
                    started = time.monotonic()
                    answer = http.request(method, path, json=body)
                    timings[f"{method} {path}"] = time.monotonic() - started
                    assert answer.status_code == 503, f"{method} {path}: {answer.text}\n{server.log(6000)}"
                    assert answer.headers.get("connection") != "close", answer.headers
                    error = answer.json()["error"]  # OpenAI's code; Anthropic's dialect on its own route
                    assert error.get("code") == "batches_unavailable" or error.get("type") == "overloaded_error", answer.text
                # the lines in flight at the freeze ended: their answers are held, the batch paused
                server.wait_log(r"batches: the answer of line \d+ of batch \S+ could not be recorded", HANG_S)
                assert postgres.postmaster_pid() is not None
            print({name: round(seconds, 2) for name, seconds in timings.items()})
            server.wait_until(lambda: httpx.get(server.url + "/v1/batches", timeout=HANG_S).status_code == 200, HANG_S, "200 after the thaw")
            ended = wait_ended(client, batch.id)
            assert ended.status == "completed" and ended.request_counts.completed == count, ended
            assert sorted(line["custom_id"] for line in results(client, ended.output_file_id)) == sorted(f"line-{i}" for i in range(count))
            noted = collections.Counter(answers.read_text().splitlines())
            assert noted == collections.Counter(f"line-{i}" for i in range(count)), noted  # each line ran once
            # a second batch in flight, the store frozen again: SIGTERM ends the process before the thaw
            second = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
            server.wait_until(lambda: len(answers.read_text().splitlines()) >= count + 3, HANG_S, "the second batch running")
            with frozen(postgres):
                signalled = time.monotonic()
                server.proc.send_signal(signal.SIGTERM)
                wait_until(lambda: server.proc.poll() is not None, lambda: f"serve still runs after SIGTERM:\n{server.log(3000)}", 2 + HANG_S)
                print({"SIGTERM to exit, frozen": round(time.monotonic() - signalled, 2), "second batch": second.id})
                assert postgres.postmaster_pid() is not None  # (still frozen: the exit did not wait for the thaw)
            assert server.proc.returncode == 0, server.log(3000)
            assert "Traceback" not in server.log(), server.log(5000)
        finally:
            server.stop(grace_s=HANG_S)
