"""Calls to the admin endpoints of the engines the gateway runs: SGLang's memory saver (residency) and its LoRA
adapters (reloads). Off the request path, each with a client of its own: a call can take a minute (weights moved
back to the GPU, an adapter read from disk)."""

from __future__ import annotations

import httpx

from gateway.core.backends import Backend

ENGINE_CALL_TIMEOUT_S = 120.0  # taking back the weights of a large model from CPU memory takes a while


async def engine_post(backend: Backend, path: str, body: dict[str, object] | None = None) -> str | None:
    """POST ``body`` to ``path`` of ``backend``'s engine: None, or what failed (with the engine's own message)."""
    try:
        async with httpx.AsyncClient(timeout=ENGINE_CALL_TIMEOUT_S, trust_env=False) as client:
            answer = await client.post(backend.url + path, json=body or {}, headers=backend.upstream_headers())
    except httpx.HTTPError as error:
        return f"{path}: {type(error).__name__}"
    if answer.status_code == 200:
        return None
    message = _message(answer)
    return f"{path}: HTTP {answer.status_code}" + (f": {message}" if message else "")


def _message(answer: httpx.Response) -> str | None:
    """SGLang's reason: ``error_message`` of its LoRA answers, ``message`` or ``error.message`` of the others."""
    try:
        data = answer.json()
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    error = data.get("error")
    found = data.get("error_message") or data.get("message") or (error.get("message") if isinstance(error, dict) else error)
    return str(found)[:500] if found else None
