"""Anthropic's Message Batches API through the ``anthropic`` SDK, in front of a FAKE engine (a ``url:`` model that
answers ``/v1/messages`` in milliseconds and notes what it answered): the same batches, runner and limits as the
OpenAI API, seen in Anthropic's shapes; bad requests refused whole in Anthropic's dialect; another key sees nothing."""

from __future__ import annotations

import contextlib
import io
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.core.endpoints import route_label
from tests.batches.helpers import ADMIN, ALPHA, BETA, chat_lines, two_key_gateway, upload
from tests.docs.readme_blocks import marked_blocks
from tests.fake_engine import REFUSE
from tests.gateway_server import GatewayServer
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def gateway(fake: tuple[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    with two_key_gateway(fake[0], tmp_path_factory.mktemp("state"), max_line_bytes=2048, max_queued_lines_per_key=40, max_concurrency=2, poll_interval_s=0.2) as server:
        yield server


def _client(gateway: GatewayServer, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.url, api_key=key, max_retries=0, timeout=60)


def _requests(count: int, prefix: str = "req", max_tokens: int = 4) -> list[dict[str, Any]]:
    """``count`` Messages requests, custom_id ``<prefix>-<i>``, each saying its custom_id (what the FAKE notes)."""
    return [
        {"custom_id": f"{prefix}-{i}", "params": {"model": "m", "max_tokens": max_tokens, "messages": [{"role": "user", "content": f"{prefix}-{i}"}]}}
        for i in range(count)
    ]  # fmt: skip


def _ended(client: anthropic.Anthropic, batch_id: str) -> Any:
    return wait_until(
        lambda: (batch := client.messages.batches.retrieve(batch_id)).processing_status == "ended" and batch,
        lambda: f"message batch {batch_id}: {client.messages.batches.retrieve(batch_id).processing_status}",
        timeout_s=120,
    )


def test_a_message_batch_runs_every_request_and_reads_back_in_anthropic_shapes(gateway: GatewayServer, fake: tuple[str, Path]) -> None:
    client = _client(gateway, ALPHA)
    requests = _requests(6, "ok")
    requests[3]["params"]["messages"][0]["content"] = REFUSE  # answered 400 by the engine: errored, not the batch
    batch = client.messages.batches.create(requests=requests)  # type: ignore[arg-type]
    assert batch.id.startswith("msgbatch_") and batch.type == "message_batch" and batch.processing_status == "in_progress"
    assert batch.request_counts.processing == 6 and batch.results_url is None and batch.created_at.tzinfo is not None
    ended = _ended(client, batch.id)
    counts = ended.request_counts
    assert (counts.processing, counts.succeeded, counts.errored, counts.canceled, counts.expired) == (0, 5, 1, 0, 0), counts
    assert ended.ended_at is not None and ended.ended_at >= ended.created_at and ended.cancel_initiated_at is None
    results = list(client.messages.batches.results(batch.id))
    assert [line.custom_id for line in results] == [f"ok-{i}" for i in range(6)]  # request order
    assert [line.result.type for line in results] == ["succeeded"] * 3 + ["errored"] + ["succeeded"] * 2
    message = results[0].result.message  # type: ignore[union-attr]
    assert message.type == "message" and message.content[0].text == "tok " * 4 and message.usage.output_tokens == 4  # type: ignore[union-attr]
    assert message.model_extra and message.model_extra["fake_priority"] == -1  # at the batch class
    error = results[3].result.error  # type: ignore[union-attr]
    assert error.type == "error" and error.error.type == "invalid_request_error" and "refused" in error.error.message, error
    answered = fake[1].read_text().splitlines()
    assert all(answered.count(f"ok-{i}") == 1 for i in (0, 1, 2, 4, 5)), answered
    # a view of the same batches: the admin list has it, with its key; the OpenAI API does not
    every = httpx.get(gateway.url + "/admin/batches", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10).json()
    assert any(item["id"] == batch.id and item["key"] == "alpha" and item["endpoint"] == "/v1/messages" for item in every["data"])
    openai_client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=ALPHA, max_retries=0, timeout=30)
    assert batch.id not in [item.id for item in openai_client.batches.list(limit=100).data]
    with pytest.raises(openai.NotFoundError):
        openai_client.batches.retrieve(batch.id)
    # deleted once ended: gone from the list, its results too
    assert client.messages.batches.delete(batch.id).type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve(batch.id)
    assert batch.id not in [item.id for item in client.messages.batches.list(limit=100).data]


def test_the_list_pages_newest_first_both_ways(gateway: GatewayServer) -> None:
    """Pages by after_id (older) and before_id (newer) agree with the whole list (newest first; batches made in the
    same second are in the order of their ids)."""
    client = _client(gateway, BETA)
    made = [client.messages.batches.create(requests=_requests(1, f"page{i}")).id for i in range(3)]  # type: ignore[arg-type]
    whole = [item.id for item in client.messages.batches.list(limit=100).data]
    assert sorted(whole) == sorted(made)
    first = client.messages.batches.list(limit=2)
    assert [item.id for item in first.data] == whole[:2] and first.has_more and (first.first_id, first.last_id) == (whole[0], whole[1])
    older = client.messages.batches.list(limit=2, after_id=whole[1])
    assert [item.id for item in older.data] == whole[2:] and not older.has_more
    newer = client.messages.batches.list(limit=1, before_id=whole[2])
    assert [item.id for item in newer.data] == whole[1:2] and newer.has_more and newer.first_id == whole[1]
    assert [item.id for item in client.messages.batches.list(limit=1)] == whole  # the SDK's auto-paging follows after_id
    for batch_id in made:
        _ended(client, batch_id)


@pytest.mark.parametrize(
    ("requests", "index", "words"),
    [
        ([*_requests(2), {**_requests(1)[0], "custom_id": "x", "params": {"model": "other", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}}], 2, "does not exist"),
        ([*_requests(1), {"custom_id": "y", "params": {**_requests(1)[0]["params"], "temprature": 0}}], 1, "temprature"),
        ([*_requests(1), {"custom_id": "z", "params": {**_requests(1)[0]["params"], "stream": True}}], 1, "stream"),
        ([*_requests(2), _requests(1)[0]], 2, "not unique"),
        ([*_requests(1), {"custom_id": "big", "params": {**_requests(1)[0]["params"], "messages": [{"role": "user", "content": "x" * 3000}]}}], 1, "max_line_bytes"),
        ([*_requests(1), {"custom_id": "bad id!", "params": _requests(1)[0]["params"]}], 1, "custom_id"),
    ],
    ids=["model-not-allowed", "unknown-field", "stream", "duplicate-id", "too-large", "bad-custom-id"],
)
def test_a_bad_request_is_refused_whole_in_anthropic_shape_naming_its_index(gateway: GatewayServer, requests: list[Any], index: int, words: str) -> None:
    client = _client(gateway, ALPHA)
    before = [item.id for item in client.messages.batches.list(limit=100).data]
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.batches.create(requests=requests)
    body = refused.value.body
    assert isinstance(body, dict) and body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert body["error"]["message"].startswith(f"requests[{index}]") and words in body["error"]["message"], body
    assert [item.id for item in client.messages.batches.list(limit=100).data] == before  # nothing created


def test_the_per_key_queued_limit_holds_for_message_batches(gateway: GatewayServer) -> None:
    with pytest.raises(anthropic.RateLimitError) as refused:
        _client(gateway, ALPHA).messages.batches.create(requests=_requests(41))  # type: ignore[arg-type]
    assert "max_queued_lines_per_key" in refused.value.body["error"]["message"]  # type: ignore[index]


def test_another_key_finds_nothing_of_a_message_batch(gateway: GatewayServer) -> None:
    alpha, beta = _client(gateway, ALPHA), _client(gateway, BETA)
    batch = alpha.messages.batches.create(requests=_requests(2, "mine"))  # type: ignore[arg-type]
    for call in (lambda: beta.messages.batches.retrieve(batch.id), lambda: beta.messages.batches.cancel(batch.id),
                 lambda: beta.messages.batches.delete(batch.id), lambda: beta.messages.batches.results(batch.id)):  # fmt: skip
        with pytest.raises(anthropic.NotFoundError) as absent:
            call()
        assert absent.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    assert batch.id not in [item.id for item in beta.messages.batches.list(limit=100).data]
    assert _ended(alpha, batch.id).request_counts.succeeded == 2  # beta's cancel did nothing
    # an OpenAI batch of the same key is not a Message Batch
    openai_client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=ALPHA, max_retries=0, timeout=30)
    theirs = openai_client.batches.create(input_file_id=upload(openai_client, chat_lines(1)), endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(anthropic.NotFoundError):
        alpha.messages.batches.retrieve(theirs.id)
    assert theirs.id not in [item.id for item in alpha.messages.batches.list(limit=100).data]


def test_cancel_starts_no_new_request_and_the_rest_read_canceled(gateway: GatewayServer, fake: tuple[str, Path]) -> None:
    client = _client(gateway, ALPHA)
    batch = client.messages.batches.create(requests=_requests(30, "cancel", max_tokens=100))  # type: ignore[arg-type]  # ~0.2 s each, 2 at a time
    with pytest.raises(anthropic.ConflictError):
        client.messages.batches.delete(batch.id)  # not ended yet
    wait_until(lambda: "cancel-1" in fake[1].read_text().splitlines(), "two requests answered", 60, 0.02)
    canceling = client.messages.batches.cancel(batch.id)
    assert canceling.processing_status in ("canceling", "ended") and canceling.cancel_initiated_at is not None
    ended = _ended(client, batch.id)
    counts = ended.request_counts
    assert counts.succeeded >= 2 and counts.canceled > 0 and counts.succeeded + counts.canceled == 30 and counts.errored == 0, counts
    results = list(client.messages.batches.results(batch.id))
    assert [line.custom_id for line in results] == [f"cancel-{i}" for i in range(30)]
    succeeded = [line.custom_id for line in results if line.result.type == "succeeded"]
    assert len(succeeded) == counts.succeeded and {line.result.type for line in results} == {"succeeded", "canceled"}
    answered = [text for text in fake[1].read_text().splitlines() if text.startswith("cancel-")]
    assert sorted(answered) == sorted(succeeded)  # nothing ran after the cancel but those in flight
    with pytest.raises(anthropic.ConflictError):
        client.messages.batches.cancel(batch.id)
    assert client.messages.batches.delete(batch.id).id == batch.id


def test_the_documented_example_runs(gateway: GatewayServer) -> None:
    """Docs/batches.md's ``anthropic`` example, run as it is against this gateway: it prints each request's answer."""
    (block,) = marked_blocks("message-batches")
    code = block.code.replace('"http://127.0.0.1:8000"', repr(gateway.url)).replace('"sk-..."', repr(ALPHA))
    assert code != block.code
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, str(block.page), "exec"), {})  # noqa: S102 - the documentation's own example
    assert printed.getvalue().splitlines() == ["review-0 " + "tok " * 64, "review-1 " + "tok " * 64]


def test_metrics_fold_message_batch_ids() -> None:
    assert route_label("/v1/messages/batches/msgbatch_1") == "/v1/messages/batches/{message_batch_id}"
    assert route_label("/v1/messages/batches/msgbatch_1/results") == "/v1/messages/batches/{message_batch_id}/results"
    assert route_label("/v1/messages/batches/msgbatch_1/cancel") == "/v1/messages/batches/{message_batch_id}/cancel"
    assert route_label("/v1/messages/batches/msgbatch_1/anything/else") == "other"


def test_a_create_is_read_as_it_arrives_and_refused_before_the_rest_of_its_body(gateway: GatewayServer) -> None:
    """The body is checked as it arrives (off the event loop, one request in memory at a time),
    so a request over ``max_line_bytes`` is refused once its first bytes are read: here the answer comes while
    19.9 of the body's 20 MB were never sent (before: the body was read and parsed whole first)."""
    host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
    size = 20 * 1024 * 1024
    head = b'{"requests": [{"custom_id": "huge", "params": {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "'
    with socket.create_connection((host, int(port)), timeout=60) as conn:
        conn.sendall(
            b"POST /v1/messages/batches HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nanthropic-version: 2023-06-01\r\n"
            + f"x-api-key: {ALPHA}\r\nContent-Length: {size}\r\n\r\n".encode() + head + b"x" * (65536 - len(head))
        )  # fmt: skip
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = conn.recv(65536)
            assert chunk, answer
            answer += chunk
    status, _, rest = answer.partition(b"\r\n")
    assert b" 400 " in status, answer
    assert b"requests[0]" in rest and b"max_line_bytes" in rest, answer
