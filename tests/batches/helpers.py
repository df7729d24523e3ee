"""What the batch tests share: input files, waiting for a batch to end, reading its result files."""

from __future__ import annotations

import io
import json
import time
from typing import Any

import openai


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
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        assert time.monotonic() < deadline, f"batch {batch_id} still {batch.status} after {timeout_s}s: {batch.request_counts}"
        time.sleep(0.1)


def results(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines() if line.strip()]
