"""The seed use case end to end against the real CPU engine, with the ``openai`` SDK: chat lines answered in a JSON
schema; every output line parses against it, in input order, and the key's ledger holds exactly the tokens the output
lines report. (Small: the suite's budget; the large runs are in benchmarks/batch_ttft.py.)"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from anthropic.types.messages import MessageBatchIndividualResponse
from openai.types.chat import ChatCompletion

from tests.batches.helpers import results, upload, wait_ended
from tests.gateway_server import serve
from tests.sdk_models import assert_sdk_valid
from tests.waiting import wait_until

pytestmark = pytest.mark.engine

KEY, ADMIN = "sk-reviews", "sk-admin"
LINES = int(os.environ.get("BATCH_ENGINE_LINES", "20"))  # the must-show's 500: BATCH_ENGINE_LINES=500
SCHEMA = {
    "type": "object",
    "properties": {"sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]}, "stars": {"type": "integer", "enum": [1, 2, 3, 4, 5]}},
    "required": ["sentiment", "stars"],
    "additionalProperties": False,
}


def _line(i: int) -> dict[str, Any]:
    body = {
        "model": "tiny", "messages": [{"role": "user", "content": f"Review {i}: the product was fine."}], "max_tokens": 64,
        "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {"name": "review", "schema": SCHEMA}},
    }  # fmt: skip
    return {"custom_id": f"review-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def _valid(answer: str) -> bool:
    data = json.loads(answer)
    return set(data) == {"sentiment", "stars"} and data["sentiment"] in ("positive", "negative", "neutral") and data["stars"] in (1, 2, 3, 4, 5)


def test_json_schema_lines_against_the_real_engine(tiny_engine: Any, tmp_path: Path) -> None:
    gateway = {"keys": [{"name": "reviews", "key": KEY}], "admin_keys": [ADMIN], "state_dir": str(tmp_path), "usage": {"flush_interval_s": 0.05}}
    with serve({"tiny": {"url": tiny_engine.url}}, gateway) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        batch = client.batches.create(input_file_id=upload(client, [_line(i) for i in range(LINES)]), endpoint="/v1/chat/completions",
                                      completion_window="24h")  # fmt: skip
        ended = wait_ended(client, batch.id, timeout_s=300)
        assert ended.status == "completed" and ended.request_counts.completed == LINES, ended
        out = results(client, ended.output_file_id)
        assert [line["custom_id"] for line in out] == [f"review-{i}" for i in range(LINES)]
        bodies = [line["response"]["body"] for line in out]
        assert all(_valid(body["choices"][0]["message"]["content"]) for body in bodies), [b["choices"][0]["message"]["content"] for b in bodies]
        for body in bodies:  # each line's answer as the SDK's model takes it (tests/sdk_models.py)
            assert_sdk_valid(ChatCompletion, body)
        prompt = sum(body["usage"]["prompt_tokens"] for body in bodies)
        completion = sum(body["usage"]["completion_tokens"] for body in bodies)

        def ledger() -> tuple[int, int]:  # the key's rows (the file and batch calls are rows too, with no tokens)
            usage = httpx.get(server.url + "/admin/usage", params={"key": "reviews"}, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).json()
            row = usage["rows"][0] if usage.get("rows") else {"prompt_tokens": 0, "completion_tokens": 0}
            return row["prompt_tokens"], row["completion_tokens"]

        wait_until(lambda: ledger() == (prompt, completion), lambda: f"the ledger holds {ledger()}, the output lines {(prompt, completion)}", 20, 0.05)


def test_a_message_batch_against_the_real_engine(tiny_engine: Any, tmp_path: Path) -> None:
    """Anthropic's Message Batches on the real engine's /v1/messages: every request succeeds with a Message, in request
    order, and the key's ledger holds exactly the tokens their usage reports."""
    gateway = {"keys": [{"name": "reviews", "key": KEY}], "admin_keys": [ADMIN], "state_dir": str(tmp_path), "usage": {"flush_interval_s": 0.05}}
    with serve({"tiny": {"url": tiny_engine.url}}, gateway) as server:
        client = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)
        requests = [{"custom_id": f"m-{i}", "params": {"model": "tiny", "max_tokens": 8, "temperature": 0,
                     "messages": [{"role": "user", "content": f"Review {i}: fine."}]}} for i in range(3)]  # fmt: skip
        batch = client.messages.batches.create(requests=requests)  # type: ignore[arg-type]
        wait_until(lambda: client.messages.batches.retrieve(batch.id).processing_status == "ended", "the message batch ended", 300)
        assert client.messages.batches.retrieve(batch.id).request_counts.succeeded == 3
        raw = httpx.get(server.url + f"/v1/messages/batches/{batch.id}/results", headers={"x-api-key": KEY}, timeout=30)
        for line in raw.text.splitlines():  # each result line as the SDK's model takes it (tests/sdk_models.py)
            assert_sdk_valid(MessageBatchIndividualResponse, json.loads(line))
        results = list(client.messages.batches.results(batch.id))
        assert [line.custom_id for line in results] == ["m-0", "m-1", "m-2"]
        messages = [line.result.message for line in results if line.result.type == "succeeded"]
        assert len(messages) == 3 and all(message.type == "message" and message.content for message in messages), results
        tokens = (sum(m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) + (m.usage.cache_creation_input_tokens or 0) for m in messages),
                  sum(m.usage.output_tokens for m in messages))  # fmt: skip

        def ledger() -> tuple[int, int]:
            usage = httpx.get(server.url + "/admin/usage", params={"key": "reviews"}, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).json()
            row = usage["rows"][0] if usage.get("rows") else {"prompt_tokens": 0, "completion_tokens": 0}
            return row["prompt_tokens"], row["completion_tokens"]

        wait_until(lambda: ledger() == tokens, lambda: f"the ledger holds {ledger()}, the results {tokens}", 20, 0.05)
