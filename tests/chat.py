"""One chat completion as the tests send it: a user message to a model, a few tokens, and whatever a test adds.

Most tests need a chat request and care about one or two of its parts (the model, the key, streaming); the rest is
always the same, and written once here.
"""

from __future__ import annotations

from typing import Any

import httpx

from tests.gateway_server import KEY, auth

CHAT = "/v1/chat/completions"


def chat_body(
    model: str = "tiny", content: str = "hi", max_tokens: int = 2, *, system: str | None = None, stream: bool | None = None, **extra: Any
) -> dict[str, Any]:
    """A chat completion's body: one user message (after a system one if given); ``stream`` only when given."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens}
    if stream is not None:
        body["stream"] = stream
    return {**body, **extra}


def post_chat(
    url: str, model: str = "tiny", content: str = "hi", max_tokens: int = 2, *, key: str | None = KEY, timeout_s: float = 120, **body: Any
) -> httpx.Response:
    """POST :func:`chat_body` to the gateway at ``url`` with ``key`` (None: no key)."""
    headers = auth(key) if key is not None else {}
    return httpx.post(url + CHAT, json=chat_body(model, content, max_tokens, **body), headers=headers, timeout=timeout_s)
