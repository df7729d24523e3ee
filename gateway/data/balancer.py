"""Which replica of a model takes a request: the least busy one, or the one that holds its prompt's prefix.

``least_in_flight``: the available replica with the fewest requests in flight (ties: the lowest replica).

``prefix_affinity``: requests whose conversations share everything but their last message (the same
system prompt and earlier turns; for a completion, the first ``prefix_chars`` of its prompt) go to the
same replica, chosen by rendezvous hashing over the replica numbers, so that SGLang's radix cache serves
that prefix from memory instead of computing it again on every replica. A replica never gets more than
``max_imbalance`` requests in flight above the least busy one for the sake of affinity: then the least
busy one takes the request. A replica that leaves (dies, is drained) moves only its own prefixes.

Only replicas that can take requests are chosen (healthy, not being replaced); ``exclude`` lets a retry
avoid the replica that just failed. A model with SGLang's router in front (``router:``) leaves the choice to it.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from gateway.config import BalancingSettings
from gateway.core.backends import Backend
from gateway.core.registry import ModelRoute

# body fields that make up a request's shared prefix, by API: the leading part, then the conversation
_LEADING = ("system", "instructions")
_CONVERSATION = ("messages", "input", "prompt")


def pick(route: ModelRoute, settings: BalancingSettings, body: dict[str, Any], exclude: Backend | None = None) -> Backend | None:
    """The replica that should take ``body`` (None: no replica can take requests now). A model with SGLang's
    router in front sends everything to the router, and to its replicas directly only while the router is down."""
    front = route.front
    if front is not None and front is not exclude and front.unavailable_reason() is None:
        return front
    candidates = [backend for backend in route.available() if backend is not exclude]
    if len(candidates) <= 1:
        return candidates[0] if candidates else None
    least = min(candidates, key=lambda backend: (backend.in_flight, backend.replica))
    if settings.policy == "prefix_affinity":
        key = prefix_key(body, settings.prefix_chars)
        if key:
            preferred = max(candidates, key=lambda backend: _weight(key, backend.replica))
            if preferred.in_flight - least.in_flight <= settings.max_imbalance:
                return preferred
    return least


def prefix_key(body: dict[str, Any], prefix_chars: int) -> bytes:
    """The part of a request that later requests of the same conversation (or system prompt) repeat."""
    parts: list[Any] = [body[name] for name in _LEADING if body.get(name)]
    for name in _CONVERSATION:
        value = body.get(name)
        if isinstance(value, list) and value and isinstance(value[0], dict):
            parts.append(value[:-1])  # every message but the last one
            break
        if isinstance(value, str):
            parts.append(value[:prefix_chars])
            break
        if isinstance(value, list) and value:  # token ids (or a batch): their beginning
            parts.append(value[:prefix_chars])
            break
    if not any(parts):
        return b""
    return orjson.dumps(parts)[: prefix_chars * 4]


def _weight(key: bytes, replica: int) -> int:
    return int.from_bytes(hashlib.blake2b(key + replica.to_bytes(2, "big"), digest_size=8).digest(), "big")
