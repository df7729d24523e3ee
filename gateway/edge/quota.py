"""Per-key limits at the door: a named key over one of its limits gets 429 in the route's dialect, before any
route runs, with ``Retry-After`` and the rate-limit headers its SDK reads; every answer to a limited key carries
those headers (OpenAI's ``x-ratelimit-*``, Anthropic's ``anthropic-ratelimit-*`` on ``/v1/messages``).

Runs right after the key check (it needs the tenant) and charges the request's tokens when it ends, from the
usage the relay or the plain answer recorded on the request's :class:`~gateway.core.context.RequestInfo`.

A key's calls on its own batches and files (:func:`~gateway.core.endpoints.is_batch_management`) generate nothing:
they spend none of its generation limits, so a key over its budget or rate still reaches the results it paid for and
can cancel what runs. They have a modest limit of their own instead (:data:`MANAGEMENT_PER_MINUTE` per key and
process), which keeps a polling loop from hammering the store.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Awaitable, Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.core.context import RequestInfo, request_info
from gateway.core.endpoints import dialect_for_path, is_batch_management
from gateway.core.errors import Dialect, GatewayError, error_response
from gateway.tenants.keys import TENANT_SCOPE_KEY, Tenant
from gateway.tenants.quotas import Bucket, KeyQuota, Quotas, Refusal

MANAGEMENT_PER_MINUTE = 300  # a limited key's calls on its batches and files, per process (a bucket: 5 a second, 300 at once)


class QuotaMiddleware:
    def __init__(self, app: ASGIApp, quotas: Quotas) -> None:
        self.app = app
        self.quotas = quotas
        self._management: dict[str, Bucket] = {}  # key name -> its bucket of batch and file calls

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        """A key without limits is handed on as it is (the next step's awaitable, no coroutine of its own around it)."""
        tenant: Tenant | None = scope.get(TENANT_SCOPE_KEY) if scope["type"] == "http" else None
        if tenant is None or tenant.name is None or not tenant.limited:
            return self.app(scope, receive, send)
        return self._limited(tenant, scope, receive, send)

    async def _limited(self, tenant: Tenant, scope: Scope, receive: Receive, send: Send) -> None:
        if is_batch_management(scope["path"]):
            await self._management_call(tenant.name, scope, receive, send)
            return
        quota = self.quotas.of(tenant.name, tenant.limits)
        now = self.quotas.clock()
        dialect = dialect_for_path(scope["path"])
        refusal = quota.admit(now)
        if refusal is not None:
            error = _refused(tenant.name, refusal, quota, now, dialect)
            info = request_info(scope)
            if info is not None:
                info.error = info.error_code = refusal.code
            await error_response(error, dialect)(scope, receive, send)
            return
        extra = rate_limit_headers(quota, now, dialect)
        info = request_info(scope)
        if info is not None:
            info.reserve = _reserver(self.quotas, quota, tenant.name, info, dialect)
        if info is not None:  # the request-id layer writes them into the response start it rewrites anyway
            info.extra_headers = extra
            inner_send = send
        else:  # no request-id layer around this one (an embedder's stack): add them here

            async def inner_send(message: Message) -> None:
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", []), *extra]}
                await send(message)

        try:
            await self.app(scope, receive, inner_send)
        finally:
            used = ((info.prompt_tokens or 0) + (info.completion_tokens or 0)) if info is not None else 0
            quota.finish(used, self.quotas.clock(), info.reserved if info is not None else 0)


    async def _management_call(self, name: str, scope: Scope, receive: Receive, send: Send) -> None:
        """A call on the key's batches or files: its own bucket, none of the generation limits."""
        now = self.quotas.clock()
        bucket = self._management.get(name)
        if bucket is None:
            bucket = self._management[name] = Bucket(MANAGEMENT_PER_MINUTE, at=now)
        bucket.refill(now)
        if bucket.level < 1:
            retry = max(1, math.ceil(bucket.wait_s()))
            error = GatewayError(
                429, f"key {name!r}: rate limit reached: {MANAGEMENT_PER_MINUTE} batch and file calls per minute; retry in {retry}s",
                code="rate_limit_exceeded", headers={"Retry-After": str(retry)},
            )  # fmt: skip
            info = request_info(scope)
            if info is not None:
                info.error = info.error_code = "rate_limit_exceeded"
            await error_response(error, dialect_for_path(scope["path"]))(scope, receive, send)
            return
        bucket.level -= 1
        await self.app(scope, receive, send)


def _refused(name: str, refusal: Refusal, quota: KeyQuota, now: float, dialect: Dialect) -> GatewayError:
    """The 429 for ``refusal``, with the headers that say when to retry."""
    retry = max(1, math.ceil(refusal.retry_after_s))
    headers = {"Retry-After": str(retry), "retry-after-ms": str(max(1, math.ceil(refusal.retry_after_s * 1000)))}
    headers.update((k.decode(), v.decode()) for k, v in rate_limit_headers(quota, now, dialect))
    return GatewayError(429, f"key {name!r}: {refusal.message}; retry in {retry}s", code=refusal.code, headers=headers)


def _reserver(quotas: Quotas, quota: KeyQuota, name: str, info: RequestInfo, dialect: Dialect) -> Callable[[int], None]:
    """What the route calls once it knows what the request may cost (:meth:`KeyQuota.reserve`): held until the end."""

    def reserve(tokens: int) -> None:
        now = quotas.clock()
        refusal = quota.reserve(tokens, now)
        if refusal is not None:
            raise _refused(name, refusal, quota, now, dialect)
        info.reserved += tokens

    return reserve


def _names(template: str) -> dict[str, tuple[bytes, bytes, bytes]]:
    return {what: tuple(name.format(what=what).encode() for name in template.split()) for what in ("requests", "tokens")}


# (limit, remaining, reset) header names per limit, encoded once: the headers go on every answer to a limited key
_OPENAI_NAMES = _names("x-ratelimit-limit-{what} x-ratelimit-remaining-{what} x-ratelimit-reset-{what}")
_ANTHROPIC_NAMES = _names("anthropic-ratelimit-{what}-limit anthropic-ratelimit-{what}-remaining anthropic-ratelimit-{what}-reset")


def rate_limit_headers(quota: KeyQuota, now: float, dialect: Dialect) -> list[tuple[bytes, bytes]]:
    """The headers that tell a client where its key stands (only for the limits it has). Every answer to a limited
    key carries them, so the limits are encoded once per bucket (:attr:`Bucket.capacity_text`)."""
    anthropic = dialect is Dialect.ANTHROPIC
    names = _ANTHROPIC_NAMES if anthropic else _OPENAI_NAMES
    headers: list[tuple[bytes, bytes]] = []
    for what, bucket in (("requests", quota.requests), ("tokens", quota.tokens)):
        if bucket is None:
            continue
        reset_s = bucket.full_in_s()
        if anthropic:
            reset = dt.datetime.fromtimestamp(now + reset_s, dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")
        else:
            reset = duration(reset_s)
        limit_name, remaining_name, reset_name = names[what]
        headers += [(limit_name, bucket.capacity_text), (remaining_name, b"%d" % bucket.remaining), (reset_name, reset.encode())]
    return headers


def duration(seconds: float) -> str:
    """A reset time as OpenAI writes it: ``250ms``, ``1.5s``, ``6m0s``."""
    if seconds <= 0:  # a full bucket: what most answers say
        return "0ms"
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60:
        return f"{math.ceil(seconds * 10) / 10:g}s"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s"
