"""Two gateway replicas (processes of their own, each with its own state_dir) sharing one real PostgreSQL
(``gateway.replicas.shared``), in front of one FAKE engine that notes every answer it sends: a batch submitted through
one is seen, with its input file, through the other; one replica runs it (the lease's holder); SIGKILLed halfway,
the other takes it over once the lease runs out and completes it: every custom_id once in the output, downloaded
through the survivor, and no line whose answer was recorded before the kill reaches the engine again. Stopped by
SIGTERM instead, the holder finishes its lines in flight and releases the lease: the other takes the batch over
without waiting for the lease to run out, and no line reaches the engine twice. Cancelled through the replica that
does not run it, the batch is ended by the one that does."""

from __future__ import annotations

import collections
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import yaml
from sqlalchemy import create_engine, text

from tests.batches.helpers import chat_lines, jsonl, new_database, results, upload, wait_ended
from tests.fake_engine import running_fake_engine
from tests.postgres import PostgresServer
from tests.servers import CLI, ServerProcess

KEY = "sk-batch-owner"
LINES, CONCURRENCY, LEASE_S = 200, 8, 2.0


def _query(url: str, sql: str, **params: Any) -> list[Any]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return list(conn.execute(text(sql), params))
    finally:
        engine.dispose()


@contextmanager
def _replicas(
    tmp_path: Path, engine_url: str, database_url: str, names: tuple[str, ...], lease_s: float = LEASE_S
) -> Iterator[dict[str, ServerProcess]]:
    """One ``sglang-gateway serve`` per name, started together, each ready; every one's process group stopped at the end."""
    servers: dict[str, ServerProcess] = {}
    try:
        for name in names:
            gateway = {
                "keys": [{"name": "owner", "key": KEY}], "state_dir": str(tmp_path / f"state-{name}"),
                "usage": {"database_url": database_url, "flush_interval_s": 0.05},
                "batches": {"max_concurrency": CONCURRENCY, "poll_interval_s": 0.2},
                "replicas": {"shared": True, "name": name, "lease_s": lease_s},
            }  # fmt: skip
            config = tmp_path / f"deploy-{name}.yaml"
            config.write_text(yaml.safe_dump({"models": {"m": {"url": engine_url}}, "gateway": gateway}))
            servers[name] = ServerProcess([*CLI, "serve", str(config), "--port", "{port}"], log_path=tmp_path / f"{name}.log")
        for server in servers.values():
            server.wait_http("/health", timeout_s=90)
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=30)


def _holder(url: str, batch_id: str) -> str | None:
    return _query(url, "SELECT leased_by FROM batches WHERE id = :b", b=batch_id)[0][0]


def test_a_batch_is_shared_by_replicas_and_taken_over_from_a_killed_one(postgres: PostgresServer, tmp_path: Path) -> None:
    url = new_database(postgres)
    answers = tmp_path / "answers.txt"
    lines = chat_lines(LINES, max_tokens=10)
    with (
        running_fake_engine(tmp_path, env={"FAKE_ENGINE_TOKEN_S": "0.02", "FAKE_ENGINE_ANSWERS": str(answers)}) as engine_url,
        _replicas(tmp_path, engine_url, url, ("a", "b")) as servers,
    ):
        a, b = _client(servers["a"]), _client(servers["b"])
        source = upload(a, lines)
        batch = a.batches.create(input_file_id=source, endpoint="/v1/chat/completions", completion_window="24h")

        # Through B: the batch, in its list, and the input file's bytes, uploaded through A.
        assert b.batches.retrieve(batch.id).input_file_id == source
        assert batch.id in [item.id for item in b.batches.list()]
        assert b.files.content(source).content == jsonl(lines)

        # One replica holds the lease and runs the lines; it is killed halfway.
        running = servers["a"].wait_until(lambda: _holder(url, batch.id), 30, "a replica holding the batch's lease")
        assert running in servers, running
        survivor_name = "b" if running == "a" else "a"
        killed, survivor = servers[running], servers[survivor_name]
        client = _client(survivor)
        survivor.wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= LINES // 2, 60, "half the lines")
        killed.stop(signal.SIGKILL, grace_s=0)
        recorded = {row[0] for row in _query(url, "SELECT custom_id FROM batch_lines WHERE batch_id = :b AND state = 'done'", b=batch.id)}
        assert LINES // 2 <= len(recorded) < LINES, len(recorded)  # killed in the middle

        # The survivor takes it over once the lease runs out, and completes it.
        ended = wait_ended(client, batch.id, timeout_s=60)
        assert ended.status == "completed" and ended.request_counts.completed == LINES, ended
        assert f"batches: batch {batch.id} completed" in survivor.log()
        out = results(client, ended.output_file_id)
        assert [line["custom_id"] for line in out] == [f"line-{i}" for i in range(LINES)]  # each once, in order
        assert all(line["response"]["status_code"] == 200 for line in out)

    answered = collections.Counter(answers.read_text().splitlines())
    assert set(answered) == {f"line-{i}" for i in range(LINES)}
    twice = {custom_id for custom_id, count in answered.items() if count > 1}
    assert not twice & recorded, f"lines recorded before the kill were run again: {sorted(twice & recorded)}"
    assert len(twice) <= CONCURRENCY, f"only lines in flight at the kill may run again: {sorted(twice)}"
    # Files' bytes are in the database, not in either replica's state_dir.
    assert not [path for name in servers for path in (tmp_path / f"state-{name}").rglob("*.jsonl")]
    assert _query(url, "SELECT count(DISTINCT file_id) FROM batch_file_chunks")[0][0] == 2  # the input and the output


def test_a_replica_stopped_by_sigterm_hands_its_batch_over_without_waiting_for_the_lease(postgres: PostgresServer, tmp_path: Path) -> None:
    url = new_database(postgres)
    answers = tmp_path / "answers.txt"
    long_lease_s = 300.0  # far longer than the test may wait: the survivor can only take the batch if it was released
    with (
        running_fake_engine(tmp_path, env={"FAKE_ENGINE_TOKEN_S": "0.02", "FAKE_ENGINE_ANSWERS": str(answers)}) as engine_url,
        _replicas(tmp_path, engine_url, url, ("a", "b"), lease_s=long_lease_s) as servers,
    ):
        a = _client(servers["a"])
        batch = a.batches.create(input_file_id=upload(a, chat_lines(LINES, max_tokens=10)), endpoint="/v1/chat/completions",
                                 completion_window="24h")  # fmt: skip
        running = servers["a"].wait_until(lambda: _holder(url, batch.id), 30, "a replica holding the batch's lease")
        stopped, survivor = servers[running], servers["b" if running == "a" else "a"]
        client = _client(survivor)
        survivor.wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= LINES // 4, 60, "a quarter of the lines")
        assert stopped.stop(signal.SIGTERM, grace_s=60) == 0, stopped.log(3000)
        assert _holder(url, batch.id) != running  # released on the way out
        ended = wait_ended(client, batch.id, timeout_s=60)
        assert ended.status == "completed" and ended.request_counts.completed == LINES, ended
        assert [line["custom_id"] for line in results(client, ended.output_file_id)] == [f"line-{i}" for i in range(LINES)]
    answered = collections.Counter(answers.read_text().splitlines())
    assert answered == {f"line-{i}": 1 for i in range(LINES)}, {custom_id: n for custom_id, n in answered.items() if n != 1}


def test_a_batch_running_on_one_replica_is_cancelled_through_the_other(postgres: PostgresServer, tmp_path: Path) -> None:
    url = new_database(postgres)
    with (
        running_fake_engine(tmp_path, env={"FAKE_ENGINE_TOKEN_S": "0.02"}) as engine_url,
        _replicas(tmp_path, engine_url, url, ("a", "b")) as servers,
    ):
        a = _client(servers["a"])
        batch = a.batches.create(input_file_id=upload(a, chat_lines(LINES, max_tokens=10)), endpoint="/v1/chat/completions",
                                 completion_window="24h")  # fmt: skip
        running = servers["a"].wait_until(lambda: _holder(url, batch.id), 30, "a replica holding the batch's lease")
        other = _client(servers["b" if running == "a" else "a"])
        other.batches.cancel(batch.id)
        ended = wait_ended(other, batch.id, timeout_s=60)
        assert ended.status == "cancelled" and ended.request_counts.completed < LINES, ended
        out, errors = results(other, ended.output_file_id), results(other, ended.error_file_id)
        assert sorted(line["custom_id"] for line in out + errors) == sorted(f"line-{i}" for i in range(LINES))  # each once
        assert {line["error"]["code"] for line in errors} == {"batch_cancelled"} and len(out) == ended.request_counts.completed
        assert f"batches: batch {batch.id} cancelled" in servers[running].log()  # ended by the lease's holder
