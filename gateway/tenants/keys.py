"""Client keys as tenants: who a request's key belongs to, which models it may use, and its limits.

Every client key (a plain ``api_keys`` entry or a named ``keys`` entry) is looked up by the SHA-256 of the key
presented: a dict lookup whose time says nothing about any configured key, and the same path whether the YAML
gives the key or only its hash (a keys file for many tenants holds hashes). A plain key is an unnamed tenant
without limits, as before named keys existed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

from gateway.config import FILE_LIMITS, GatewaySettings, KeyLimits, NamedKey, class_number
from gateway.tenants.priority import PriorityChoice

TENANT_SCOPE_KEY = "gateway.tenant"
UNNAMED = "unnamed"  # the metrics label of plain api_keys (and of an open gateway)


def key_owner(key: bytes) -> str:
    """The stable identity of a plain client key: what the response index stores as a response's owner.

    A keyed hash (BLAKE2b, personalised for this use), not the key: the state directory must not hold
    usable keys. Stable across restarts and reloads (a key kept in the config keeps its responses; a
    rotated key starts afresh), with no secret of its own to persist: API keys are long random strings,
    so their hashes cannot be reversed by guessing (an HMAC secret would sit in the same directory anyway).
    """
    return "key:" + hashlib.blake2b(key, digest_size=16, person=b"gw-resp-owner").hexdigest()


@dataclass(frozen=True)
class Tenant:
    """The holder of one client key."""

    name: str | None  # None: a plain api_keys entry
    owner: str  # who owns the responses it stores: "tenant:<name>" (kept when its key rotates) or key_owner(key)
    models: frozenset[str] | None = None  # names and aliases it may use (None: all)
    limits: KeyLimits = field(default_factory=KeyLimits)
    priority: int | None = None  # its class: the model's queue serves higher first; sent upstream when the engine schedules by it
    priorities: PriorityChoice | None = None  # the classes the x-gateway-priority header may pick (None: the header is refused)

    @property
    def label(self) -> str:
        return self.name or UNNAMED

    @cached_property
    def limited(self) -> bool:
        """Whether any request limit is set (read on every request: computed once, the tenant is immutable); the
        batch files' quotas are the batch API's, not the requests'."""
        return self.limits.model_dump(exclude=FILE_LIMITS) != KeyLimits().model_dump(exclude=FILE_LIMITS)

    def may_use(self, names: Iterable[str]) -> bool:
        """Whether the model known by ``names`` (its name and aliases) is one this key may use."""
        return self.models is None or not self.models.isdisjoint(names)


def tenant_table(
    plain: Iterable[bytes], named: Iterable[tuple[NamedKey, bytes]] = (), classes: Mapping[str, int] | None = None
) -> Mapping[bytes, Tenant]:
    """SHA-256 of each client key -> its tenant. ``named``: (NamedKey, digest) as the settings resolve them, their
    priority classes checked against ``classes`` (``gateway.priority_classes``) already."""
    classes = classes or {}
    table: dict[bytes, Tenant] = {hashlib.sha256(key).digest(): Tenant(None, key_owner(key)) for key in plain}
    for entry, digest in named:
        models = frozenset(entry.models) if entry.models is not None else None
        priority = class_number(entry.priority, classes) if entry.priority is not None else None
        choice = PriorityChoice.of(entry.priority, entry.allowed_priorities, classes) if entry.allowed_priorities else None
        table[digest] = Tenant(entry.name, f"tenant:{entry.name}", models, entry.limits, priority, choice)
    return table


def tenants_of(settings: GatewaySettings, source: str = "config") -> Mapping[bytes, Tenant]:
    """The tenants of ``settings``' client keys (plain and named)."""
    return tenant_table(settings.resolved_keys(source), settings.resolved_named_keys(source), settings.priority_classes)


def limited_keys(tenants: Iterable[Tenant]) -> dict[str, KeyLimits]:
    """Name -> limits of the named keys that have limits (what worker processes must count together)."""
    return {tenant.name: tenant.limits for tenant in tenants if tenant.name is not None and tenant.limited}


def digest_of(presented: bytes) -> bytes:
    return hashlib.sha256(presented).digest()
