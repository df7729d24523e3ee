"""What the batch tests share: input files, waiting for a batch to end, reading its result files."""

from __future__ import annotations

import io
import json
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
from sqlalchemy import create_engine, text

from tests.fake_engine import running_fake_engine
from tests.gateway_server import GatewayServer, serve
from tests.postgres import PostgresServer
from tests.waiting import wait_until

ENDED = ("completed", "failed", "expired", "cancelled")
ALPHA, BETA, ADMIN = "sk-alpha", "sk-beta", "sk-admin"


@contextmanager
def answering_fake(directory: Path) -> Iterator[tuple[str, Path]]:
    """A FAKE engine that answers in milliseconds and notes each answered prompt: (its URL, the file of notes)."""
    answers = directory / "answers.txt"
    answers.touch()  # (empty until its first answer: a test run first in its module reads it all the same)
    with running_fake_engine(directory, env={"FAKE_ENGINE_TOKEN_S": "0.002", "FAKE_ENGINE_ANSWERS": str(answers)}) as url:
        yield url, answers


@contextmanager
def two_key_gateway(fake_url: str, state: Path, database_url: str | None = None, **batches: Any) -> Iterator[GatewayServer]:
    """A gateway in front of ``fake_url`` (models ``m``, scheduling by priority, and ``other``), keys alpha and beta
    (both limited to ``m``) and an admin key, its ledger flushed every 50 ms (in ``database_url``, else SQLite in
    ``state``), the batch settings ``batches``."""
    models = {"m": {"url": fake_url, "enable_priority_scheduling": True}, "other": {"url": fake_url}}
    settings = {
        "keys": [{"name": "alpha", "key": ALPHA, "models": ["m"]}, {"name": "beta", "key": BETA, "models": ["m"]}],
        "admin_keys": [ADMIN], "state_dir": str(state), "batches": batches,
        "usage": {"flush_interval_s": 0.05, **({"database_url": database_url} if database_url else {})},
    }  # fmt: skip
    with serve(models, settings) as server:
        yield server


def chat_lines(count: int, model: str = "m", **body: Any) -> list[dict[str, Any]]:
    """``count`` chat requests, custom_id ``line-<i>``, each saying its own custom_id (what a FAKE engine notes)."""
    return [
        {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": model, "messages": [{"role": "user", "content": f"line-{i}"}], "max_tokens": 4, **body}}
        for i in range(count)
    ]  # fmt: skip


def jsonl(lines: list[Any]) -> bytes:
    return b"".join((line if isinstance(line, str) else json.dumps(line)).encode() + b"\n" for line in lines)


def upload(client: openai.OpenAI, lines: list[Any]) -> str:
    return client.files.create(file=("input.jsonl", io.BytesIO(jsonl(lines))), purpose="batch").id


def wait_ended(client: openai.OpenAI, batch_id: str, timeout_s: float = 120) -> Any:
    """The batch once it ended (completed, failed, expired, cancelled)."""
    return wait_until(
        lambda: (batch := client.batches.retrieve(batch_id)).status in ENDED and batch,
        lambda: f"batch {batch_id} ended: {client.batches.retrieve(batch_id).status}",
        timeout_s=timeout_s,
    )


def results(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines() if line.strip()]


def new_database(postgres: PostgresServer) -> str:
    """The URL of a new, empty database on ``postgres`` (a test that reshapes tables, or counts every row, has its own)."""
    name = "batches_" + secrets.token_hex(4)
    admin = create_engine(postgres.url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f"CREATE DATABASE {name}"))
    finally:
        admin.dispose()
    return postgres.url.rsplit("/", 1)[0] + "/" + name
