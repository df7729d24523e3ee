"""The one adapter from batch lines into the data plane: a line is a request sent through the live request path.

:func:`line_chain` is the app's own middleware chain less the parts that read a client's connection: the request
context (log line, metrics, the usage ledger row, marked with the batch id), the per-key limits (a line reserves and is
charged like any request of its key), then the app's dispatch (the route's guard, the model's limiter and priority
queue, grammar slots, the quarantine, the replica choice, the engine). :class:`LineSender` builds each line's ASGI
request as the batch's key (no key travels: the tenant is looked up by the owner the batch recorded) at the batch
priority class, and collects the answer. Nothing else in :mod:`gateway.batches` knows the data plane's insides.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.config import MIN_CLASS, BatchSettings, class_number
from gateway.core.context import BATCH_SCOPE_KEY, request_info
from gateway.core.errors import GatewayError
from gateway.core.metrics import Metrics
from gateway.core.tracing import Tracing
from gateway.edge.auth import OPEN_OWNER, OWNER_SCOPE_KEY, KeyHolder
from gateway.edge.middleware import RequestContextMiddleware
from gateway.edge.quota import QuotaMiddleware
from gateway.tenants.keys import TENANT_SCOPE_KEY, Tenant
from gateway.tenants.ledger import Ledger
from gateway.tenants.priority import PRIORITY_SCOPE_KEY
from gateway.tenants.quotas import Quotas


def line_chain(
    dispatch: ASGIApp, *, metrics: Metrics, ledger: Ledger, quotas: Quotas, tracing: Tracing | None, log_requests: bool
) -> ASGIApp:
    """request context -> the line's key -> per-key limits -> ``dispatch`` (the app's innermost step)."""
    limited = QuotaMiddleware(dispatch, quotas=quotas)
    return RequestContextMiddleware(
        _KeyName(limited), metrics=metrics, log_requests=log_requests, record=True, ledger=ledger, tracing=tracing
    )


class _KeyName:
    """What the key check does for a live request once it found the tenant: the request's log and ledger row name it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tenant: Tenant | None = scope.get(TENANT_SCOPE_KEY)
        info = request_info(scope)
        if info is not None and tenant is not None:
            info.key_name = tenant.name
        await self.app(scope, receive, send)


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes


class LineSender:
    """Sends one batch line as its batch's key, at the batch class, through :func:`line_chain`."""

    def __init__(self, chain: ASGIApp, app: Any, keys: KeyHolder, settings: BatchSettings, classes: Mapping[str, int]) -> None:
        self.chain = chain
        self.app = app  # the ASGI app the proxied route handler reads its route table from (scope["app"])
        self.keys = keys
        self.settings = settings
        self.classes = classes

    def tenant(self, owner: str) -> Tenant | None:
        """The current tenant whose identity is ``owner`` (keys change on reload; a removed key finds none)."""
        return next((tenant for tenant in self.keys.policy.client.values() if tenant.owner == owner), None)

    def load(self, model: str) -> int | None:
        """Requests of ``model`` in flight or queued now, this process's and its workers' (batch lines included);
        None: no such model (any more)."""
        state = self.app.state.gateway
        route = state.registry.resolve(model)
        if route is None:
            return None
        return route.limiter.waiting + sum(state.in_flight(route.name, backend) for backend in route.replicas)

    def priority(self) -> int:
        """The batch class: ``batches.priority``, else one below every class configured (and below 0)."""
        if self.settings.priority is not None:
            number = class_number(self.settings.priority, self.classes)
            if number is not None:
                return number
        known = [0, *self.classes.values()]
        known += [tenant.priority for tenant in self.keys.policy.client.values() if tenant.priority is not None]
        return max(MIN_CLASS, min(known) - 1)

    async def send(self, path: str, body: bytes, owner: str, batch_id: str, request_id: str) -> Answer:
        """POST ``body`` to ``path`` as ``owner``; the answer's status and bytes (a refusal is an answer too)."""
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)), (b"x-request-id", request_id.encode())]
        scope: dict[str, Any] = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
            "client": ("batch", 0), "server": ("gateway", 0), "app": self.app, "extensions": {},
            BATCH_SCOPE_KEY: batch_id, PRIORITY_SCOPE_KEY: self.priority(),
        }  # fmt: skip
        if self.keys.policy.client:
            tenant = self.tenant(owner)
            if tenant is None:
                error = GatewayError(401, "the key that created this batch is no longer configured", code="invalid_api_key")
                return Answer(401, orjson.dumps(error.body()))
            scope[OWNER_SCOPE_KEY], scope[TENANT_SCOPE_KEY] = tenant.owner, tenant
        else:
            scope[OWNER_SCOPE_KEY] = OPEN_OWNER
        status = 500
        chunks: list[bytes] = []
        sent = False
        never = asyncio.Event()

        async def receive() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await never.wait()  # nobody disconnects: the line waits for its answer
            return {"type": "http.disconnect"}

        async def collect(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.chain(scope, receive, collect)
        return Answer(status, b"".join(chunks))

