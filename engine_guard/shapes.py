"""A request's *shape*: what it is made of (route, fields, types and size classes), not its bytes.

A request that crashed or froze an engine is refused afterwards by its shape (the gateway's quarantine,
:mod:`gateway.core.poison`, and the MLflow wrapper's, :mod:`model_code.quarantine`): an SDK retrying, a
client editing a word, the same request an hour later or on another replica all have the same shape, while
requests made of other fields pass.
"""

from __future__ import annotations

from typing import Any

import orjson

try:  # the walk in C (engine_guard/_walk.c: ~7x faster on an agent's request); the definition below where not built
    from engine_guard._walk import describe as _native_describe
except ImportError:
    _native_describe = None


_DESCRIBED_KEYS = 64  # an object's first keys (sorted) that its shape describes (the native walk describes as many)


def _size_class(length: int) -> int:
    """0 for empty, then one class per power of two (1, 2-3, 4-7...)."""
    return length.bit_length()


def _describe(value: Any, depth: int) -> str:
    """A value's shape: its type and size class, containers to ``depth`` levels (elements deduplicated). (The
    definition: the native walk, :data:`describe`, gives the same answers, tests/engine_guard/test_native_walk.py.)"""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return "int-" if value < 0 else f"int{_size_class(value)}"  # every negative id is as wrong as another
    if isinstance(value, float):
        return "float-" if value < 0 else "float0" if value == 0 else "float<1" if value < 1 else f"float{_size_class(int(value))}"
    if isinstance(value, str):
        return f"str{_size_class(len(value))}"
    if value is None:
        return "null"
    if isinstance(value, list):
        if depth <= 0:
            return f"list{_size_class(len(value))}"
        items = sorted({_describe(item, depth - 1) for item in value[:256]})
        return f"list{_size_class(len(value))}[{','.join(items)}]"
    if isinstance(value, dict):
        if depth <= 0:
            return f"obj{_size_class(len(value))}"
        return "{" + ",".join(f"{key}:{_describe(value[key], depth - 1)}" for key in sorted(value)[:_DESCRIBED_KEYS]) + "}"
    return type(value).__name__


describe = _native_describe or _describe


def request_shape(path: str, body: dict[str, Any]) -> str:
    """What a request is made of, for the quarantine: its route (the engine's path) and, for each field but
    ``model``, its type and size class, three levels deep. Editing a word of a prompt keeps the shape; so
    does sending it again later or to another replica; adding, removing or retyping a field changes it."""
    if len(body) <= _DESCRIBED_KEYS:  # (any body the allowlist passes): its fields are what describe() writes of it, once
        rest = body.copy()
        rest.pop("model", None)
        return f"{path} {describe(rest, 4)}"
    fields = ",".join(f"{key}:{describe(body[key], 3)}" for key in sorted(body) if key != "model")
    return f"{path} {{{fields}}}"


def payload_shape(path: str, payload: bytes) -> str:
    """:func:`request_shape` of a body as sent upstream (parsed again: only when an engine failed)."""
    try:
        body = orjson.loads(payload)
    except orjson.JSONDecodeError:
        body = {"unparsed": payload.decode(errors="replace")}
    return request_shape(path, body if isinstance(body, dict) else {"body": body})


def fields_of(shape: str) -> tuple[str, ...]:
    """The top-level field names of a shape (for messages and the log: "which fields made it dangerous")."""
    inner = shape.split(" ", 1)[1][1:-1] if " " in shape else ""
    names, depth, start = [], 0, 0
    for at, char in enumerate(inner + ","):
        if char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            names.append(inner[start:at].split(":", 1)[0])
            start = at + 1
    return tuple(name for name in names if name)
