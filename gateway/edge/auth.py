"""API-key check as pure ASGI middleware, in front of every route but the configured open ones.

Keys come as ``Authorization: Bearer <key>``; on Anthropic's routes (``/v1/messages...``) also as
``x-api-key: <key>``, which is what Anthropic clients send. Refusals are in the route's dialect.

Client routes take the client keys; ``/admin/...`` takes only the admin keys (a separate set, so a
leaked client key cannot swap models), and is off (403) when no admin key is configured. A client key is
found by the SHA-256 of the key presented (:mod:`gateway.tenants.keys`); admin keys are compared with
``hmac.compare_digest`` against every configured one (no early exit). Keys are never logged. With no
client keys the client routes are open. The keys live in a :class:`KeyPolicy` that a config reload
replaces in one assignment.

A client route learns *which* tenant called, never the key: ``scope[TENANT_SCOPE_KEY]`` is its
:class:`~gateway.tenants.keys.Tenant` (models, limits), ``scope[OWNER_SCOPE_KEY]`` the identity that owns the
stored responses the request creates (:mod:`gateway.core.responses_index`). An open gateway has one shared
owner, :data:`OPEN_OWNER`.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.config import KeyLimits
from gateway.core.context import request_info
from gateway.core.endpoints import dialect_for_path, is_status_page
from gateway.core.errors import Dialect, GatewayError, error_response
from gateway.core.headers import header_map
from gateway.tenants.keys import TENANT_SCOPE_KEY, Tenant, digest_of, key_owner, limited_keys, tenant_table

__all__ = ["OPEN_OWNER", "OWNER_SCOPE_KEY", "TENANT_SCOPE_KEY", "AuthMiddleware", "KeyHolder", "KeyPolicy", "key_owner", "key_policy"]

ADMIN_PREFIX = "/admin/"
METRICS_PATH = "/metrics"  # a client key reads only its own part of it; the admin and metrics keys all of it
OWNER_SCOPE_KEY = "gateway.owner"
OPEN_OWNER = "open"  # every client of a gateway without client keys is the same principal


def request_owner(scope: dict[str, Any]) -> str:
    """Who is calling, as :func:`key_owner` names it (set by :class:`AuthMiddleware`; open: :data:`OPEN_OWNER`)."""
    return scope.get(OWNER_SCOPE_KEY, OPEN_OWNER)


@dataclass(frozen=True)
class KeyPolicy:
    """Who may call what: client keys (SHA-256 -> tenant), admin keys and the paths open to everyone."""

    client: Mapping[bytes, Tenant] = field(default_factory=dict)  # a dict: the policy travels to worker processes (pickle)
    admin: tuple[bytes, ...] = ()
    open_paths: frozenset[str] = frozenset()
    metrics: tuple[bytes, ...] = ()  # gateway.metrics_key: reads all of /metrics (as the admin keys do), nothing else
    # name -> limits of the named keys with limits (what worker processes count together), derived once
    limited: dict[str, KeyLimits] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # plain keys given as such (tests, embedders) become their table
        table = self.client if isinstance(self.client, Mapping) else tenant_table(self.client)
        object.__setattr__(self, "client", dict(table))
        object.__setattr__(self, "limited", limited_keys(table.values()))


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

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        """The awaitable of the next step (a request let through: no coroutine of its own around it, which each of
        the request's awaits would resume) or of the refusal: every check here is decided without waiting."""
        if scope["type"] != "http":
            return self.app(scope, receive, send)
        policy = self.holder.policy
        path = scope["path"]
        admin = path.startswith(ADMIN_PREFIX) or path == ADMIN_PREFIX.rstrip("/")
        if admin and not policy.admin:
            message = "the admin API is off: configure gateway.admin_keys (or admin_keys_env / admin_keys_file)"
            return error_response(GatewayError(403, message, code="admin_api_disabled"))(scope, receive, send)
        if path == METRICS_PATH and policy.client and path not in policy.open_paths:
            presented = _bearer(scope)
            if presented is not None and _matching(presented, policy.admin + policy.metrics) >= 0:
                return self.app(scope, receive, send)  # no tenant in the scope: the whole scrape
        if not admin and (not policy.client or path in policy.open_paths or is_status_page(path)):
            if not policy.client:
                scope[OWNER_SCOPE_KEY] = OPEN_OWNER
            return self.app(scope, receive, send)
        dialect = dialect_for_path(path)
        presented = _bearer(scope)
        if presented is None and dialect is Dialect.ANTHROPIC:
            presented = _header(scope, b"x-api-key")
        if presented is None:
            how = "'x-api-key: <key>' or 'Authorization: Bearer <key>'" if dialect is Dialect.ANTHROPIC else "'Authorization: Bearer <key>'"
            error = GatewayError(401, f"missing API key: send {how}", code="missing_api_key")
        elif admin:
            if _matching(presented, policy.admin) >= 0:
                return self.app(scope, receive, send)
            error = GatewayError(401, "invalid admin key", code="invalid_api_key")
        elif (tenant := policy.client.get(digest_of(presented))) is not None:
            scope[OWNER_SCOPE_KEY], scope[TENANT_SCOPE_KEY] = tenant.owner, tenant
            info = request_info(scope)
            if info is not None:
                info.key_name = tenant.name
            return self.app(scope, receive, send)
        else:
            error = GatewayError(401, "invalid API key", code="invalid_api_key")
        error.headers["WWW-Authenticate"] = "Bearer"
        return error_response(error, dialect)(scope, receive, send)


def _matching(presented: bytes, keys: tuple[bytes, ...]) -> int:
    """The index of the key equal to ``presented`` (-1: none), comparing with every key (no early exit)."""
    found = -1
    for index, key in enumerate(keys):
        if hmac.compare_digest(presented, key):
            found = index
    return found


def _bearer(scope: Scope) -> bytes | None:
    value = header_map(scope).get(b"authorization")
    if value is None:
        return None
    scheme, _, token = value.strip().partition(b" ")
    if scheme.lower() == b"bearer" and token.strip():
        return token.strip()
    return None


def _header(scope: Scope, name: bytes) -> bytes | None:
    value = header_map(scope).get(name)
    return None if value is None else value.strip() or None


def key_policy(
    client: tuple[bytes, ...] | Mapping[bytes, Tenant], admin: tuple[bytes, ...], open_paths: Iterable[str], metrics: tuple[bytes, ...] = ()
) -> KeyPolicy:
    """``client``: plain keys, or the tenant table of plain and named keys (:func:`gateway.tenants.keys.tenants_of`)."""
    return KeyPolicy(client, admin, frozenset(open_paths), metrics)  # type: ignore[arg-type]
