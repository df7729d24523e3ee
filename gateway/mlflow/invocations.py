"""``POST /invocations`` for a logged MLflow model, with the streaming that ``mlflow models serve`` lacks.

Accepts the Databricks Model Serving request shapes of the model's interface (ChatAgent,
ChatModel, ResponsesAgent; see ``model_code.serving``). With ``"stream": true`` in the body the
answer is SSE: one ``data: {chunk}`` event per ``predict_stream`` chunk, then ``data: [DONE]``, as
Databricks serving answers. The model's calls are blocking (the ``openai`` client), so they run in
worker threads; a failure after the 200 ends the stream with an OpenAI-shaped error event. Each
request holds a slot of the model's concurrency limiter (the one its OpenAI routes use) until its
answer or stream ends; over the limit it gets 429 like them.

Named keys hold here as on the OpenAI routes: a key that may not use the model gets the same 404, its request
waits in the model's queue by its priority class (``x-gateway-priority`` included), and the usage the model
reports is recorded on the request (its log line, the usage ledger, the key's token limits). The class does not
reach the engine: the model's own client sends the request.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response, StreamingResponse

from gateway.core.context import RequestInfo, request_info
from gateway.core.errors import GatewayError, sanitize_message, sse_error_event
from gateway.core.registry import ModelRoute
from gateway.tenants.keys import TENANT_SCOPE_KEY, Tenant
from gateway.tenants.priority import request_priority

DONE_EVENT = b"data: [DONE]\n\n"


def _as_gateway_error(error: Exception) -> GatewayError:
    status = getattr(error, "status_code", None)
    if not isinstance(status, int) or not 400 <= status <= 599:
        status = 500
    message = getattr(error, "message", None) or str(error) or type(error).__name__
    return GatewayError(status, sanitize_message(message))


def invocations_router(served: Any, route: Callable[[], ModelRoute | None] | None = None) -> APIRouter:
    """Routes for ``served`` (a ``model_code.serving.ServedModel``): ``/invocations`` and ``/ping``.

    ``route`` gives the model's current route (looked up per request: a reload may replace it): its limiter,
    and the names a key's ``models`` are checked against.
    """
    from model_code.serving import wants_stream

    router = APIRouter()
    name = str(getattr(served, "model_name", None) or "model")

    @router.get("/ping")
    async def ping() -> Response:
        return Response(b"\n", media_type="application/json")

    @router.post("/invocations")
    async def invocations(request: Request) -> Response:
        raw = await request.body()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise GatewayError(400, "request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise GatewayError(400, f"request body must be a JSON object, got {type(body).__name__}")
        tenant: Tenant | None = request.scope.get(TENANT_SCOPE_KEY)
        priority = request_priority(request.scope, tenant)
        current = route() if route is not None else None
        if current is not None and tenant is not None and not tenant.may_use(current.names):
            raise GatewayError(404, f"The model {name!r} does not exist", code="model_not_found", param="model")
        info = request_info(request.scope)
        if info is not None:
            info.model = name
        slots = current.limiter if current is not None else None
        if slots is not None:
            await slots.acquire(name, priority or 0)
        release = _Once(slots.release if slots is not None else None)
        try:
            if wants_stream(body):
                chunks = await _first_chunk(served, body, release, info)
                streamed, release = release, _Once(None)  # the stream releases its slot when it ends
                return StreamingResponse(
                    _sse(chunks),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache"},
                    background=BackgroundTask(streamed),  # also if the stream never started
                )
            try:
                result = await run_in_threadpool(served.predict, body)
            except Exception as error:  # model_code raises typed errors with status_code
                raise _as_gateway_error(error) from None
            _note_usage(info, result)
            return Response(orjson.dumps(result, default=_jsonable), media_type="application/json")
        finally:
            release()

    return router


async def _first_chunk(
    served: Any, body: dict[str, Any], release: Callable[[], None], info: RequestInfo | None = None
) -> AsyncIterator[Any]:
    """Start the stream and fetch its first chunk before the 200, so early errors get a real status.

    ``release`` (the limiter slot) is called when the stream ends, fails or is abandoned; on an early
    error the caller releases it. The usage chunks report is recorded on ``info`` as they pass.
    """
    chunks = _ThreadedStream(lambda: served.predict_stream(body))
    try:
        first = await chunks.next()
    except Exception as error:
        chunks.cancel()
        raise _as_gateway_error(error) from None

    async def rest() -> AsyncIterator[Any]:
        try:
            item = first
            while item is not _END:
                _note_usage(info, item)
                yield item
                item = await chunks.next()
        finally:  # also on client disconnect: the producer closes the model's generator
            chunks.cancel()
            release()

    return rest()


def _note_usage(info: RequestInfo | None, item: Any) -> None:
    """Record the usage an answer or a stream chunk reports (a ChatAgent's or ChatModel's ``usage``; a Responses
    event's ``response.usage``), which the key's token limits and the usage ledger read from the request."""
    if info is None:
        return
    data = item if isinstance(item, dict) else _jsonable_or_none(item)
    if isinstance(data, dict):
        response = data.get("response")
        usage = data.get("usage") or (response.get("usage") if isinstance(response, dict) else None)
        info.set_usage(usage)


def _jsonable_or_none(item: Any) -> Any:
    try:
        return _jsonable(item)
    except TypeError:
        return None


class _Once:
    """Calls ``fn`` on the first call only (a limiter slot is released exactly once)."""

    def __init__(self, fn: Callable[[], None] | None) -> None:
        self._fn = fn

    def __call__(self) -> None:
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()


_END = object()


class _ThreadedStream:
    """Iterate a blocking generator in ONE dedicated thread and hand its items to the event loop.

    One thread, not a thread per ``next()``: MLflow's ``predict_stream`` sets a context variable
    when it starts and resets it when it ends, which fails if the generator hops between contexts.
    """

    def __init__(self, make: Callable[[], Iterable[Any]]) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._cancelled = threading.Event()
        threading.Thread(target=self._produce, args=(make,), name="invocations-stream", daemon=True).start()

    def _produce(self, make: Callable[[], Iterable[Any]]) -> None:
        iterator = None
        try:
            iterator = iter(make())
            for item in iterator:
                if self._cancelled.is_set():
                    break
                self._put("item", item)
            self._put("end", None)
        except Exception as error:
            self._put("error", error)
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()

    def _put(self, kind: str, value: Any) -> None:
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (kind, value))

    async def next(self) -> Any:
        kind, value = await self._queue.get()
        if kind == "error":
            raise value
        return _END if kind == "end" else value

    def cancel(self) -> None:
        self._cancelled.set()


async def _sse(chunks: AsyncIterator[Any]) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            yield b"data: " + orjson.dumps(chunk, default=_jsonable) + b"\n\n"
    except Exception as error:
        yield sse_error_event(_as_gateway_error(error))
        return
    yield DONE_EVENT


def _jsonable(value: Any) -> Any:
    """MLflow returns pydantic/dataclass objects in places; serialise them as their dict form."""
    for method in ("model_dump", "to_dict"):
        if hasattr(value, method):
            return getattr(value, method)()
    raise TypeError(f"cannot serialise {type(value).__name__}")
