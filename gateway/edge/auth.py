"""API-key check as pure ASGI middleware, in front of every route but the configured open ones.

Keys come as ``Authorization: Bearer <key>``; on Anthropic's routes (``/v1/messages...``) also as
``x-api-key: <key>``, which is what Anthropic clients send. Refusals are in the route's dialect.

Client routes take the client keys; ``/admin/...`` takes only the admin keys (a separate set, so a
leaked client key cannot swap models), and is off (403) when no admin key is configured. Keys are
compared with ``hmac.compare_digest`` against every configured key (no early exit), and never
logged. With no client keys the client routes are open. The keys live in a :class:`KeyPolicy` that
a config reload replaces in one assignment.

A client route learns *which* key matched, never the key: ``scope[OWNER_SCOPE_KEY]`` is the key's
:func:`key_owner` identity (computed once per policy, not per request), which owns the stored responses
the request creates (:mod:`gateway.core.responses_index`). An open gateway has one shared owner, :data:`OPEN_OWNER`.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.core.endpoints import dialect_for_path
from gateway.core.errors import Dialect, GatewayError, error_response

ADMIN_PREFIX = "/admin/"
OWNER_SCOPE_KEY = "gateway.owner"
OPEN_OWNER = "open"  # every client of a gateway without client keys is the same principal


def key_owner(key: bytes) -> str:
    """The stable identity of a client key: what the response index stores as a response's owner.

    A keyed hash (BLAKE2b, personalised for this use), not the key: the state directory must not hold
    usable keys. Stable across restarts and reloads (a key kept in the config keeps its responses; a
    rotated key starts afresh), with no secret of its own to persist: API keys are long random strings,
    so their hashes cannot be reversed by guessing (an HMAC secret would sit in the same directory anyway).
    """
    return "key:" + hashlib.blake2b(key, digest_size=16, person=b"gw-resp-owner").hexdigest()


def request_owner(scope: dict[str, Any]) -> str:
    """Who is calling, as :func:`key_owner` names it (set by :class:`AuthMiddleware`; open: :data:`OPEN_OWNER`)."""
    return scope.get(OWNER_SCOPE_KEY, OPEN_OWNER)


@dataclass(frozen=True)
class KeyPolicy:
    """Who may call what: client keys, admin keys and the paths open to everyone."""

    client: tuple[bytes, ...] = ()
    admin: tuple[bytes, ...] = ()
    open_paths: frozenset[str] = frozenset()
    owners: tuple[str, ...] = field(init=False, repr=False, compare=False)  # key_owner of each client key, in order

    def __post_init__(self) -> None:
        object.__setattr__(self, "owners", tuple(key_owner(key) for key in self.client))


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
            if not keys:
                scope[OWNER_SCOPE_KEY] = OPEN_OWNER
            await self.app(scope, receive, send)
            return
        dialect = dialect_for_path(path)
        presented = _bearer(scope)
        if presented is None and dialect is Dialect.ANTHROPIC:
            presented = _header(scope, b"x-api-key")
        if presented is None:
            how = "'x-api-key: <key>' or 'Authorization: Bearer <key>'" if dialect is Dialect.ANTHROPIC else "'Authorization: Bearer <key>'"
            error = GatewayError(401, f"missing API key: send {how}", code="missing_api_key")
        elif (matched := _matching(presented, keys)) < 0:
            error = GatewayError(401, "invalid admin key" if admin else "invalid API key", code="invalid_api_key")
        else:
            if not admin:
                scope[OWNER_SCOPE_KEY] = policy.owners[matched]
            await self.app(scope, receive, send)
            return
        error.headers["WWW-Authenticate"] = "Bearer"
        await error_response(error, dialect)(scope, receive, send)


def _matching(presented: bytes, keys: tuple[bytes, ...]) -> int:
    """The index of the key equal to ``presented`` (-1: none), comparing with every key (no early exit)."""
    found = -1
    for index, key in enumerate(keys):
        if hmac.compare_digest(presented, key):
            found = index
    return found


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
