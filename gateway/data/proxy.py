"""Forward one validated request to its model's backend, plain or streaming, in the route's dialect.

Admission (the model's limiter, the quarantine, token ids), the choice of a replica (with one retry
elsewhere when nothing reached the client), and the exchange: the body goes upstream as the client sent
it, with only ``model`` rewritten to the engine's served name; a plain answer comes back with its ``model``
set to the client's name, a stream is handed to the relay (:mod:`gateway.data.relay`). What a request
holds is its :class:`~gateway.data.lease.Lease`; transport failures map to errors in
:mod:`gateway.data.upstream_errors`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from functools import partial
from typing import Any, TypeVar

import aiohttp
import orjson
from starlette.responses import Response
from starlette.types import Receive
from yarl import URL

from engine_guard.bounds import grammar_bytes
from engine_guard.shapes import request_shape
from engine_guard.token_ids import token_id_problem
from gateway.config import BalancingSettings
from gateway.core.backends import Backend
from gateway.core.context import RequestInfo
from gateway.core.endpoints import ProxiedRoute
from gateway.core.errors import GatewayError, StreamKind, unknown_model, upstream_error
from gateway.core.metrics import Metrics
from gateway.core.poison import Quarantine
from gateway.core.registry import ModelRoute, Registry
from gateway.core.responses_index import ResponseIndex
from gateway.core.state import Waker
from gateway.core.tracing import Tracing, finish_reasons, request_params
from gateway.data.balancer import pick
from gateway.data.lease import Lease
from gateway.data.prompt_count import count_prompt
from gateway.data.relay import SSEProxyResponse, wait_disconnect
from gateway.data.stream_pool import (
    StreamExchange,
    StreamPool,
    UpstreamPoolFull,
)
from gateway.data.upstream_errors import UPSTREAM_ERRORS, router_lost_its_worker, transport_error
from gateway.data.usage_request import ask_for_usage, cost_bound, prompt_bound
from gateway.data.waking import WakingStreamResponse
from gateway.edge.auth import OPEN_OWNER

T = TypeVar("T")


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
        waker: Waker | None = None,
        tracing: Tracing | None = None,
        registry: Registry | None = None,
    ) -> None:
        self.session = session
        self.registry = registry  # the routes now: an adapter unloaded while a request queued is not sent
        self.tracing = tracing  # OpenTelemetry spans (gateway.core.tracing); None: off, and nothing noted
        self.waker = waker  # models whose engines start on demand: a request for one asleep waits for it
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
        priority: int | None = None,
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
        ``grammar_size``: :func:`engine_guard.bounds.grammar_bytes` of ``body`` when the caller measured it already.
        ``priority``: the request's class (its ``x-gateway-priority`` header's, else its key's): its place in the model's
        queue, and the request's ``priority`` on an engine that schedules by it (there it replaces whatever the client sent).
        """
        waker = self.waker
        if waker is None or not waker.manages(route.name):
            return await self._forward(route, endpoint, body, info, receive, balancing, pinned, owner, grammar_size, priority)
        if route.asleep and endpoint.stream is not None and body.get("stream") is True:  # keep-alives while it starts
            info.stream = True

            def forward_woken(woken: ModelRoute) -> Coroutine[Any, Any, Response]:
                return self._forward(woken, endpoint, body, info, receive, balancing, pinned, owner, grammar_size, priority)

            return WakingStreamResponse(waker, route, forward_woken, endpoint.stream, info, owner)
        route = await waker.enter(route, owner)  # counted until it holds its backend: an idle model is never stopped under it
        try:
            return await self._forward(route, endpoint, body, info, receive, balancing, pinned, owner, grammar_size, priority)
        finally:
            waker.leave(route.name)

    async def _forward(
        self, route: ModelRoute, endpoint: ProxiedRoute, body: dict[str, Any], info: RequestInfo, receive: Receive | None,
        balancing: BalancingSettings | None, pinned: Backend | None, owner: str, grammar_size: int | None, priority: int | None,
    ) -> Response:  # fmt: skip
        path = endpoint.upstream_path
        adapter = route.adapter_for(body.get("model"))  # "<model>:<adapter>": SGLang's own spelling, on the served name
        if adapter is not None:  # metrics, the request log, the ledger and the trace name it as the client did
            info.model = body["model"]
        problem = token_id_problem(endpoint.token_ids, body, route.backend.vocab_size)
        if problem is not None:
            raise GatewayError(400, problem, code="invalid_token_ids", param=problem.split(":", 1)[0])
        problem = route.backend.engine_version.field_problem(endpoint.path, body)  # an older SGLang would ignore it
        if problem is not None:
            raise GatewayError(400, problem, code="unsupported_parameter", param=problem.split(":", 1)[0])
        if info.reserve is not None:  # a limited key: hold what the request may cost (settled at its end)
            size = len(orjson.dumps(body))
            info.prompt_estimate, bound = cost_bound(body, size, route.backend.context_length)
            info.reserve(bound if endpoint.stream is not None else info.prompt_estimate)
        streamed = info.stream = endpoint.stream is not None and body.get("stream") is True
        hide_usage = streamed and endpoint.stream is StreamKind.DATA and ask_for_usage(body)
        limiter = route.limiter
        trace = info.trace
        if trace is not None:
            trace.params = request_params(body)
            queued = time.perf_counter()
            await limiter.acquire(route.name, priority or 0)
            trace.queued = (queued, time.perf_counter())
        else:
            await limiter.acquire(route.name, priority or 0)
        lease = Lease(limiter)
        lease.adapter = adapter
        lease.key = info.key_name or (None if owner == OPEN_OWNER else owner)
        handed_over = False
        try:
            if adapter is not None and not self._still_served(route.name, adapter):
                raise unknown_model(body["model"])  # unloaded while the request waited for its slot
            if limiter.settings.max_concurrent_grammars:
                size = grammar_bytes(body) if grammar_size is None else grammar_size
                if size >= limiter.settings.heavy_grammar_bytes:
                    lease.grammar = await limiter.acquire_grammar(route.name)
            if route.drained:
                raise GatewayError(
                    503, f"model {route.name!r} is drained by an operator; retry later", code="model_drained",
                    headers={"Retry-After": str(limiter.settings.retry_after_s)},
                )
            failed: Backend | None = None
            while True:
                # chosen once per attempt: a swap mid-request must not split it across backends
                backend = self._choose(route, body, balancing, pinned, failed, limiter.settings.retry_after_s)
                lease.take(backend, self.metrics.child(self.metrics.in_flight, route.name))
                info.replica = backend.replica if len(route.replicas) > 1 and not backend.is_router else None
                body["model"] = backend.served_name if adapter is None else f"{backend.served_name}:{adapter}"
                if priority is not None and backend.schedules_by_priority:
                    body["priority"] = priority
                payload = orjson.dumps(body)
                lease.request = (path, payload)
                if self.quarantine:
                    self.quarantine.check(route.name, request_shape(path, body), lease.key)
                headers = {"Content-Type": "application/json", "X-Request-Id": info.request_id, **backend.upstream_headers()}
                if trace is not None and self.tracing is not None:
                    headers.update(self.tracing.attempt(trace, backend.served_name, backend.url, info.replica))
                try:
                    finished, result = await _unless_disconnected(
                        self._exchange(lease, backend, path, payload, headers, streamed), None if streamed else receive
                    )
                except UPSTREAM_ERRORS as error:
                    if trace is not None and trace.attempts:
                        trace.attempts[-1].ended, trace.attempts[-1].error = time.perf_counter(), type(error).__name__
                    lease.note_if_lost(error)
                    lease.let_go()
                    if pinned is None and failed is None and _another(route, backend):
                        failed = backend  # nothing reached the client yet: once more, on another replica
                        continue
                    raise transport_error(error, route.name, limiter.settings.retry_after_s) from None
                if finished and result is not None and router_lost_its_worker(backend, *result) and pinned is None and failed is None and _another(route, backend):
                    lease.let_go()
                    failed = backend  # the router could not reach its replica: once more, to a replica directly
                    continue
                break
            if not finished:
                info.error = "client disconnected"
                # the engine took the prompt (and aborts what it was generating, which the gateway never sees)
                counted = await count_prompt(self.session, backend, path, body)
                info.prompt_tokens = counted if counted is not None else info.prompt_estimate or prompt_bound(len(payload))
                return Response(b"", status_code=499)  # nobody is listening; 499 only shows in logs/metrics
            assert result is not None
            upstream, content = result
            if trace is not None and trace.attempts:
                attempt = trace.attempts[-1]
                attempt.first_byte = time.perf_counter()  # a plain answer's head comes with its body; a stream's at once
                if not streamed:
                    attempt.ended = attempt.first_byte
                    trace.finish_reasons = finish_reasons(content or b"")
            if upstream.status != 200:
                raise upstream_error(upstream.status, content or b"", body)
            if not streamed:
                info.ttft_s = time.perf_counter() - info.started
                data = _parsed_if(content or b"", b'"usage"' if not endpoint.response_ids else b'"id"')
                if data is not None:
                    info.set_usage(data.get("usage"))
                    if endpoint.response_ids and isinstance(data.get("id"), str):
                        await self.responses.publish(data["id"], route.name, backend.identity, owner)
                if endpoint.renames_model:  # SGLang names an embedding model by its path (a file path on this host)
                    content = _with_model(content or b"", data, backend.served_name)
                media = upstream.headers.get("Content-Type", "application/json")
                return Response(content or b"", status_code=200, media_type=media)
            handed_over = True
            on_created = (lambda response_id: self.responses.record(response_id, route.name, backend.identity, owner)) if endpoint.response_ids else None
            counter = partial(count_prompt, self.session, backend, path, body)  # for a stream that ends without usage
            return SSEProxyResponse(lease, info, self.metrics, route.name, endpoint.stream or StreamKind.DATA, on_created, body, hide_usage, counter)
        finally:
            if not handed_over:
                lease.close()

    def _still_served(self, model: str, adapter: str) -> bool:
        current = self.registry.route(model) if self.registry is not None else None
        return current is None or adapter in current.adapters

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
        self, lease: Lease, backend: Backend, path: str, payload: bytes, headers: dict[str, str], streamed: bool
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

    async def call_backend(self, model: str, backend: Backend, method: str, path: str, info: RequestInfo) -> Response:
        """A body-less call to one given backend (a stored response, by id), errors mapped like any request's."""
        reason = backend.unavailable_reason()
        if reason is not None:
            raise GatewayError(503, f"model {model!r} is unavailable: {reason}", code="engine_unavailable", headers={"Retry-After": "1"})
        headers = {"X-Request-Id": info.request_id, **backend.upstream_headers()}
        try:
            async with self.session.request(method, self._url(backend.url + path), headers=headers) as upstream:
                content = await upstream.read()
                media = upstream.headers.get("Content-Type", "application/json")
        except UPSTREAM_ERRORS as error:
            raise transport_error(error, model) from None
        if upstream.status != 200:
            raise upstream_error(upstream.status, content)
        return Response(content, status_code=200, media_type=media)


def _another(route: ModelRoute, failed: Backend) -> bool:
    return any(backend is not failed for backend in route.available()) or (route.front is not None and route.front is not failed)


async def _unless_disconnected(work: Coroutine[Any, Any, T], receive: Receive | None) -> tuple[bool, T | None]:
    """Run ``work`` unless the client disconnects first: ``(True, result)``, or ``(False, None)``.

    SGLang sends a plain answer's headers only when generation is done, so without this a client
    that gives up would leave the engine generating for nobody.
    """
    if receive is None:
        return True, await work
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_disconnect(receive))
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


