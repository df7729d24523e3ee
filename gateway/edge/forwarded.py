"""uvicorn's ``X-Forwarded-For`` / ``X-Forwarded-Proto`` handling, asked only of a request that carries one.

uvicorn's middleware scans every header of every request from a trusted proxy (the loopback by default) for the
two, in Python: ~15 interpreter steps per header, for a client SDK's 15-20 headers. Most requests carry neither:
two lookups in the request's header map (:mod:`gateway.core.headers`) say so, and only a request that carries one
goes through uvicorn's own code, which decides what it means (its trusted hosts, its parsing).
"""

from __future__ import annotations

from collections.abc import Awaitable

from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from gateway.core.headers import header_map


class ForwardedHeaders(ProxyHeadersMiddleware):
    """uvicorn's middleware, skipped for a request with neither header (put in its place by the gateway's server)."""

    def __call__(self, scope, receive, send) -> Awaitable[None]:  # type: ignore[no-untyped-def,override]
        if scope["type"] == "http":
            headers = header_map(scope)
            if b"x-forwarded-for" not in headers and b"x-forwarded-proto" not in headers:
                return self.app(scope, receive, send)
        return super().__call__(scope, receive, send)
