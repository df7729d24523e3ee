"""A gateway SIGKILLed in the middle of a batch resumes it at its next start (SQLite and PostgreSQL): every line ends
once in the result files, and no line whose answer was recorded before the kill reaches the engine again (the FAKE
engine notes every answer it sends; only lines in flight at the kill may be answered twice)."""

from __future__ import annotations

import collections
import signal
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from sqlalchemy import create_engine, text

from tests.batches.helpers import chat_lines, results, upload, wait_ended
from tests.fake_engine import running_fake_engine
from tests.servers import CLI, server_process

KEY = "sk-batch-owner"
LINES, CONCURRENCY = 500, 16


def _recorded(url: str, batch_id: str) -> set[str]:
    """custom_ids whose answer the database holds."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT custom_id FROM batch_lines WHERE batch_id = :b AND state = 'done'"), {"b": batch_id})
            return {row[0] for row in rows}
    finally:
        engine.dispose()


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_a_batch_survives_sigkill_of_the_gateway(database: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    answers = tmp_path / "answers.txt"
    usage: dict[str, Any] = {"flush_interval_s": 0.05}
    if database == "postgresql":
        usage["database_url"] = request.getfixturevalue("postgres").url
    url = usage.get("database_url") or f"sqlite:///{tmp_path / 'state' / 'usage.sqlite3'}"
    with running_fake_engine(tmp_path, env={"FAKE_ENGINE_TOKEN_S": "0.01", "FAKE_ENGINE_ANSWERS": str(answers)}) as engine_url:
        gateway = {
            "keys": [{"name": "owner", "key": KEY}], "state_dir": str(tmp_path / "state"), "usage": usage,
            "batches": {"max_concurrency": CONCURRENCY, "poll_interval_s": 0.2},
        }  # fmt: skip
        config = tmp_path / "deploy.yaml"
        config.write_text(yaml.safe_dump({"models": {"m": {"url": engine_url}}, "gateway": gateway}))
        argv = [*CLI, "serve", str(config), "--port", "{port}"]
        with server_process(argv, log_path=tmp_path / "first.log", ready_path="/health", timeout_s=90) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
            batch = client.batches.create(
                input_file_id=upload(client, chat_lines(LINES, max_tokens=10)), endpoint="/v1/chat/completions", completion_window="24h"
            )
            server.wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= LINES // 2, 60, "half the lines")
            server.stop(signal.SIGKILL, grace_s=0)
        recorded = _recorded(url, batch.id)
        assert LINES // 2 <= len(recorded) < LINES, len(recorded)  # killed in the middle
        answered_before = answers.read_text().splitlines()
        with server_process(argv, log_path=tmp_path / "second.log", ready_path="/health", timeout_s=90) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
            ended = wait_ended(client, batch.id, timeout_s=120)
            assert ended.status == "completed" and ended.request_counts.completed == LINES, ended
            out = results(client, ended.output_file_id)
        assert [line["custom_id"] for line in out] == [f"line-{i}" for i in range(LINES)]  # each once, in order
        answered = collections.Counter(answers.read_text().splitlines())
        assert set(answered) == {f"line-{i}" for i in range(LINES)}
        twice = {custom_id for custom_id, count in answered.items() if count > 1}
        assert not twice & recorded, f"lines recorded before the kill were run again: {sorted(twice & recorded)}"
        assert len(twice) <= CONCURRENCY, f"only lines in flight at the kill may run again: {sorted(twice)}"
        assert len(answered_before) >= len(recorded)
