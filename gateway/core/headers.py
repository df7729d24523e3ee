"""A request's headers as one map, built once per request, that every layer looks its headers up in.

A client SDK sends 15-20 headers (OpenAI's Python SDK: its ``x-stainless-*`` set, the key, the length...). Each
layer that wanted one (the proxy headers, the request id, the body's length, the key, the priority class, the
answer-extensions choice) used to scan the whole list in Python: about 2,000 interpreter steps per request with
the SDK's headers, more than the request's guard and shape together. The gateway's HTTP protocol
(:mod:`gateway.edge.connection`) builds the map in C as the head completes; under another ASGI server the first
lookup builds it from the scope.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

HEADER_MAP = "gateway.headers"
"""Scope key of the map: header name (lower case) -> its first value, as received (a repeated header's later values
are only in ``scope["headers"]``)."""


def header_map(scope: MutableMapping[str, Any]) -> dict[bytes, bytes]:
    """The request's headers by name (lower case), first value each; built on first use and kept in the scope."""
    found = scope.get(HEADER_MAP)
    if found is None:  # (not under the gateway's protocol: names may come in any case)
        found = scope[HEADER_MAP] = {name.lower(): value for name, value in reversed(scope.get("headers", ()))}
    return found


def first_values(headers: list[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
    """The map of ``headers`` whose names are lower case already (uvicorn's): one C-level pass."""
    return dict(reversed(headers))


def header_text(scope: MutableMapping[str, Any], name: bytes) -> str | None:
    """One header's first value as text (latin-1, surrounding whitespace dropped); None when the request has none."""
    value = header_map(scope).get(name)
    return None if value is None else value.decode("latin-1").strip()
