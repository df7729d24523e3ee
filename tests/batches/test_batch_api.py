"""The batch API through the ``openai`` SDK, in front of a FAKE engine (``url:`` models; the FAKE answers in
milliseconds and notes what it answered): lines run as their key at the batch class, are charged to its ledger and
marked as batch rows; bad files are refused whole; another key sees none of it; cancel stops new lines at once."""

from __future__ import annotations

import io
import json
import os
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.batches.helpers import (
    ADMIN,
    ALPHA,
    BETA,
    chat_lines,
    jsonl,
    results,
    two_key_gateway,
    upload,
    wait_ended,
)
from tests.browser import browser_missing, chromium_page, expect_text
from tests.gateway.helpers import closed_port_url
from tests.gateway_server import GatewayServer, serve
from tests.servers import CLI, REPO
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def gateway(fake: tuple[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    with two_key_gateway(fake[0], tmp_path_factory.mktemp("state"), max_file_bytes=65536, max_line_bytes=2048, max_queued_lines_per_key=40, max_concurrency=2, poll_interval_s=0.2) as server:
        yield server


def _client(gateway: GatewayServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=60)


def _batch_rows(gateway: GatewayServer, batch_id: str, lines: int) -> tuple[int, int, int]:
    """(rows, prompt tokens, completion tokens) the ledger holds for ``batch_id`` as alpha's, once its ``lines`` rows
    are written (every ``usage.flush_interval_s``: some may come a flush later than others)."""
    database = Path(gateway.state.settings.state_dir) / "usage.sqlite3"

    def found() -> tuple[int, int, int]:
        with sqlite3.connect(database) as conn:
            return conn.execute(
                "SELECT count(*), sum(prompt_tokens), sum(completion_tokens) FROM usage_rows WHERE batch_id = ? AND key_name = 'alpha'", (batch_id,)
            ).fetchone()

    return wait_until(lambda: (row := found())[0] >= lines and row, lambda: f"the ledger holds {found()} for {batch_id}", 10, 0.05)


def test_a_batch_runs_every_line_once_as_its_key_at_the_batch_class(gateway: GatewayServer, fake: tuple[str, Path]) -> None:
    client = _client(gateway, ALPHA)
    before = len(fake[1].read_text().splitlines())  # the module's FAKE engine: other tests' lines may come first
    file_id = upload(client, chat_lines(12))
    assert client.files.retrieve(file_id).purpose == "batch"
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"job": "t1"})
    assert batch.status == "validating" and batch.request_counts.total == 12 and batch.metadata == {"job": "t1"}
    done = wait_ended(client, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (12, 0)
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.error_file_id is None
    out = results(client, done.output_file_id)
    assert [line["custom_id"] for line in out] == [f"line-{i}" for i in range(12)]  # input order
    assert all(line["response"]["status_code"] == 200 and line["error"] is None for line in out)
    assert {line["response"]["body"]["fake_priority"] for line in out} == {-1}  # one below every class (none: 0)
    assert all(line["response"]["request_id"] == f"{batch.id}-{i}" for i, line in enumerate(out))
    answered = fake[1].read_text().splitlines()[before:]
    assert all(answered.count(f"line-{i}") == 1 for i in range(12)), answered
    rows, prompt, completion = _batch_rows(gateway, batch.id, 12)  # charged to alpha, marked as this batch's
    assert rows == 12
    assert (prompt, completion) == (sum(line["response"]["body"]["usage"]["prompt_tokens"] for line in out),
                                    sum(line["response"]["body"]["usage"]["completion_tokens"] for line in out))  # fmt: skip
    assert batch.id in [item.id for item in client.batches.list(limit=5).data]
    every = httpx.get(gateway.url + "/admin/batches", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10).json()
    assert any(item["id"] == batch.id and item["key"] == "alpha" and item["leased_by"] is None for item in every["data"])  # ended: its lease released
    metrics = httpx.get(gateway.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10).text
    assert 'gateway_batch_lines_total{model="m",result="done"}' in metrics


@pytest.mark.parametrize(
    ("lines", "line_no", "code"),
    [
        (["{not json", *chat_lines(1)], 1, "invalid_json"),
        ([*chat_lines(2), {**chat_lines(1)[0], "custom_id": "x", "body": {"model": "other", "messages": [{"role": "user", "content": "hi"}]}}], 3, "model_not_found"),
        ([*chat_lines(1), {**chat_lines(1)[0], "custom_id": "y", "body": {**chat_lines(1)[0]["body"], "temprature": 0}}], 2, None),
        ([*chat_lines(1), {**chat_lines(1)[0], "custom_id": "z", "surprise": 1}], 2, "invalid_line"),
        ([*chat_lines(1), chat_lines(1)[0]], 2, "duplicate_custom_id"),
        ([*chat_lines(1), {**chat_lines(1)[0], "custom_id": "big", "body": {"model": "m", "messages": [{"role": "user", "content": "x" * 3000}]}}], 2, "line_too_large"),
        (chat_lines(41), None, "batch_limit_exceeded"),
    ],
    ids=["malformed", "model-not-allowed", "unknown-field", "unknown-line-field", "duplicate-id", "line-too-large", "over-queued-limit"],
)
def test_a_bad_file_is_refused_whole_naming_its_first_bad_line(gateway: GatewayServer, lines: list[Any], line_no: int | None, code: str | None) -> None:
    client = _client(gateway, ALPHA)
    before = [item.id for item in client.batches.list(limit=100).data]
    file_id = upload(client, lines)
    error_type = openai.RateLimitError if code == "batch_limit_exceeded" else openai.BadRequestError
    with pytest.raises(error_type) as refused:
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    error = refused.value.body
    if line_no is not None:
        assert error["message"].startswith(f"input file line {line_no}"), error
        assert error["param"] == "input_file_id"
    if code is not None:
        assert error["code"] == code, error
    assert [item.id for item in client.batches.list(limit=100).data] == before  # nothing half-created


def test_a_file_over_the_limit_is_refused_and_not_kept(gateway: GatewayServer) -> None:
    client = _client(gateway, ALPHA)
    before = [item.id for item in client.files.list().data]
    with pytest.raises(openai.APIStatusError) as refused:
        client.files.create(file=("big.jsonl", io.BytesIO(jsonl(chat_lines(1)) * 400)), purpose="batch")
    assert refused.value.status_code == 413, refused.value.body
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("f.jsonl", io.BytesIO(jsonl(chat_lines(1)))), purpose="fine-tune")
    assert [item.id for item in client.files.list().data] == before
    with pytest.raises(openai.BadRequestError) as wrong:
        client.batches.create(input_file_id=upload(client, chat_lines(1)), endpoint="/v1/moderations", completion_window="24h")  # type: ignore[arg-type]
    assert wrong.value.body["param"] == "endpoint"


def test_another_key_finds_nothing_of_a_batch_or_its_files(gateway: GatewayServer) -> None:
    alpha, beta = _client(gateway, ALPHA), _client(gateway, BETA)
    file_id = upload(alpha, chat_lines(2))
    batch = alpha.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (lambda: beta.batches.retrieve(batch.id), lambda: beta.batches.cancel(batch.id), lambda: beta.files.retrieve(file_id),
                 lambda: beta.files.content(file_id), lambda: beta.files.delete(file_id),
                 lambda: beta.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")):  # fmt: skip
        with pytest.raises(openai.NotFoundError):
            call()
    assert batch.id not in [item.id for item in beta.batches.list().data]
    assert file_id not in [item.id for item in beta.files.list().data]
    assert wait_ended(alpha, batch.id).status == "completed"  # beta's cancel did nothing
    assert alpha.files.delete(file_id).deleted and file_id not in [item.id for item in alpha.files.list().data]


def test_cancel_starts_no_new_line_and_keeps_the_answers_of_those_in_flight(gateway: GatewayServer, fake: tuple[str, Path]) -> None:
    client = _client(gateway, ALPHA)
    lines = chat_lines(30, max_tokens=100)  # ~0.2 s a line, 2 at a time: ~3 s in all
    for line in lines:
        line["body"]["messages"][0]["content"] = "cancel-" + line["custom_id"]
    batch = client.batches.create(input_file_id=upload(client, lines), endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 30
    while client.batches.retrieve(batch.id).request_counts.completed < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    ended = wait_ended(client, batch.id)
    assert ended.status == "cancelled" and ended.cancelled_at
    out, errors = results(client, ended.output_file_id), results(client, ended.error_file_id)
    ids = [line["custom_id"] for line in out + errors]
    assert sorted(ids) == sorted(line["custom_id"] for line in lines)  # each once, in one of the two files
    assert all(line["response"]["status_code"] == 200 for line in out)
    assert 2 <= len(out) <= ended.request_counts.completed + 2 and len(out) < 30
    assert {line["error"]["code"] for line in errors} == {"batch_cancelled"}
    answered = [text for text in fake[1].read_text().splitlines() if text.startswith("cancel-")]
    assert sorted(answered) == sorted("cancel-" + line["custom_id"] for line in out)  # nothing ran after the cancel but those in flight
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def test_the_cli_submits_waits_and_downloads(gateway: GatewayServer, tmp_path: Path) -> None:
    source = tmp_path / "jobs.jsonl"
    source.write_bytes(jsonl(chat_lines(5)))
    env = {**os.environ, "SGLANG_GATEWAY_URL": gateway.url, "SGLANG_GATEWAY_KEY": ALPHA}
    submitted = subprocess.run([*CLI, "batch", "submit", str(source), "--endpoint", "/v1/chat/completions", "--wait"],
                               capture_output=True, text=True, env=env, timeout=120, cwd=REPO)  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    batch_id = submitted.stdout.split()[0]
    written = [json.loads(line) for line in (tmp_path / "jobs.output.jsonl").read_text().splitlines()]
    assert [line["custom_id"] for line in written] == [f"line-{i}" for i in range(5)]
    status = subprocess.run([*CLI, "batch", "status", batch_id], capture_output=True, text=True, env=env, timeout=60, cwd=REPO)
    assert "completed" in status.stdout and "5/5" in status.stdout, status.stdout + status.stderr
    listed = subprocess.run([*CLI, "batch", "list"], capture_output=True, text=True, env=env, timeout=60, cwd=REPO)
    assert batch_id in listed.stdout
    other = subprocess.run([*CLI, "batch", "cancel", batch_id], capture_output=True, text=True, env={**env, "SGLANG_GATEWAY_KEY": BETA}, timeout=60, cwd=REPO)
    assert other.returncode == 1 and "404" in other.stderr and "Traceback" not in other.stderr


def test_the_database_down_answers_503_and_fails_no_start(fake: tuple[str, Path], tmp_path: Path) -> None:
    """A batch database that cannot be reached (a PostgreSQL URL where nothing listens): the gateway starts and
    serves chat; the batch API answers 503 ``batches_unavailable``, never a 500. A gateway without a ledger whose batch API
    was not used created no database file (the batch API opens it at its first use)."""
    port = closed_port_url().rsplit(":", 1)[1]
    down = {"state_dir": str(tmp_path / "down"), "usage": {"database_url": f"postgresql+psycopg://nobody@127.0.0.1:{port}/none"}}
    with serve({"m": {"url": fake[0]}}, down) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=30)
        assert client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2).choices
        with pytest.raises(openai.APIStatusError) as refused:
            client.batches.list()
        assert refused.value.status_code == 503 and refused.value.body["code"] == "batches_unavailable", refused.value.body
    with serve({"m": {"url": fake[0]}}, {"state_dir": str(tmp_path / "unused"), "usage": {"enabled": False}}) as server:
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert not (tmp_path / "unused" / "usage.sqlite3").exists()


def test_the_status_page_lists_batches_with_their_progress(gateway: GatewayServer) -> None:
    """With the admin key, the status page (headless Chromium) lists every key's batches: id, key, status and the
    lines done; without it, no batch is shown."""
    if (missing := browser_missing()) is not None:
        pytest.skip(f"no browser: {missing}")
    client = _client(gateway, ALPHA)
    batch = client.batches.create(input_file_id=upload(client, chat_lines(3)), endpoint="/v1/chat/completions", completion_window="24h")
    assert wait_ended(client, batch.id).status == "completed"
    with chromium_page() as page:
        page.goto(gateway.url + "/")
        page.fill("#client-key", ALPHA)
        page.click("#keys button[type=submit]")
        assert page.locator("section#batches").is_hidden()
        page.fill("#admin-key", ADMIN)
        page.click("#keys button[type=submit]")
        row = page.locator(f'#batches-body tr[data-batch="{batch.id}"]')
        expect_text(row.locator("td:nth-child(3)"), "completed")
        assert row.locator("td:nth-child(2)").text_content() == "alpha"
        assert row.locator("td:nth-child(6)").text_content() == "3 / 0 / 3"
        assert page.locator("#batches-body progress").first.get_attribute("max") is not None
        assert not page.problems, page.problems
