"""The prompt of a stream that ended without the engine's usage, counted by the engine's own tokenizer.

A client that cuts a chat, completions or Messages stream (a "stop" button) leaves the gateway without the usage
event, which comes last (and SGLang's Messages stream says a prompt of 0 when a short answer's first chunk came
without usage). Its completion is the events relayed; its prompt is asked of the engine's ``/v1/tokenize``, which renders
the same messages through the same chat template (SGLang 0.5.23; 0.5.10 tokenizes plain prompts only), after the
stream, off the client's path. Where the engine cannot say (an older SGLang's chat, the Responses API, a router, an
engine gone), the prompt is charged its bound, the body's bytes (docs/tenants.md).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson

from gateway.core.backends import Backend
from gateway.core.endpoints import CHAT_COMPLETIONS, MESSAGES

TOKENIZE_PATH = "/v1/tokenize"
COUNT_TIMEOUT_S = 2.0  # the client is gone: this only delays its ledger row and the settling of its reservation

# The fields of a chat request that shape its rendered prompt, as /v1/tokenize takes them.
_CHAT_FIELDS = ("messages", "tools", "tool_choice", "chat_template_kwargs", "reasoning_effort", "continue_final_message")

PromptCounter = Callable[[], Awaitable[int | None]]


def tokenize_request(path: str, body: dict[str, Any], accepted: frozenset[str]) -> dict[str, Any] | int | None:
    """What counts ``body``'s prompt: a count already known (token ids), the ``/v1/tokenize`` body that asks the
    engine (``accepted``: the fields its version's tokenizer route takes), or None where it cannot say."""
    if path == CHAT_COMPLETIONS:
        if "messages" not in accepted or not isinstance(body.get("messages"), list):
            return None
        return {"model": body.get("model"), **{name: body[name] for name in _CHAT_FIELDS if name in body and name in accepted}}
    if path == MESSAGES and "messages" in accepted:
        messages = _chat_messages_of_anthropic(body)
        return {"model": body.get("model"), "messages": messages} if messages is not None else None
    if path == "/v1/completions" and "prompt" in accepted:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(token, int) for token in prompt):
            return len(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(ids, list) for ids in prompt):
            return sum(len(ids) for ids in prompt)
        if isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(text, str) for text in prompt)):
            return {"model": body.get("model"), "prompt": prompt}
    return None


def _chat_messages_of_anthropic(body: dict[str, Any]) -> list[dict[str, str]] | None:
    """A Messages request of plain text (a string ``system``; each message's content a string or one text block) as
    the chat messages SGLang renders it into; None for anything else (tools, images, several blocks, thinking: their
    rendering is the engine's own, so the bound is charged)."""
    if any(name in body for name in ("tools", "tool_choice", "thinking")):
        return None
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        return None
    chat = [{"role": "system", "content": system}] if system and system.strip() else []
    for message in body.get("messages") or [None]:
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            return None
        content = message.get("content")
        if isinstance(content, list) and len(content) == 1 and isinstance(content[0], dict) and content[0].get("type") == "text":
            content = content[0].get("text")
        if not isinstance(content, str):
            return None
        chat.append({"role": message["role"], "content": content})
    return chat


async def count_prompt(session: aiohttp.ClientSession, backend: Backend, path: str, body: dict[str, Any]) -> int | None:
    """``body``'s prompt in tokens as ``backend``'s engine counts it, or None where it cannot say. Called only for a
    stream that ended without usage (``functools.partial`` of it is what a stream carries: nothing is built before)."""
    how = None if backend.is_router else tokenize_request(path, body, backend.engine_version.tokenize_fields)
    if how is None or isinstance(how, int):
        return how
    headers = {"Content-Type": "application/json", **backend.upstream_headers()}
    try:
        async with session.post(
            backend.url + TOKENIZE_PATH, data=orjson.dumps(how), headers=headers, timeout=aiohttp.ClientTimeout(total=COUNT_TIMEOUT_S)
        ) as answer:
            if answer.status != 200:
                return None
            count = orjson.loads(await answer.read()).get("count")
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, AttributeError):
        return None
    if isinstance(count, list):
        count = sum(count) if all(isinstance(part, int) for part in count) else None
    return count if isinstance(count, int) and count >= 0 else None
