"""The routes of :data:`gateway.core.endpoints.BATCH_ROUTES`: files and batches as the ``openai`` SDK calls them.

Anthropic's Message Batches (:mod:`gateway.batches.anthropic`) are served by the same router, from the same table.
Everything belongs to the key that created it (``request_owner``): another key's id answers the same 404 as an id
that does not exist. Errors are the gateway's OpenAI-shaped ones (:class:`GatewayError`). The router is made from the
route table (one handler per (method, path), checked both ways), so docs, metrics labels and OpenAPI agree.
"""

from __future__ import annotations

import functools
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import orjson
from fastapi import APIRouter, Request
from pydantic import ValidationError
from sqlalchemy.exc import SQLAlchemyError
from starlette.datastructures import UploadFile
from starlette.responses import Response, StreamingResponse

from gateway.batches.anthropic import MESSAGE_HANDLERS
from gateway.batches.files import CHUNK
from gateway.batches.service import opened as _batches
from gateway.batches.shapes import ENDPOINTS, TERMINAL, WINDOW_S, BatchCreate, page
from gateway.batches.validate import checked_lines
from gateway.core.endpoints import (
    ADMIN_BATCHES,
    BATCH_BY_ID,
    BATCH_CANCEL,
    BATCH_ROUTES,
    BATCHES,
    FILE_BY_ID,
    FILE_CONTENT,
    FILES,
)
from gateway.core.errors import GatewayError
from gateway.edge.auth import request_owner
from gateway.tenants.keys import TENANT_SCOPE_KEY, Tenant

MAX_PAGE = 100


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def _limit(request: Request, default: int = 20) -> int:
    raw = request.query_params.get("limit", str(default))
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_PAGE:
        raise GatewayError(400, f"limit must be a number from 1 to {MAX_PAGE}", param="limit")
    return int(raw)


async def _db(request: Request, call: Callable[..., Any], *args: Any) -> Any:
    """A call of the batch database, bounded (:class:`gateway.batches.calls.BatchCalls`)."""
    return await request.app.state.batches.run(call, *args)


# ---------------------------------------------------------------------------- files
async def upload_file(request: Request) -> Response:
    batches, store = await _batches(request)
    limit = batches.settings.max_file_bytes
    form = await request.form(max_files=1, max_fields=4)
    try:
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose != "batch":
            raise GatewayError(400, f"purpose must be 'batch' (got {purpose!r})", param="purpose")
        if not isinstance(upload, UploadFile):
            raise GatewayError(400, "send the file as the multipart field 'file'", param="file")
        if upload.size is not None and upload.size > limit:
            raise GatewayError(413, f"the file is larger than {limit} bytes (gateway.batches.max_file_bytes)", code="file_too_large", param="file")
        owner, tenant = request_owner(request.scope), request.scope.get(TENANT_SCOPE_KEY)
        quota = tenant.limits if tenant is not None else None
        expected = upload.size if upload.size is not None else limit
        await _db(request, batches.refuse_over_quota, store, owner, quota, expected)  # before a byte is written
        batches.refuse_below_floor(expected)
        file_id = "file-" + secrets.token_hex(12)
        size = await batches.run_big(batches.files.write, file_id, upload.file)
        try:
            if size > limit:
                raise GatewayError(413, f"the file is larger than {limit} bytes (gateway.batches.max_file_bytes)", code="file_too_large", param="file")
            created = await _db(request, batches.add_upload, store, file_id, owner, quota, upload.filename or "input.jsonl", size)
        except BaseException:
            await _db(request, batches.files.delete, file_id)
            raise
    finally:
        await form.close()
    return _json(created.model_dump())


async def list_files(request: Request) -> Response:
    _, store = await _batches(request)
    items, more = await _db(request, store.files, request_owner(request.scope), request.query_params.get("purpose"), request.query_params.get("after"), _limit(request, 100))
    return _json(page([item.model_dump() for item in items], more))


async def _owned_file(request: Request, file_id: str) -> Any:
    return await _owned(request, "file", file_id)


async def get_file(file_id: str, request: Request) -> Response:
    return _json((await _owned_file(request, file_id)).model_dump())


async def delete_file(file_id: str, request: Request) -> Response:
    batches, store = await _batches(request)
    await _owned_file(request, file_id)
    using = await _db(request, store.delete_file, file_id, functools.partial(batches.files.delete, file_id))  # bytes, then row
    if using is not None:
        raise GatewayError(409, f"file {file_id} is the input of batch {using}, which has not ended; cancel it first", param="file_id")
    return _json({"id": file_id, "object": "file", "deleted": True})


async def file_content(file_id: str, request: Request) -> Response:
    batches, _ = await _batches(request)
    await _owned_file(request, file_id)
    try:
        stream = await _db(request, batches.files.open, file_id)
    except FileNotFoundError:  # its bytes gone (a delete whose row could not follow them, on a full disk): delete it again
        raise GatewayError(404, f"the bytes of file {file_id} are gone; delete it", code="file_not_found", param="file_id") from None

    async def chunks() -> AsyncIterator[bytes]:  # each read bounded too: the bytes may be in the database
        try:
            while chunk := await _db(request, stream.read, CHUNK):
                yield chunk
        finally:
            stream.close()

    return StreamingResponse(chunks(), media_type="application/octet-stream")


# ---------------------------------------------------------------------------- batches
async def create_batch(request: Request) -> Response:
    batches, store = await _batches(request)
    try:
        asked = BatchCreate.model_validate_json(await request.body())
    except ValidationError as error:
        problem = error.errors()[0]
        field = ".".join(str(part) for part in problem["loc"]) or None
        raise GatewayError(400, f"{field or 'body'}: {problem['msg']}", param=field) from None
    owner = request_owner(request.scope)
    tenant: Tenant | None = request.scope.get(TENANT_SCOPE_KEY)
    source = await _db(request, store.file, asked.input_file_id, owner)
    if source is None or source.purpose != "batch":
        raise GatewayError(404, f"No such File object: {asked.input_file_id}", code="file_not_found", param="input_file_id")
    now = int(time.time())
    row = {
        "id": "batch_" + secrets.token_hex(12), "owner": owner, "key_name": tenant.name if tenant is not None else None,
        "endpoint": asked.endpoint, "input_file_id": asked.input_file_id, "completion_window": asked.completion_window,
        "status": "validating", "created_at": now, "expires_at": now + WINDOW_S[asked.completion_window],
        "metadata": json.dumps(asked.metadata) if asked.metadata is not None else None,
    }  # fmt: skip
    await batches.reserve(store, row, owner)  # the key's limits taken before the lines are checked; the file held
    try:
        try:
            custom_ids = await batches.in_create_pool(checked_lines, request.app.state.gateway, batches.files, asked.input_file_id, asked.endpoint, tenant, batches.settings)
        except FileNotFoundError:
            raise GatewayError(404, f"No such File object: {asked.input_file_id}", code="file_not_found", param="input_file_id") from None
        created = await batches.create(store, row["id"], custom_ids)
    except BaseException:
        await batches.in_create_pool(store.unreserve, row["id"], big=False)
        raise
    return _json(created.model_dump())


async def _owned_batch(request: Request, batch_id: str) -> Any:
    return await _owned(request, "batch", batch_id)


async def _owned(request: Request, kind: Literal["file", "batch"], object_id: str) -> Any:
    """The caller's file or batch ``object_id``; another key's answers the 404 of an absent id (never confirmed)."""
    _, store = await _batches(request)
    # an id with a NUL names nothing the gateway made, and PostgreSQL's text cannot even be asked for it
    found = None if "\0" in object_id else await _db(request, store.file if kind == "file" else store.batch, object_id, request_owner(request.scope))
    if found is None or (kind == "batch" and found.endpoint not in ENDPOINTS):  # a Message Batch: Anthropic's API only
        raise GatewayError(404, f"No such {kind.title()} object: {object_id}", code=f"{kind}_not_found", param=f"{kind}_id")
    return found


async def get_batch(batch_id: str, request: Request) -> Response:
    return _json((await _owned_batch(request, batch_id)).model_dump())


async def list_batches(request: Request) -> Response:
    _, store = await _batches(request)
    items, more = await _db(request, store.batches, request_owner(request.scope), request.query_params.get("after"), _limit(request), ENDPOINTS)
    return _json(page([item.model_dump() for item in items], more))


async def cancel_batch(batch_id: str, request: Request) -> Response:
    """No line starts from now on; lines in flight finish and their answers are kept; the batch ends ``cancelled``."""
    batches, store = await _batches(request)
    batch = await _owned_batch(request, batch_id)
    if batch.status in TERMINAL:
        raise GatewayError(409, f"batch {batch_id} is {batch.status} already", code="batch_not_cancellable", param="batch_id")
    await batches.cancel(store, batch_id)
    return _json((await _owned_batch(request, batch_id)).model_dump())


async def admin_batches(request: Request) -> Response:
    """Every key's batches (admin key), each with the key that owns it and the gateway that runs it (``leased_by``:
    a replica's name, ``local`` for a lone gateway; null between runs)."""
    _, store = await _batches(request)
    items, more = await _db(request, store.every_batch, request.query_params.get("after"), _limit(request))
    return _json(page([{**item.model_dump(), **whose} for item, whose in items], more))


HANDLERS: dict[tuple[str, str], Callable[..., Any]] = {
    ("POST", FILES): upload_file,
    ("GET", FILES): list_files,
    ("GET", FILE_BY_ID): get_file,
    ("DELETE", FILE_BY_ID): delete_file,
    ("GET", FILE_CONTENT): file_content,
    ("POST", BATCHES): create_batch,
    ("GET", BATCHES): list_batches,
    ("GET", BATCH_BY_ID): get_batch,
    ("POST", BATCH_CANCEL): cancel_batch,
    ("GET", ADMIN_BATCHES): admin_batches,
    **MESSAGE_HANDLERS,
}


def _unavailable_as_503(handler: Callable[..., Any]) -> Callable[..., Any]:
    """``handler`` with a database that fails after it was opened, or does not answer within its deadline
    (:class:`gateway.core.bounded_calls.DeadlineExceeded`), answered as
    when it cannot be opened: 503 ``batches_unavailable`` in the route's dialect (never a 500, which also drops the
    client's connection)."""

    @functools.wraps(handler)
    async def answered(*args: Any, **kwargs: Any) -> Any:
        try:
            return await handler(*args, **kwargs)
        except (SQLAlchemyError, TimeoutError) as error:  # TimeoutError: DeadlineExceeded, or a driver's own
            raise GatewayError(503, f"the batch database cannot be reached ({type(error).__name__}); try again later", code="batches_unavailable") from error

    return answered


def batch_routes() -> APIRouter:
    """The FastAPI routes of the table's batch lines (every line served, nothing served that the table lacks)."""
    table = {(method, path): summary for method, path, summary in BATCH_ROUTES}
    assert table.keys() == HANDLERS.keys(), f"gateway.core.endpoints.BATCH_ROUTES and the batch handlers differ: {table.keys() ^ HANDLERS.keys()}"
    router = APIRouter()
    for (method, path), summary in table.items():
        router.add_api_route(
            path, _unavailable_as_503(HANDLERS[(method, path)]), methods=[method], summary=summary, name=f"{method} {path}",
            include_in_schema=not path.startswith("/admin"),  # as every admin route: not listed to client keys
        )  # fmt: skip
    return router
