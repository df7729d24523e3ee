"""Forward one validated request to its model's backend, plain or streaming, in the route's dialect.

The body goes upstream as the client sent it, with only ``model`` rewritten to the engine's served
name. Streams are relayed event by event (complete ``\\n\\n``-terminated SSE events, ``event:`` lines
included, exactly as the engine wrote them) without parsing JSON, except for the rare event that
carries ``usage`` (for token metrics), an engine ``error`` (which is sanitized) or, on the Responses
API, the id of the response being created (see :mod:`gateway.core.responses_index`). A client that goes
away closes the upstream response, so the engine stops generating; an upstream failure after the 200
ends the stream with an error event framed like the route's own events.
"""

from __future__ import annotations

import asyncio
import functools
import re
import socket
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import aiohttp
import orjson
from aiohttp.client_proto import ResponseHandler
from loguru import logger
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send
from yarl import URL

from gateway.config import BalancingSettings
from gateway.core.context import RequestInfo
from gateway.core.endpoints import ProxiedRoute
from gateway.core.errors import GatewayError, StreamKind, sanitize_message, sse_error_event, upstream_error
from gateway.core.limits import ConcurrencyLimiter
from gateway.core.metrics import Metrics
from gateway.core.poison import Quarantine, payload_shape, request_shape, token_id_problem
from gateway.core.registry import Backend, ModelRoute
from gateway.core.responses_index import ResponseIndex
from gateway.data.balancer import pick
from gateway.data.bounds import grammar_bytes
from gateway.data.stream_pool import (
    KEEPALIVE_S,
    QuickAck,
    StreamExchange,
    StreamPool,
    UpstreamConnectTimeout,
    UpstreamPoolFull,
    UpstreamUnreachable,
)
from gateway.edge.auth import OPEN_OWNER
from gateway.edge.connection import HTTP_CYCLE

T = TypeVar("T")
_MAX_PENDING = 4 * 1024 * 1024  # an SSE event larger than this is forwarded unsplit, unscanned
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_DONE = b"data: [DONE]\n\n"
_USAGE = (b'"usage":{', b'"usage": {')
# How a complete stream ends, by framing: a stream that stops before one of these (a router or engine that
# closed it cleanly in the middle) ends with the gateway's error event instead.
_ENDINGS: dict[StreamKind, tuple[bytes, ...]] = {
    StreamKind.DATA: (_DONE[:-2], b'data: {"error":'),
    StreamKind.RESPONSES: (b'"type":"response.completed"', b'"type":"response.incomplete"', b'"type":"response.failed"', b"event: error"),
    StreamKind.ANTHROPIC: (b"event: message_stop", b"event: error"),
}
# What makes an event worth parsing, by stream framing. Responses events all carry "error":null.
_MARKERS: dict[StreamKind, tuple[bytes, ...]] = {
    StreamKind.DATA: (*_USAGE, b'"error"'),
    StreamKind.RESPONSES: (*_USAGE, b'"error":{', b'"error": {', b'"type":"error"', b'"response.created"'),
    StreamKind.ANTHROPIC: (*_USAGE, b'"type":"error"'),
}


def _any_of(needles: tuple[bytes, ...]) -> re.Pattern[bytes]:
    """One compiled scan for several byte strings (one pass over an event instead of one per string)."""
    return re.compile(b"|".join(re.escape(needle) for needle in needles))


_ENDING_SCAN = {kind: _any_of(endings) for kind, endings in _ENDINGS.items()}
_MARKER_SCAN = {kind: _any_of(markers) for kind, markers in _MARKERS.items()}
# Idle upstream connections are kept this long (both pools): under the 5 s keep-alive of uvicorn (SGLang's
# server), so the gateway never reuses a connection the engine is closing (aiohttp does not retry a POST on one).
UPSTREAM_KEEPALIVE_S = KEEPALIVE_S


class QuickAckResponseHandler(ResponseHandler):
    """aiohttp's connection protocol, acknowledging every upstream read at once (:class:`gateway.data.stream_pool.QuickAck`)."""

    _ack: QuickAck | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._ack = QuickAck(transport)

    def data_received(self, data: bytes) -> None:
        if self._ack is not None:
            self._ack.rearm()
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._ack is not None:
            self._ack.close()
        super().connection_lost(exc)


class QuickAckConnector(aiohttp.TCPConnector):
    """A ``TCPConnector`` whose connections use :class:`QuickAckResponseHandler` (aiohttp has no public hook
    for the protocol; a test checks that this one still takes effect)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._factory = functools.partial(QuickAckResponseHandler, loop=self._loop)


def upstream_session(connect_timeout_s: float, read_timeout_s: float, max_connections: int | None) -> aiohttp.ClientSession:
    """The one pooled ``aiohttp.ClientSession`` that forwards plain requests (create it inside the event loop;
    streams go over :class:`gateway.data.stream_pool.StreamPool`).

    Connections are kept alive and reused, up to ``max_connections`` at once when set, else without a cap
    (no per-host cap and no smaller keep-alive cap: every concurrency level reuses its connections). ``connect_timeout_s``
    bounds the wait for a pooled connection plus the TCP connect; ``read_timeout_s`` is the longest
    silence between upstream bytes (response headers included); there is no total timeout, a
    stream lasts as long as the engine keeps sending. Reads are acknowledged at once where the OS
    allows it (:class:`QuickAckResponseHandler`): a router's stream events then never wait for a delayed ACK.
    """
    connector_class = QuickAckConnector if hasattr(socket, "TCP_QUICKACK") else aiohttp.TCPConnector
    connector = connector_class(
        limit=max_connections or 0, limit_per_host=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S, ttl_dns_cache=300
    )
    timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s, sock_connect=connect_timeout_s, sock_read=read_timeout_s)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        trust_env=False,  # no proxy variables: engines are reached directly
        auto_decompress=False,  # bytes are relayed as the engine sent them (we ask for no encoding)
        skip_auto_headers=("Accept-Encoding", "User-Agent"),
        cookie_jar=aiohttp.DummyCookieJar(),
        raise_for_status=False,
    )


def transport_error(error: BaseException, backend: str, retry_after_s: int = 1) -> GatewayError:
    """Map a failure talking to ``backend`` to 503 (unreachable / connection lost / the gateway's own
    connection cap reached) or 504 (the engine timed out)."""
    retry = {"Retry-After": str(retry_after_s)}
    if isinstance(error, UpstreamPoolFull):
        return GatewayError(503, f"the gateway is at its cap of connections to the engines: {error}; retry later", code="upstream_pool_full", headers=retry)
    if isinstance(error, (aiohttp.ConnectionTimeoutError, UpstreamConnectTimeout)):
        return GatewayError(504, f"timed out connecting to the engine of {backend}", code="upstream_timeout")
    if isinstance(error, TimeoutError):  # aiohttp's ServerTimeoutError (sock_read) is one too
        return GatewayError(504, f"timed out waiting for the engine of {backend}", code="upstream_timeout")
    if isinstance(error, (aiohttp.ClientConnectorError, UpstreamUnreachable)):
        return GatewayError(503, f"the engine of {backend} is unreachable", code="engine_unavailable", headers=retry)
    return GatewayError(503, f"lost the connection to the engine of {backend}", code="engine_unavailable", headers=retry)


# What a failed upstream exchange can raise: aiohttp's errors, its timeouts, and OS errors under them.
UPSTREAM_ERRORS = (aiohttp.ClientError, TimeoutError, OSError)


class Proxy:
    """Forwards requests upstream: plain ones over one shared, pooled ``aiohttp.ClientSession`` (``session``),
    streams over ``streams`` (relayed from the socket's callbacks, :mod:`gateway.data.stream_pool`)."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        metrics: Metrics,
        quarantine: Quarantine | None = None,
        responses: ResponseIndex | None = None,
        streams: StreamPool | None = None,
    ) -> None:
        self.session = session
        self.streams = streams if streams is not None else StreamPool(5.0, 600.0)
        self.max_connections: int | None = getattr(session.connector, "limit", 0) or None
        self._plain_busy = 0  # plain requests upstream now (the session's connections they hold)
        self.metrics = metrics
        self.quarantine = quarantine if quarantine is not None else Quarantine()
        self.responses = responses if responses is not None else ResponseIndex()
        self._urls: dict[str, URL] = {}

    def _url(self, text: str) -> URL:
        url = self._urls.get(text)
        if url is None:
            if len(self._urls) > 1024:  # backends come and go with swaps; never grow without bound
                self._urls.clear()
            url = self._urls[text] = URL(text)
        return url

    async def forward(
        self,
        route: ModelRoute,
        endpoint: ProxiedRoute,
        body: dict[str, Any],
        info: RequestInfo,
        receive: Receive | None = None,
        *,
        balancing: BalancingSettings | None = None,
        pinned: Backend | None = None,
        owner: str = OPEN_OWNER,
        grammar_size: int | None = None,
    ) -> Response:
        """Admit the request (limits, backend state), send it, and answer plain JSON or an SSE stream.

        The replica is chosen by :func:`gateway.data.balancer.pick`; when it fails before the client got a byte
        (unreachable, or it died under a plain request), the request is sent once more, to another replica.
        ``receive`` (the request's ASGI receive, body already read) lets a plain request notice a
        client that gave up, and close the upstream request instead of letting the engine finish it.
        A stream needs no such watch before its response starts: engines send a stream's headers at
        once, and :class:`SSEProxyResponse` watches the client from then on. ``pinned``: the backend
        that must answer (it holds the state the request continues). ``owner``: the client key's identity
        (:func:`gateway.edge.auth.request_owner`), recorded as the owner of a Responses API response it creates.
        ``grammar_size``: :func:`gateway.data.bounds.grammar_bytes` of ``body`` when the caller measured it already.
        """
        path = endpoint.upstream_path
        problem = token_id_problem(endpoint.token_ids, body, route.backend.vocab_size)
        if problem is not None:
            raise GatewayError(400, problem, code="invalid_token_ids", param=problem.split(":", 1)[0])
        limiter = route.limiter
        await limiter.acquire(route.name)
        lease = _Lease(limiter)
        handed_over = False
        try:
            if limiter.settings.max_concurrent_grammars:
                size = grammar_bytes(body) if grammar_size is None else grammar_size
                if size >= limiter.settings.heavy_grammar_bytes:
                    lease.grammar = await limiter.acquire_grammar(route.name)
            if route.drained:
                raise GatewayError(
                    503, f"model {route.name!r} is drained by an operator; retry later", code="model_drained",
                    headers={"Retry-After": str(limiter.settings.retry_after_s)},
                )
            streamed = info.stream = endpoint.stream is not None and body.get("stream") is True
            failed: Backend | None = None
            while True:
                # chosen once per attempt: a swap mid-request must not split it across backends
                backend = self._choose(route, body, balancing, pinned, failed, limiter.settings.retry_after_s)
                lease.take(backend, self.metrics.child(self.metrics.in_flight, route.name))
                info.replica = backend.replica if len(route.replicas) > 1 and not backend.is_router else None
                body["model"] = backend.served_name
                payload = orjson.dumps(body)
                lease.request = (path, payload)
                if self.quarantine:
                    self.quarantine.check(route.name, request_shape(path, body))
                headers = {"Content-Type": "application/json", "X-Request-Id": info.request_id, **backend.upstream_headers()}
                try:
                    finished, result = await _unless_disconnected(
                        self._exchange(lease, backend, path, payload, headers, streamed), None if streamed else receive
                    )
                except UPSTREAM_ERRORS as error:
                    lease.note_if_lost(error)
                    lease.let_go()
                    if pinned is None and failed is None and _another(route, backend):
                        failed = backend  # nothing reached the client yet: once more, on another replica
                        continue
                    raise transport_error(error, route.name, limiter.settings.retry_after_s) from None
                if finished and result is not None and _router_lost_its_worker(backend, *result) and pinned is None and failed is None and _another(route, backend):
                    lease.let_go()
                    failed = backend  # the router could not reach its replica: once more, to a replica directly
                    continue
                break
            if not finished:
                info.error = "client disconnected"
                return Response(b"", status_code=499)  # nobody is listening; 499 only shows in logs/metrics
            assert result is not None
            upstream, content = result
            if upstream.status != 200:
                raise upstream_error(upstream.status, content or b"", body)
            if not streamed:
                info.ttft_s = time.perf_counter() - info.started
                data = _parsed_if(content or b"", b'"usage"' if not endpoint.response_ids else b'"id"')
                if data is not None:
                    info.set_usage(data.get("usage"))
                    if endpoint.response_ids and isinstance(data.get("id"), str):
                        self.responses.record(data["id"], route.name, backend.identity, owner)
                if endpoint.renames_model:  # SGLang names an embedding model by its path (a file path on this host)
                    content = _with_model(content or b"", data, backend.served_name)
                media = upstream.headers.get("Content-Type", "application/json")
                return Response(content or b"", status_code=200, media_type=media)
            handed_over = True
            on_created = (lambda response_id: self.responses.record(response_id, route.name, backend.identity, owner)) if endpoint.response_ids else None
            return SSEProxyResponse(lease, info, self.metrics, route.name, endpoint.stream or StreamKind.DATA, on_created, body)
        finally:
            if not handed_over:
                lease.close()

    def _choose(
        self, route: ModelRoute, body: dict[str, Any], balancing: BalancingSettings | None, pinned: Backend | None,
        failed: Backend | None, retry_after_s: int,
    ) -> Backend:  # fmt: skip
        """The backend for this attempt, or GatewayError(503) naming why none can take it."""
        backend = pinned if pinned is not None else pick(route, balancing or BalancingSettings(), body, exclude=failed)
        if backend is not None and backend.unavailable_reason() is None:
            return backend
        down = backend or route.backend
        reason = down.unavailable_reason() or "no replica can take requests"
        retry = down.retry_after_s if down.failure is not None and down.retry_after_s else retry_after_s
        raise GatewayError(503, f"model {route.name!r} is unavailable: {reason}", code="engine_unavailable", headers={"Retry-After": str(retry)})

    async def _exchange(
        self, lease: _Lease, backend: Backend, path: str, payload: bytes, headers: dict[str, str], streamed: bool
    ) -> tuple[aiohttp.ClientResponse | StreamExchange, bytes | None]:
        if streamed:  # a 200 stream is relayed by SSEProxyResponse; an error answer is read whole
            quickack = not backend.sends_at_once
            exchange = lease.upstream = await self.streams.request(backend.url, path, payload, headers, quickack=quickack)
            return exchange, await exchange.read() if exchange.status != 200 else None
        self._plain_busy += 1
        try:
            upstream = lease.upstream = await self.session.post(self._url(backend.url + path), data=payload, headers=headers)
            return upstream, await upstream.read()
        except aiohttp.ConnectionTimeoutError:
            if self.max_connections is not None and self._plain_busy > self.max_connections:
                # the wait was for one of the session's connections, not for the engine
                raise UpstreamPoolFull(f"all {self.max_connections} upstream connections (upstream_max_connections) were busy") from None
            raise
        finally:
            self._plain_busy -= 1


# What SGLang's router (0.3.x) answers, with a 5xx, when the worker it chose did not take or answer the request.
_ROUTER_WORKER_LOST = (b"error sending request", b"connection closed", b"Failed to send request", b"No available workers")


def _router_lost_its_worker(backend: Backend, upstream: aiohttp.ClientResponse, content: bytes | None) -> bool:
    """A router's 5xx that means its worker was unreachable or died under the request: nothing reached the
    client, and another replica can answer (the router's own retries pick the same worker again)."""
    return backend.is_router and upstream.status >= 500 and any(marker in (content or b"") for marker in _ROUTER_WORKER_LOST)


def _another(route: ModelRoute, failed: Backend) -> bool:
    return any(backend is not failed for backend in route.available()) or (route.front is not None and route.front is not failed)


async def call_backend(proxy: Proxy, model: str, backend: Backend, method: str, path: str, info: RequestInfo) -> Response:
    """A body-less call to one given backend (a stored response, by id), errors mapped like any request's."""
    reason = backend.unavailable_reason()
    if reason is not None:
        raise GatewayError(503, f"model {model!r} is unavailable: {reason}", code="engine_unavailable", headers={"Retry-After": "1"})
    headers = {"X-Request-Id": info.request_id, **backend.upstream_headers()}
    try:
        async with proxy.session.request(method, proxy._url(backend.url + path), headers=headers) as upstream:
            content = await upstream.read()
            media = upstream.headers.get("Content-Type", "application/json")
    except UPSTREAM_ERRORS as error:
        raise transport_error(error, model) from None
    if upstream.status != 200:
        raise upstream_error(upstream.status, content)
    return Response(content, status_code=200, media_type=media)


class _Lease:
    """What one admitted request holds, given back by :meth:`close` (once, in reverse order of taking).

    Its limiter slot, its count in the backend's and the gauge's in-flight numbers, and the upstream
    response: a fully read one gives its connection back to the pool; one cut short is closed, which
    is what tells the engine that nobody listens any more (it aborts the request).
    """

    __slots__ = ("limiter", "backend", "gauge", "upstream", "request", "grammar")

    def __init__(self, limiter: ConcurrencyLimiter) -> None:
        self.limiter: ConcurrencyLimiter | None = limiter
        self.grammar = False  # holds one of the limiter's grammar slots
        self.backend: Backend | None = None
        self.gauge: Any = None
        self.upstream: aiohttp.ClientResponse | StreamExchange | None = None
        self.request: tuple[str, bytes] | None = None  # (path, body) as sent upstream

    def take(self, backend: Backend, gauge: Any) -> None:
        """Count this request on ``backend`` (and in the model's in-flight gauge)."""
        backend.in_flight += 1
        backend.active.add(self)
        self.backend = backend
        if self.gauge is None:
            self.gauge = gauge
            gauge.inc()

    def let_go(self) -> None:
        """Give back the backend (and its upstream response) but keep the slot: for a retry elsewhere."""
        upstream, self.upstream = self.upstream, None
        if upstream is not None:
            upstream.close()
        backend, self.backend = self.backend, None
        if backend is not None:
            backend.in_flight -= 1
            backend.active.discard(self)

    def note_if_lost(self, error: BaseException) -> None:
        """Remember this request on its backend when ``error`` means the connection broke under it
        (not a refused connect, not a timeout): if the engine died, the request is a suspect."""
        if self.backend is None or self.request is None:
            return
        if isinstance(error, (aiohttp.ClientConnectorError, TimeoutError, UpstreamUnreachable, UpstreamPoolFull)):
            return
        self.backend.lost.append(payload_shape(*self.request))

    def suspect(self) -> str | None:
        """This request's shape, when it is upstream (a suspect if its engine freezes)."""
        return payload_shape(*self.request) if self.request is not None else None

    def release_grammar(self) -> None:
        """Give back the grammar slot: the engine has compiled the grammar (a stream's first bytes came)."""
        if self.grammar and self.limiter is not None:
            self.grammar = False
            self.limiter.release_grammar()

    def close(self) -> None:
        self.release_grammar()
        upstream, self.upstream = self.upstream, None
        if upstream is not None:
            if isinstance(upstream, StreamExchange) or upstream.content.at_eof():
                upstream.release()  # a stream cut short is closed by it (the engine aborts the request)
            else:
                upstream.close()
        gauge, self.gauge = self.gauge, None
        if gauge is not None:
            gauge.dec()
        backend, self.backend = self.backend, None
        if backend is not None:
            backend.in_flight -= 1
            backend.active.discard(self)
        limiter, self.limiter = self.limiter, None
        if limiter is not None:
            limiter.release()


async def _unless_disconnected(work: Coroutine[Any, Any, T], receive: Receive | None) -> tuple[bool, T | None]:
    """Run ``work`` unless the client disconnects first: ``(True, result)``, or ``(False, None)``.

    SGLang sends a plain answer's headers only when generation is done, so without this a client
    that gives up would leave the engine generating for nobody.
    """
    if receive is None:
        return True, await work
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watch):
            if not pending.done():
                pending.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        return False, None
    return True, task.result()


def _with_model(content: bytes, data: dict[str, Any] | None, name: str) -> bytes:
    """``content`` (a JSON object, ``data`` when already parsed) with its ``model`` set to ``name``; anything
    else unchanged. Parsed once: an embeddings answer can be megabytes of vectors."""
    if data is None:
        data = _parsed_if(content, b'"model"')
    if data is None or "model" not in data:
        return content
    data["model"] = name
    return orjson.dumps(data)


def _parsed_if(content: bytes, marker: bytes) -> dict[str, Any] | None:
    """The JSON object in ``content`` when it mentions ``marker`` (most answers need no parsing)."""
    if marker not in content:
        return None
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


class SSEProxyResponse(Response):
    """An ASGI response relaying an upstream SSE stream; owns the upstream exchange and admission slot.

    The relay runs in the upstream socket's callbacks (:meth:`StreamExchange.relay`): each body piece is cut
    at event boundaries, scanned, and written to the client at once. Under the gateway's own uvicorn protocol
    the events go straight to the client's transport (:class:`_TransportWriter`, honouring its flow control);
    under any other ASGI server they go out as ASGI messages (:class:`_MessageWriter`). Either way the
    response's start and its last message pass through the middlewares as ASGI messages.
    """

    def __init__(
        self,
        lease: _Lease,
        info: RequestInfo,
        metrics: Metrics,
        model: str,
        kind: StreamKind = StreamKind.DATA,
        on_created: Callable[[str], None] | None = None,
        request: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(status_code=200, media_type="text/event-stream")
        assert isinstance(lease.upstream, StreamExchange)
        self.upstream: StreamExchange = lease.upstream
        self.lease = lease
        self.info = info
        self.metrics = metrics
        self.model = model
        self.kind = kind
        self.on_created = on_created  # told the id of a Responses API response when its creation event passes
        self.request = request  # the body sent: an engine error event may be about its input (gateway.core.client_mistakes)
        self._markers = _MARKER_SCAN[kind]
        self._endings = _ENDING_SCAN[kind]
        self._last = (b"", b"")  # the last two pieces written: where a complete stream's own ending is
        self._events = 0  # events relayed (Responses: the next sequence number)
        self._pending = b""
        self._held = b""  # the stream's last events ([DONE]): they go out with our end, in one write
        self._counts_events = kind is StreamKind.RESPONSES  # the error event we may add needs the next sequence number
        self._writer: _TransportWriter | _MessageWriter | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:  # type: ignore[override]
        # The response's task waits for the end; a watcher task cancels it if the client disconnects meanwhile.
        task = asyncio.current_task()
        assert task is not None
        relaying = True
        gone = False

        def on_watch_done(watch: asyncio.Task[None]) -> None:
            nonlocal gone
            if relaying and not watch.cancelled() and watch.exception() is None:
                gone = True
                task.cancel()

        watch = asyncio.ensure_future(_wait_disconnect(receive))
        watch.add_done_callback(on_watch_done)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
            cycle = scope.get("extensions", {}).get(HTTP_CYCLE)
            writer = _TransportWriter(cycle, self.upstream) if cycle is not None else _MessageWriter(send, self.upstream)
            await self._pump(writer, send)
        except asyncio.CancelledError:
            if not gone or task.uncancel() > 0:
                raise
            self.info.error = "client disconnected"
        finally:
            relaying = False
            watch.remove_done_callback(on_watch_done)
            watch.cancel()
            self.lease.close()  # a stream cut short closes the upstream connection: the engine aborts the request

    def _on_data(self, chunk: bytes) -> None:
        """One upstream body piece, in the socket's callback: whole events go to the client at once."""
        writer = self._writer
        try:
            info = self.info
            if info.ttft_s is None:
                info.ttft_s = time.perf_counter() - info.started
                self.lease.release_grammar()
            events = self._complete_events(chunk)
            if not events:
                return
            if self._counts_events:
                self._events += events.count(b"\n\n")
            if self._held:  # (cannot happen: nothing follows the end of a stream)
                events, self._held = self._held + events, b""
            if events.endswith(_DONE):
                self._held = events
            else:
                writer.write(events)
                self._last = (self._last[1], events)
        except Exception as error:  # a bug here must end this stream, not the upstream socket's callback
            logger.exception("relay: the stream of {} failed", self.model)
            writer.finish(_RelayFailed(error))

    async def _pump(self, writer: _TransportWriter | _MessageWriter, send: Send) -> None:
        self._writer = writer
        self.upstream.relay(self._on_data, writer.finish)
        error = await writer.wait()
        failure: GatewayError | None = None
        if isinstance(error, _RelayFailed):
            failure = GatewayError(500, "the gateway failed relaying the stream", code="internal_error")
        elif error is not None:
            if self.info.ttft_s is None:  # a stream that already produced tokens got past the prefill: not a suspect
                self.lease.note_if_lost(error)
            failure = transport_error(error, self.model)
        # The engine is done with this request: give back its slot now, not once a slow client has read
        # the rest (a client that stops reading is cut off by the HTTP layer's write timeout).
        self.lease.close()
        tail, self._held = self._held, b""
        if self._pending:
            tail += self._last_partial_event(self._pending)
            self._pending = b""
        # Scanned here, not per event: a stream's ending is its last event (a scan per event cost ~1-4 µs).
        ended = self._endings.search(b"".join((*self._last, tail))) is not None
        if failure is None and not ended:
            failure = GatewayError(
                502, f"the stream from the engine of {self.model} stopped before its end", code="upstream_stream_incomplete"
            )
        if failure is not None:
            self.info.error = failure.log_detail or failure.message
            self.metrics.child(self.metrics.stream_errors, self.model).inc()
            tail += sse_error_event(failure, self.kind, self._events)
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    def _last_partial_event(self, pending: bytes) -> bytes:
        """What follows the last blank line when the upstream body ended: the stream's own last event as it
        is; otherwise whole lines go out (an event whose closing blank line never came), closed with one, and a
        line cut short is dropped, so that the error event after it starts on an event boundary instead of
        inside a broken JSON line."""
        if self._endings.search(pending) is not None:
            return self._inspect(pending)  # the stream's own last event, without its closing blank line
        whole = pending[: pending.rfind(b"\n") + 1]
        if not whole.strip():
            return b""
        return self._inspect(whole) + b"\n"  # ``whole`` ends with one newline (pending follows the last blank line)

    def _complete_events(self, chunk: bytes) -> bytes:
        """The complete events received so far (held back: a partial event at the end)."""
        data = self._pending + chunk if self._pending else chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            if len(data) > _MAX_PENDING:
                self._pending = b""
                return data
            self._pending = data
            return b""
        if cut + 2 == len(data):  # the usual piece: whole events, nothing to copy or hold back
            self._pending = b""
            return self._inspect(data)
        self._pending = data[cut + 2 :]
        return self._inspect(data[: cut + 2])

    def _inspect(self, events: bytes) -> bytes:
        """Byte scans only; JSON is parsed just for the lines carrying a usage object, an error or a new response."""
        at = _next_marker(events, 0, self._markers)
        if at < 0:
            return events
        out = []
        start = 0
        while at >= 0:
            line_start = events.rfind(b"\n", 0, at) + 1
            line_end = events.find(b"\n", at)
            line_end = len(events) if line_end < 0 else line_end
            line = events[line_start:line_end]
            out.append(events[start:line_start])
            out.append(self._inspect_line(line) if line.startswith(b"data: {") else line)
            start = line_end
            at = _next_marker(events, start, self._markers)
        out.append(events[start:])
        return b"".join(out)

    def _inspect_line(self, line: bytes) -> bytes:
        try:
            data = orjson.loads(line[6:])
        except orjson.JSONDecodeError:
            return line
        if not isinstance(data, dict):
            return line
        self.info.set_usage(_usage_of(data))
        if self.kind is not StreamKind.DATA:
            return self._inspect_event(line, data)
        error = data.get("error")
        if error is not None and "choices" not in data:
            detail = error if isinstance(error, dict) else {"message": error}
            status = detail.get("code") if isinstance(detail.get("code"), int) else 500
            sanitized = upstream_error(status, orjson.dumps({"error": {**detail, "message": sanitize_message(detail.get("message"))}}), self.request)
            self.info.error = sanitized.log_detail or sanitized.message
            return sse_error_event(sanitized).rstrip(b"\n")
        return line

    def _inspect_event(self, line: bytes, data: dict[str, Any]) -> bytes:
        """Responses / Anthropic events: note a created response's id; sanitize an engine error in place."""
        if data.get("type") == "response.created" and self.on_created is not None:
            response = data.get("response")
            if isinstance(response, dict) and isinstance(response.get("id"), str):
                self.on_created(response["id"])
        holders = [data] if data.get("type") == "error" and "message" in data else []
        holders += [value for value in (data.get("error"), (data.get("response") or {}).get("error")) if isinstance(value, dict)]
        if not holders:
            return line
        for holder in holders:
            holder["message"] = sanitize_message(holder.get("message"))
            self.info.error = self.info.error or holder["message"][:300]
        return b"data: " + orjson.dumps(data)


def _next_marker(events: bytes, start: int, markers: re.Pattern[bytes]) -> int:
    """Where the next of ``markers`` is mentioned in ``events`` from ``start`` (-1: nowhere).

    Engines put ``"usage":null`` in every chunk: only an object is worth parsing.
    """
    found = markers.search(events, start)
    return found.start() if found is not None else -1


def _usage_of(data: dict[str, Any]) -> Any:
    """The usage object of an event: top level (chat, Anthropic deltas) or in the object it carries
    (Responses' ``response``, Anthropic's ``message_start.message``)."""
    usage = data.get("usage")
    if usage is None:
        for key in ("response", "message"):
            inner = data.get(key)
            if isinstance(inner, dict) and isinstance(inner.get("usage"), dict):
                return inner["usage"]
    return usage


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            return


class _RelayFailed(Exception):
    """The relay itself raised (a bug): the stream ends with a 500 error event."""


class _TransportWriter:
    """Events straight to the client's transport, framed as uvicorn frames the body (one write per piece).

    ``cycle`` is uvicorn's request-response cycle, handed over by :class:`gateway.edge.connection.GuardedHttpProtocol`.
    When the client's socket buffer is full (its flow control paused writing), reading from the engine pauses
    until it drains: a slow client slows its own stream, never the gateway's memory.
    """

    __slots__ = ("cycle", "upstream", "draining", "done")

    def __init__(self, cycle: Any, upstream: StreamExchange) -> None:
        self.cycle = cycle
        self.upstream = upstream
        self.draining: asyncio.Future[None] | None = None
        self.done: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

    def write(self, events: bytes) -> None:
        cycle = self.cycle
        if cycle.disconnected:  # the watcher task ends the stream
            return
        cycle.transport.write(b"%x\r\n%b\r\n" % (len(events), events) if cycle.chunked_encoding else events)
        if cycle.flow.write_paused and self.draining is None:
            self.upstream.pause_reading()
            self.draining = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            await self.cycle.flow.drain()
        finally:
            self.draining = None
            self.upstream.resume_reading()

    def finish(self, error: BaseException | None) -> None:
        if not self.done.done():
            self.done.set_result(error)

    async def wait(self) -> BaseException | None:
        try:
            return await self.done
        finally:
            if self.draining is not None:
                self.draining.cancel()


class _MessageWriter:
    """Events as ASGI messages, sent from the response's task (a server other than the gateway's uvicorn)."""

    __slots__ = ("send", "upstream", "pending", "size", "wake", "ended", "error")
    _PAUSE_AT = 256 * 1024  # bytes waiting to be sent: beyond, reading from the engine pauses

    def __init__(self, send: Send, upstream: StreamExchange) -> None:
        self.send = send
        self.upstream = upstream
        self.pending: list[bytes] = []
        self.size = 0
        self.wake: asyncio.Future[None] | None = None
        self.ended = False
        self.error: BaseException | None = None

    def write(self, events: bytes) -> None:
        self.pending.append(events)
        self.size += len(events)
        if self.size > self._PAUSE_AT:
            self.upstream.pause_reading()
        self._wake()

    def finish(self, error: BaseException | None) -> None:
        if not self.ended:
            self.ended, self.error = True, error
            self._wake()

    def _wake(self) -> None:
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)

    async def wait(self) -> BaseException | None:
        while True:
            if self.pending:
                body, paused = b"".join(self.pending), self.size > self._PAUSE_AT
                self.pending.clear()
                self.size = 0
                await self.send({"type": "http.response.body", "body": body, "more_body": True})
                if paused:
                    self.upstream.resume_reading()
                continue
            if self.ended:
                return self.error
            self.wake = asyncio.get_running_loop().create_future()
            await self.wake
