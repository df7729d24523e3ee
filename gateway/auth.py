"""API-key check as pure ASGI middleware, in front of every route but the configured open ones.

Keys come as ``Authorization: Bearer <key>``; on Anthropic's routes (``/v1/messages...``) also as
``x-api-key: <key>``, which is what Anthropic clients send. Refusals are in the route's dialect.

Client routes take the client keys; ``/admin/...`` takes only the admin keys (a separate set, so a
leaked client key cannot swap models), and is off (403) when no admin key is configured. Keys are
compared with ``hmac.compare_digest`` against every configured key (no early exit), and never
logged. With no client keys the client routes are open. The keys live in a :class:`KeyPolicy` that
a config reload replaces in one assignment.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.endpoints import dialect_for_path
from gateway.errors import Dialect, GatewayError, error_response

ADMIN_PREFIX = "/admin/"


@dataclass(frozen=True)
class KeyPolicy:
    """Who may call what: client keys, admin keys and the paths open to everyone."""

    client: tuple[bytes, ...] = ()
    admin: tuple[bytes, ...] = ()
    open_paths: frozenset[str] = frozenset()


class KeyHolder:
    """The current :class:`KeyPolicy`; swapped whole on reload."""

    def __init__(self, policy: KeyPolicy) -> None:
        self.policy = policy


class AuthMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        keys: Iterable[bytes] = (),
        open_paths: Iterable[str] = (),
        *,
        holder: KeyHolder | None = None,
    ) -> None:
        self.app = app
        self.holder = holder or KeyHolder(KeyPolicy(tuple(keys), (), frozenset(open_paths)))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        policy = self.holder.policy
        path = scope["path"]
        admin = path.startswith(ADMIN_PREFIX) or path == ADMIN_PREFIX.rstrip("/")
        if admin and not policy.admin:
            message = "the admin API is off: configure gateway.admin_keys (or admin_keys_env / admin_keys_file)"
            await error_response(GatewayError(403, message, code="admin_api_disabled"))(scope, receive, send)
            return
        keys = policy.admin if admin else policy.client
        if not admin and (not keys or path in policy.open_paths):
            await self.app(scope, receive, send)
            return
        dialect = dialect_for_path(path)
        presented = _bearer(scope)
        if presented is None and dialect is Dialect.ANTHROPIC:
            presented = _header(scope, b"x-api-key")
        if presented is None:
            how = "'x-api-key: <key>' or 'Authorization: Bearer <key>'" if dialect is Dialect.ANTHROPIC else "'Authorization: Bearer <key>'"
            error = GatewayError(401, f"missing API key: send {how}", code="missing_api_key")
        elif not _valid(presented, keys):
            error = GatewayError(401, "invalid admin key" if admin else "invalid API key", code="invalid_api_key")
        else:
            await self.app(scope, receive, send)
            return
        error.headers["WWW-Authenticate"] = "Bearer"
        await error_response(error, dialect)(scope, receive, send)


def _valid(presented: bytes, keys: tuple[bytes, ...]) -> bool:
    ok = False
    for key in keys:
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


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.strip() or None
    return None


def key_policy(client: tuple[bytes, ...], admin: tuple[bytes, ...], open_paths: Iterable[str]) -> KeyPolicy:
    return KeyPolicy(client, admin, frozenset(open_paths))
