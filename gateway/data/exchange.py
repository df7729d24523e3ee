"""The second stage of a proxied request: the exchange with one replica (chosen by :func:`gateway.data.balancer.pick`),
sent once more to another when it failed before the client got a byte. A plain request whose client leaves
meanwhile is given up (its upstream request closed: the engine stops generating for nobody)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from starlette.types import Receive

from engine_guard.shapes import request_shape
from gateway.core.backends import Backend
from gateway.core.call import Call
from gateway.core.errors import GatewayError
from gateway.core.metrics import Metrics
from gateway.core.poison import Quarantine
from gateway.core.registry import ModelRoute
from gateway.data.balancer import pick
from gateway.data.lease import Lease
from gateway.data.relay import wait_disconnect
from gateway.data.upstream_errors import UPSTREAM_ERRORS, router_lost_its_worker, transport_error
from gateway.data.upstream_send import Answer, UpstreamSender
from gateway.edge.cycle import CancelOnLeave

T = TypeVar("T")


@dataclass(slots=True)
class Exchanged:
    """What the exchange came to: the backend that answered and its answer; no answer when the client left first."""

    backend: Backend
    payload: bytes  # the body as sent to it
    answer: Answer | None


async def exchange(call: Call, lease: Lease, sender: UpstreamSender, quarantine: Quarantine, metrics: Metrics) -> Exchanged:
    """Send ``call`` to a replica, and once more to another when the first failed before answering anything."""
    route, body = call.route, call.body
    retry_after_s = route.limiter.settings.retry_after_s
    failed: Backend | None = None
    while True:
        # chosen once per attempt: a swap mid-request must not split it across backends
        backend = _choose(call, failed, retry_after_s)
        lease.take(backend, metrics.in_flight_count(route.name))
        call.info.replica = backend.replica if len(route.replicas) > 1 and not backend.is_router else None
        body["model"] = backend.served_name if call.adapter is None else f"{backend.served_name}:{call.adapter}"
        if call.priority is not None and backend.schedules_by_priority:
            body["priority"] = call.priority
        path = call.endpoint.upstream_path
        payload = orjson.dumps(body)
        lease.request = (path, payload)
        lease.shape = request_shape(path, body)
        if quarantine:
            quarantine.check(route.name, lease.shape, lease.key)
        headers = {"Content-Type": "application/json", "X-Request-Id": call.info.request_id, **backend.upstream_headers()}
        headers.update(call.notes.attempt(backend.served_name, backend.url, call.info.replica))
        try:
            sending = sender.send(lease, backend, path, payload, headers, call.streamed)
            finished, answer = await _unless_disconnected(sending, None if call.streamed else call.receive, call.cycle)
        except UPSTREAM_ERRORS as error:
            call.notes.attempt_failed(error)
            lease.note_if_lost(error)
            lease.let_go()
            if call.pinned is None and failed is None and _another(route, backend):
                failed = backend  # nothing reached the client yet: once more, on another replica
                continue
            raise transport_error(error, route.name, retry_after_s) from None
        if finished and answer is not None and router_lost_its_worker(backend, *answer) and call.pinned is None and failed is None and _another(route, backend):
            lease.let_go()
            failed = backend  # the router could not reach its replica: once more, to a replica directly
            continue
        return Exchanged(backend, payload, answer if finished else None)


def _choose(call: Call, failed: Backend | None, retry_after_s: int) -> Backend:
    """The backend for this attempt, or GatewayError(503) naming why none can take it."""
    route = call.route
    backend = call.pinned if call.pinned is not None else pick(route, call.balancing, call.body, exclude=failed)
    if backend is not None and backend.unavailable_reason() is None:
        return backend
    down = backend or route.backend
    reason = down.unavailable_reason() or "no replica can take requests"
    retry = down.retry_after_s if down.failure is not None and down.retry_after_s else retry_after_s
    raise GatewayError(503, f"model {route.name!r} is unavailable: {reason}", code="engine_unavailable", headers={"Retry-After": str(retry)})


def _another(route: ModelRoute, failed: Backend) -> bool:
    return any(backend is not failed for backend in route.available()) or (route.front is not None and route.front is not failed)


async def _unless_disconnected(work: Coroutine[Any, Any, T], receive: Receive | None, cycle: Any = None) -> tuple[bool, T | None]:
    """Run ``work`` unless the client disconnects first: ``(True, result)``, or ``(False, None)``.

    SGLang sends a plain answer's headers only when generation is done, so without this a client
    that gives up would leave the engine generating for nobody. A stream needs no such watch: engines send a
    stream's headers at once, and :class:`gateway.data.relay.SSEProxyResponse` watches the client from then on.
    Under the gateway's own protocol its ``cycle`` says when the client leaves (:func:`_unless_gone`); elsewhere a
    task waits for ``receive()`` to say it, beside another running the work.
    """
    if receive is None:
        return True, await work
    if cycle is not None:
        return await _unless_gone(work, cycle)
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


async def _unless_gone(work: Coroutine[Any, Any, T], cycle: Any) -> tuple[bool, T | None]:
    """:func:`_unless_disconnected` told by the connection (:meth:`gateway.edge.cycle.GatewayCycle.on_disconnect`):
    the request's own task awaits the work and is cancelled if the client leaves, instead of two tasks made, run and
    collected per request (the work's and a watcher's)."""
    on_gone = CancelOnLeave()
    cycle.on_disconnect(on_gone)
    try:
        return True, await work
    except asyncio.CancelledError:
        if on_gone.was_the_cause():
            return False, None  # (what the work held is released by its own cleanup, as it unwound)
        raise
    finally:
        on_gone.done()
        cycle.on_disconnect(None)
