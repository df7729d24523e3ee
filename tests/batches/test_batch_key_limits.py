"""A key over its budget or its rate still reaches its own batches and files, in front of a FAKE
engine (``url:`` model): listing, reading, downloading and cancelling generate nothing, so they spend none of the
key's generation limits; they have a modest limit of their own (gateway.edge.quota.MANAGEMENT_PER_MINUTE)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.edge.quota import MANAGEMENT_PER_MINUTE
from tests.batches.helpers import chat_lines, jsonl, results, upload, wait_ended
from tests.gateway_server import GatewayServer, serve
from tests.servers import CLI, REPO
from tests.waiting import wait_until

KEY = "sk-limited-owner"


@pytest.fixture()
def limited(fake: tuple[str, Path], tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[GatewayServer]:
    """A gateway whose one named key has the limits the test's parameter gives."""
    settings = {
        "keys": [{"name": "owner", "key": KEY, "limits": request.param}], "state_dir": str(tmp_path / "state"),
        "usage": {"flush_interval_s": 0.05}, "batches": {"poll_interval_s": 0.2, "retry_backoff_s": 0.2},
    }  # fmt: skip
    with serve({"m": {"url": fake[0]}}, settings) as server:
        yield server


def _client(server: GatewayServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=30)


@pytest.mark.parametrize("limited", [{"tokens_per_day": 60}], indirect=True)
def test_a_key_whose_budget_is_spent_still_reads_its_batches_and_results(limited: GatewayServer) -> None:
    client = _client(limited)
    batch = client.batches.create(input_file_id=upload(client, chat_lines(2)), endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_ended(client, batch.id)
    assert done.status == "completed", done
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "spend"}], max_tokens=100)  # the rest of the day
    with pytest.raises(openai.RateLimitError) as spent:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "more"}], max_tokens=2)
    assert spent.value.body["code"] == "insufficient_quota"
    assert client.batches.retrieve(batch.id).status == "completed"
    assert [b.id for b in client.batches.list()] == [batch.id]
    assert [line["custom_id"] for line in results(client, done.output_file_id)] == ["line-0", "line-1"]
    assert {f.id for f in client.files.list()} >= {done.input_file_id, done.output_file_id}
    answer = httpx.get(limited.url + "/v1/messages/batches", headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}, timeout=30)
    assert answer.status_code == 200, answer.text


@pytest.mark.parametrize("limited", [{"requests_per_minute": 2}], indirect=True)
def test_a_key_at_its_rate_can_cancel_its_running_batch(limited: GatewayServer) -> None:
    client = _client(limited)
    batch = client.batches.create(input_file_id=upload(client, chat_lines(20)), endpoint="/v1/chat/completions", completion_window="24h")
    wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 2, "the lines to spend the key's rate")
    with pytest.raises(openai.RateLimitError):  # the rate is spent by the lines
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled"), cancelled
    assert wait_ended(client, batch.id).status == "cancelled"


@pytest.mark.parametrize("limited", [{"requests_per_minute": 1}], indirect=True)
def test_management_calls_have_a_modest_limit_of_their_own(limited: GatewayServer) -> None:
    limited.app.state.quotas.clock = lambda: 1_767_225_600.0  # held still: nothing refills during the test
    statuses: list[Any] = []
    with httpx.Client(base_url=limited.url, headers={"authorization": f"Bearer {KEY}"}, timeout=30) as http:
        for _ in range(MANAGEMENT_PER_MINUTE + 1):
            statuses.append(http.get("/v1/batches").status_code)
        refused = http.get("/v1/files")
    assert statuses[:MANAGEMENT_PER_MINUTE] == [200] * MANAGEMENT_PER_MINUTE  # far more than its 1 request a minute
    assert statuses[-1] == 429 and refused.status_code == 429
    assert refused.json()["error"]["code"] == "rate_limit_exceeded" and int(refused.headers["retry-after"]) >= 1


@pytest.mark.parametrize("limited", [{"tokens_per_day": 300}], indirect=True)
def test_batch_lines_wait_while_the_budget_is_held_and_fail_only_once_it_is_spent(limited: GatewayServer) -> None:
    """Each line may cost more than the whole day (it holds its body's bytes plus 280; the FAKE
    engine answers 5 + 280). The first runs alone; the others met 429 insufficient_quota while it held the budget,
    and failed for good (1 line of 10 completed). Held is not spent: they wait (rate_limit_exceeded), the second
    runs once the first settled (285 of 300 used), and only then is the budget spent for the rest."""
    client = _client(limited)
    lines = chat_lines(10, max_tokens=280)
    batch = client.batches.create(input_file_id=upload(client, lines), endpoint="/v1/chat/completions", completion_window="24h")
    ended = wait_ended(client, batch.id)
    assert ended.request_counts.completed == 2 and ended.request_counts.failed == 8, ended
    errors = results(client, ended.error_file_id)
    assert {line["response"]["body"]["error"]["code"] for line in errors} == {"insufficient_quota"}, errors[:2]


@pytest.mark.parametrize("limited", [{"requests_per_minute": 6}], indirect=True)
def test_the_cli_waits_for_a_batch_of_a_key_at_a_few_requests_a_minute(limited: GatewayServer, tmp_path: Path) -> None:
    """At 6 requests a minute, ``batch submit --wait`` of 6 lines had not finished after 120 s (its
    upload, create and status polls spent the key's rate, its lines waited for what was left). Now they spend none."""
    source = tmp_path / "jobs.jsonl"
    source.write_bytes(jsonl(chat_lines(6)))
    env = {**os.environ, "SGLANG_GATEWAY_URL": limited.url, "SGLANG_GATEWAY_KEY": KEY}
    submitted = subprocess.run([*CLI, "batch", "submit", str(source), "--endpoint", "/v1/chat/completions", "--wait"],
                               capture_output=True, text=True, env=env, timeout=120, cwd=REPO)  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    written = [json.loads(line) for line in (tmp_path / "jobs.output.jsonl").read_text().splitlines()]
    assert sorted(line["custom_id"] for line in written) == [f"line-{i}" for i in range(6)]


def test_the_cli_polls_a_long_batch_less_and_less_often() -> None:
    from gateway.batches.cli import poll_interval_s

    assert [poll_interval_s(s) for s in (0.0, 5.0, 10.0, 60.0, 300.0, 3600.0)] == [1.0, 1.0, 1.0, 6.0, 30.0, 30.0]
    # an hour's watch: ~150 polls (not 3,600)
    watched, polls = 0.0, 0
    while watched < 3600:
        watched += poll_interval_s(watched)
        polls += 1
    assert polls < 200, polls
