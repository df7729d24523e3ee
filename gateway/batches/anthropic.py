"""Anthropic's Message Batches API (``/v1/messages/batches``), a dialect over the same batches, store and runner.

A create checks each request's ``params`` with the guard of a live Messages request (the first bad one answers 400
naming its index and custom_id; nothing is created), writes the requests as an input file of lines for the
``/v1/messages`` route and records a batch of that endpoint, id ``msgbatch_<hex>``, under the same per-key limits;
the runner runs it as any batch (each request a ``/v1/messages`` request of its key, at the batch class). The Message
Batch object, the list and the results are views of that batch and its lines: no result file is written, the results
are read from the lines in request order. Errors are in Anthropic's dialect, as on every ``/v1/messages`` path.
A Message Batch is Anthropic's API's only: the OpenAI batch routes answer 404 for it and do not list it.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import orjson
from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import Response, StreamingResponse

from gateway.batches.files import FileStorage, LinesReader
from gateway.batches.json_items import BodyError, array_items
from gateway.batches.service import opened
from gateway.batches.shapes import TERMINAL, WINDOW_S, BatchObject
from gateway.batches.validate import guarded, step_aside
from gateway.config import BatchSettings
from gateway.core.endpoints import (
    MESSAGE_BATCH_BY_ID,
    MESSAGE_BATCH_CANCEL,
    MESSAGE_BATCH_RESULTS,
    MESSAGE_BATCHES,
    MESSAGES,
    PROXIED_BY_PATH,
)
from gateway.core.errors import Dialect, GatewayError
from gateway.core.state import GatewayState
from gateway.edge.auth import request_owner
from gateway.tenants.keys import TENANT_SCOPE_KEY, Tenant

PREFIX = "msgbatch_"
MAX_PAGE = 1000  # Anthropic's list limit
RESULTS_PAGE = 500  # lines read from the database at a time while the results stream


class MessageBatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    custom_id: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    params: dict[str, Any]


async def _db(request: Request, call: Callable[..., Any], *args: Any) -> Any:
    """A call of the batch database, bounded (:class:`gateway.batches.calls.BatchCalls`)."""
    return await request.app.state.batches.run(call, *args)


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def _time(stamp: int | None) -> str | None:
    """RFC 3339, UTC, of unix seconds."""
    return datetime.fromtimestamp(stamp, UTC).isoformat().replace("+00:00", "Z") if stamp is not None else None


def message_batch(batch: BatchObject) -> dict[str, Any]:
    """The Message Batch object of ``batch``: its counts from the batch's (lines not answered by its end were
    canceled or expired, as the batch ended), its times in RFC 3339."""
    counts = batch.request_counts
    left = counts.total - counts.completed - counts.failed  # lines not answered (yet)
    ended = batch.status in TERMINAL
    status = "ended" if ended else "canceling" if batch.status == "cancelling" else "in_progress"
    canceled = left if batch.status == "cancelled" else 0
    expired = left if batch.status == "expired" else 0
    errored = counts.failed + (left if ended and not canceled and not expired else 0)  # every request counted once
    return {
        "id": batch.id, "type": "message_batch", "processing_status": status,
        "request_counts": {"processing": 0 if ended else left, "succeeded": counts.completed, "errored": errored, "canceled": canceled, "expired": expired},
        "created_at": _time(batch.created_at), "expires_at": _time(batch.expires_at),
        "ended_at": _time(batch.completed_at or batch.cancelled_at or batch.expired_at or batch.failed_at),
        "cancel_initiated_at": _time(batch.cancelling_at), "archived_at": None,
        "results_url": MESSAGE_BATCH_RESULTS.format(message_batch_id=batch.id) if ended else None,  # relative: the client's base URL
    }  # fmt: skip


def result_line(line: dict[str, Any]) -> dict[str, Any]:
    """One line of the results: the request's Message, its error (Anthropic's error object), or canceled / expired."""
    result = json.loads(line["result"]) if line.get("result") else None
    if line["state"] in ("cancelled", "expired"):
        return {"custom_id": line["custom_id"], "result": {"type": "canceled" if line["state"] == "cancelled" else "expired"}}
    if line["state"] == "done" and line["status_code"] == 200:
        return {"custom_id": line["custom_id"], "result": {"type": "succeeded", "message": result}}
    return {"custom_id": line["custom_id"], "result": {"type": "errored", "error": _error(line, result)}}


def _error(line: dict[str, Any], result: Any) -> dict[str, Any]:
    """The answer's error as Anthropic's error response (the gateway answers /v1/messages in that dialect already;
    an answer in another shape, or none, is told in it)."""
    if isinstance(result, dict) and result.get("type") == "error" and isinstance(result.get("error"), dict):
        body = dict(result)
    else:
        inner = result.get("error") if isinstance(result, dict) and isinstance(result.get("error"), dict) else result
        message = inner.get("message") if isinstance(inner, dict) else None
        body = GatewayError(line["status_code"] or 500, str(message or f"the request failed ({line['state']})")).body(Dialect.ANTHROPIC)
    body["request_id"] = line["request_id"]
    return body


def checked_requests(
    state: GatewayState, read: Callable[[], bytes], files: FileStorage, file_id: str, tenant: Tenant | None, limits: BatchSettings
) -> list[str]:
    """The custom_ids of the create's body (read by ``read``, a chunk at a time, as it arrives) once every request
    passed a live Messages request's guard, its requests written as the lines of the input file ``file_id`` as they
    pass; else GatewayError(400) naming the first bad one by its index (and custom_id), the file not kept. Memory is
    bounded by one request, never the body (:func:`gateway.batches.json_items.array_items`)."""
    route = PROXIED_BY_PATH[MESSAGES]
    custom_ids: list[str] = []
    seen: set[str] = set()

    def lines() -> Iterator[bytes]:
        try:
            for index, raw in enumerate(array_items(read, "requests", 2 * limits.max_line_bytes + 4096)):  # spaces: checked again below
                step_aside(index)
                if index >= limits.max_lines:
                    raise GatewayError(400, f"more than {limits.max_lines} requests (gateway.batches.max_lines)", code="too_many_lines")
                item = _request(index, raw)
                if item.custom_id in seen:
                    raise _bad(index, item.custom_id, "custom_id is not unique in the batch", "duplicate_custom_id")
                if item.params.get("stream"):
                    raise _bad(index, item.custom_id, "a batch request cannot stream (stream: true)", "invalid_request")
                line = orjson.dumps({"custom_id": item.custom_id, "method": "POST", "url": MESSAGES, "body": item.params})
                if len(line) > limits.max_line_bytes:
                    raise _bad(index, item.custom_id, f"{len(line)} bytes, more than {limits.max_line_bytes} (gateway.batches.max_line_bytes)", "line_too_large")
                try:
                    guarded(state, route, item.params, tenant)
                except GatewayError as error:
                    raise _bad(index, item.custom_id, error.message, error.code, error.param) from None
                seen.add(item.custom_id)
                custom_ids.append(item.custom_id)
                yield line + b"\n"
        except BodyError as error:
            if error.code == "line_too_large":
                raise GatewayError(400, f"{error} (gateway.batches.max_line_bytes)", code=error.code, param=error.where) from None
            raise GatewayError(400, str(error), param=error.where) from None

    files.write(file_id, LinesReader(lines()))
    return custom_ids


def _request(index: int, raw: bytes) -> MessageBatchRequest:
    try:
        return MessageBatchRequest.model_validate_json(raw)
    except ValidationError as error:
        problem = error.errors()[0]
        where = f"requests[{index}]" + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in problem["loc"])
        raise GatewayError(400, f"{where}: {problem['msg']}", param=where) from None


def _bad(index: int, custom_id: str, message: str, code: str, param: str | None = None) -> GatewayError:
    field = f" [{param}]" if param else ""
    return GatewayError(400, f"requests[{index}] (custom_id {custom_id!r}){field}: {message}", code=code, param=f"requests[{index}]")


async def _owned(request: Request, message_batch_id: str) -> BatchObject:
    """The caller's Message Batch; another key's, or an OpenAI batch, answers the 404 of an absent id."""
    _, store = await opened(request)
    found = await _db(request, store.batch, message_batch_id, request_owner(request.scope))
    if found is None or found.endpoint != MESSAGES:
        raise GatewayError(404, f"No such Message Batch: {message_batch_id}", code="batch_not_found")
    return found


async def create_message_batch(request: Request) -> Response:
    batches, store = await opened(request)
    owner = request_owner(request.scope)
    tenant: Tenant | None = request.scope.get(TENANT_SCOPE_KEY)
    batch_id = PREFIX + secrets.token_hex(12)
    file_id = f"file-{batch_id}-input"  # the requests as lines: storage only, no file of the Files API
    now = int(time.time())
    row = {
        "id": batch_id, "owner": owner, "key_name": tenant.name if tenant is not None else None, "endpoint": MESSAGES,
        "input_file_id": file_id, "completion_window": "24h", "status": "validating", "created_at": now, "expires_at": now + WINDOW_S["24h"],
    }  # fmt: skip
    length = request.headers.get("content-length", "")
    batches.refuse_below_floor(int(length) if length.isdigit() else batches.settings.max_file_bytes)  # its lines are a file
    await batches.reserve(store, row, None)  # the key's limits taken before the body is read
    try:
        read = _body_reader(request, asyncio.get_running_loop(), request.app.state.gateway.settings.http.body_timeout_s + 5)
        custom_ids = await batches.in_create_pool(
            checked_requests, request.app.state.gateway, read, batches.files, file_id, tenant, batches.settings, reads_body=True
        )
        created = await batches.create(store, batch_id, custom_ids, "requests")
    except BaseException:
        await batches.run(batches.files.delete, file_id)
        await batches.in_create_pool(store.unreserve, batch_id, big=False)
        raise
    return _json(message_batch(created))


def _body_reader(request: Request, loop: asyncio.AbstractEventLoop, timeout_s: float) -> Callable[[], bytes]:
    """The request's body a chunk at a time for a thread (each chunk received on the event loop; b"": the end). A
    chunk not there within ``timeout_s`` (the body's own timeout is shorter: a loop gone at shutdown) ends the read."""
    chunks = request.stream()

    async def following() -> bytes:
        try:
            while not (chunk := await anext(chunks)):
                pass  # (an empty chunk is no end: the end is the stream's)
            return chunk
        except StopAsyncIteration:
            return b""

    def read() -> bytes:
        try:
            return asyncio.run_coroutine_threadsafe(following(), loop).result(timeout_s)
        except TimeoutError:
            raise GatewayError(408, f"request body not received within {timeout_s:g}s", code="request_timeout") from None

    return read


async def get_message_batch(message_batch_id: str, request: Request) -> Response:
    return _json(message_batch(await _owned(request, message_batch_id)))


async def list_message_batches(request: Request) -> Response:
    _, store = await opened(request)
    query = request.query_params
    raw = query.get("limit", "20")
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_PAGE:
        raise GatewayError(400, f"limit must be a number from 1 to {MAX_PAGE}", param="limit")
    before, after = query.get("before_id"), query.get("after_id")
    if before and after:
        raise GatewayError(400, "give before_id or after_id, not both", param="before_id")
    items, more = await _db(request, store.batches, request_owner(request.scope), after, int(raw), (MESSAGES,), before)
    data = [message_batch(item) for item in items]
    return _json({"data": data, "has_more": more, "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None})


async def cancel_message_batch(message_batch_id: str, request: Request) -> Response:
    """No request starts from now on; those in flight finish and their results are kept; the others end canceled."""
    batches, store = await opened(request)
    batch = await _owned(request, message_batch_id)
    if batch.status in TERMINAL:
        raise GatewayError(409, f"message batch {message_batch_id} has ended already", code="batch_not_cancellable")
    await batches.cancel(store, message_batch_id)
    return _json(message_batch(await _owned(request, message_batch_id)))


async def message_batch_results(message_batch_id: str, request: Request) -> Response:
    """The results of an ended Message Batch, one JSON line per request, in request order, read a page at a time."""
    _, store = await opened(request)
    batch = await _owned(request, message_batch_id)
    if batch.status not in TERMINAL:
        raise GatewayError(409, f"message batch {message_batch_id} is still processing; its results come once it ended", code="batch_not_ended")

    async def lines() -> AsyncIterator[bytes]:
        after = -1
        while page := await _db(request, store.ended_lines, batch.id, after, RESULTS_PAGE):
            yield b"".join(orjson.dumps(result_line(line)) + b"\n" for line in page)
            after = page[-1]["line"]

    return StreamingResponse(lines(), media_type="application/binary")


async def delete_message_batch(message_batch_id: str, request: Request) -> Response:
    """An ended Message Batch, its requests and results, gone (one still processing: cancel it first)."""
    batches, store = await opened(request)
    batch = await _owned(request, message_batch_id)
    if batch.status not in TERMINAL:
        raise GatewayError(409, f"message batch {message_batch_id} is still processing; cancel it first", code="batch_not_ended")
    await batches.run(batches.files.delete, batch.input_file_id)  # the bytes first: on a full disk, the room the rows' delete needs
    await batches.run(store.delete_batch, batch.id)
    return _json({"id": batch.id, "type": "message_batch_deleted"})


MESSAGE_HANDLERS: dict[tuple[str, str], Callable[..., Any]] = {
    ("POST", MESSAGE_BATCHES): create_message_batch,
    ("GET", MESSAGE_BATCHES): list_message_batches,
    ("GET", MESSAGE_BATCH_BY_ID): get_message_batch,
    ("DELETE", MESSAGE_BATCH_BY_ID): delete_message_batch,
    ("POST", MESSAGE_BATCH_CANCEL): cancel_message_batch,
    ("GET", MESSAGE_BATCH_RESULTS): message_batch_results,
}
