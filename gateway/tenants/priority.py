"""Priority classes a request may ask for: the ``x-gateway-priority`` header, and who may send it.

A class is a number (-1000..1000, higher first), or a name ``gateway.priority_classes`` gives one. A named key
has its own class (``priority``) and may list others (``allowed_priorities``) that its holder picks per request
with the header: a batch job's key may send some requests at a lower class than its interactive ones. The header
is refused (403) for every key that lists none, plain keys and open gateways included: nothing would say which
classes such a caller may use, and honouring it would let every caller jump the queue; ignoring it would let a
client believe it got a class it did not. A class the key may not use is refused (403) and one that does not
exist too (400), each naming the allowed ones, so a misconfigured client finds out at its first request.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.config import class_number
from gateway.core.errors import GatewayError
from gateway.core.headers import header_text

PRIORITY_HEADER = "x-gateway-priority"
PRIORITY_SCOPE_KEY = "gateway.priority"  # a class the gateway itself gives a request (a batch line's), ahead of the header
_HEADER_NAME = PRIORITY_HEADER.encode()


@dataclass(frozen=True)
class PriorityChoice:
    """The classes the holder of one named key may ask for with the header (its own class among them)."""

    numbers: frozenset[int]  # the allowed classes
    labels: tuple[str, ...]  # the same as the config names them, for the refusal message
    classes: Mapping[str, int] = field(compare=False)  # gateway.priority_classes: the names the header may use

    @classmethod
    def of(cls, own: int | str | None, allowed: Iterable[int | str], classes: Mapping[str, int]) -> PriorityChoice:
        """``own`` and ``allowed`` as the config gives them (checked already: each is a number or a known name)."""
        labels = tuple(dict.fromkeys(str(value) for value in (*([own] if own is not None else []), *allowed)))
        numbers = {class_number(label, classes) for label in labels}
        assert None not in numbers, f"a priority class of {labels} was not checked"
        return cls(frozenset(number for number in numbers if number is not None), labels, dict(classes))


class KeyHolder(Protocol):
    """What the class of a request needs of its caller: a :class:`gateway.tenants.keys.Tenant` (which imports this
    module, so it is named by its shape here)."""

    @property
    def name(self) -> str | None: ...
    @property
    def priority(self) -> int | None: ...
    @property
    def priorities(self) -> PriorityChoice | None: ...


def asked_priority(key: str | None, choice: PriorityChoice | None, asked: str, *, keyed: bool = True) -> int:
    """The class a request asks for with the header, or GatewayError naming the header, the class and the allowed ones.

    ``key``: the named key's name (None: a plain key); ``keyed``: False on a gateway without client keys."""
    if choice is None:
        if not keyed:
            who = "this gateway has no client keys"
        elif key is None:
            who = "this key is a plain api_keys entry"
        else:
            who = f"key {key!r} has no allowed_priorities"
        raise GatewayError(
            403, f"{PRIORITY_HEADER}: only a named key with allowed_priorities may choose its priority class ({who})",
            code="priority_not_allowed",
        )  # fmt: skip
    number = class_number(asked, choice.classes)
    allowed = ", ".join(choice.labels)
    if number is None:
        named = f" (classes named in gateway.priority_classes: {', '.join(choice.classes)})" if choice.classes else ""
        raise GatewayError(
            400, f"{PRIORITY_HEADER}: {asked!r} is no priority class{named}; key {key!r} may use: {allowed}", code="unknown_priority"
        )
    if number not in choice.numbers:
        raise GatewayError(
            403, f"{PRIORITY_HEADER}: key {key!r} may not use priority class {asked!r}; it may use: {allowed}", code="priority_not_allowed"
        )
    return number


def request_priority(scope: MutableMapping[str, Any], tenant: KeyHolder | None) -> int | None:
    """A request's priority class: the one its header picks (refused as :func:`asked_priority` says), else its key's
    (None: none). ``tenant``: the caller's (None: a gateway without client keys). A class set in the scope by the
    gateway (:data:`PRIORITY_SCOPE_KEY`: a batch line's) wins: no client sends it."""
    given = scope.get(PRIORITY_SCOPE_KEY)
    if given is not None:
        return int(given)
    asked = header_text(scope, _HEADER_NAME)
    if not asked:
        return tenant.priority if tenant is not None else None
    if tenant is None:
        return asked_priority(None, None, asked, keyed=False)
    return asked_priority(tenant.name, tenant.priorities, asked)
