"""What a failure talking to an engine (or SGLang's router) means for the client: the status and code it gets."""

from __future__ import annotations

import errno
import resource

import aiohttp

from gateway.core.backends import Backend
from gateway.core.errors import GatewayError
from gateway.data.stream_pool import (
    UpstreamConnectTimeout,
    UpstreamPoolFull,
    UpstreamUnreachable,
)


def transport_error(error: BaseException, backend: str, retry_after_s: int = 1) -> GatewayError:
    """Map a failure talking to ``backend`` to 503 (unreachable / connection lost / the gateway's own
    connection cap reached) or 504 (the engine timed out)."""
    retry = {"Retry-After": str(retry_after_s)}
    if out_of_descriptors(error):
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        message = f"the gateway has run out of file descriptors (its own open-file limit, {soft}): not the engine of {backend}; retry later"
        return GatewayError(503, message, code="gateway_out_of_descriptors", headers=retry)
    if isinstance(error, UpstreamPoolFull):
        return GatewayError(503, f"the gateway is at its cap of connections to the engines: {error}; retry later", code="upstream_pool_full", headers=retry)
    if isinstance(error, (aiohttp.ConnectionTimeoutError, UpstreamConnectTimeout)):
        return GatewayError(504, f"timed out connecting to the engine of {backend}", code="upstream_timeout")
    if isinstance(error, TimeoutError):  # aiohttp's ServerTimeoutError (sock_read) is one too
        return GatewayError(504, f"timed out waiting for the engine of {backend}", code="upstream_timeout")
    if isinstance(error, (aiohttp.ClientConnectorError, UpstreamUnreachable)):
        return GatewayError(503, f"the engine of {backend} is unreachable", code="engine_unavailable", headers=retry)
    return GatewayError(503, f"lost the connection to the engine of {backend}", code="engine_unavailable", headers=retry)


def out_of_descriptors(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it, at any depth) is this process running out of file descriptors."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in (errno.EMFILE, errno.ENFILE):
            return True
        pending += [current.__cause__, current.__context__, getattr(current, "os_error", None)]
    return False


# What a failed upstream exchange can raise: aiohttp's errors, its timeouts, and OS errors under them.
UPSTREAM_ERRORS = (aiohttp.ClientError, TimeoutError, OSError)


# What SGLang's router (0.3.x) answers, with a 5xx, when the worker it chose did not take or answer the request.
_ROUTER_WORKER_LOST = (b"error sending request", b"connection closed", b"Failed to send request", b"No available workers")


def router_lost_its_worker(backend: Backend, upstream: aiohttp.ClientResponse, content: bytes | None) -> bool:
    """A router's 5xx that means its worker was unreachable or died under the request: nothing reached the
    client, and another replica can answer (the router's own retries pick the same worker again)."""
    return backend.is_router and upstream.status >= 500 and any(marker in (content or b"") for marker in _ROUTER_WORKER_LOST)
