"""Bearer API-key check as pure ASGI middleware, in front of every route but the configured open ones.

Keys are compared with ``hmac.compare_digest`` against every configured key (no early exit), and
never logged. With no keys configured the gateway is open.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import GatewayError, error_response


class AuthMiddleware:
    def __init__(self, app: ASGIApp, keys: Iterable[bytes], open_paths: Iterable[str] = ()) -> None:
        self.app = app
        self.keys = tuple(keys)
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        presented = _bearer(scope)
        if presented is None:
            error = GatewayError(401, "missing API key: send 'Authorization: Bearer <key>'", code="missing_api_key")
        elif not self._valid(presented):
            error = GatewayError(401, "invalid API key", code="invalid_api_key")
        else:
            await self.app(scope, receive, send)
            return
        error.headers["WWW-Authenticate"] = "Bearer"
        await error_response(error)(scope, receive, send)

    def _valid(self, presented: bytes) -> bool:
        ok = False
        for key in self.keys:
            ok |= hmac.compare_digest(presented, key)
        return ok


def _bearer(scope: Scope) -> bytes | None:
    for name, value in scope.get("headers", []):
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None
