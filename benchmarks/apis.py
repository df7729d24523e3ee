"""The generation APIs the load generator speaks: OpenAI chat completions, OpenAI Responses, Anthropic Messages.

Each dialect says where its requests go, what their body looks like, and how to read its answers with byte
scans only (the load generator must stay cheap): which SSE event carries text (its arrival is the time to
first token), where the output token count is, which event ends a complete stream and which one is an
error. The fake upstream (``fake_upstream.py``) answers the same three dialects.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_OUTPUT_TOKENS = re.compile(rb'"output_tokens"\s*:\s*(\d+)')


@dataclass(frozen=True)
class Api:
    """One request/answer dialect, as the load generator sees it."""

    name: str
    path: str
    body: Callable[[str, str, int, bool], dict[str, Any]]  # (model, prompt, output tokens, stream) -> JSON body
    is_text: Callable[[bytes], bool]  # a complete SSE event that carries generated text
    usage: re.Pattern[bytes]  # output token count in a usage object (the last match wins)
    ends: tuple[bytes, ...]  # a stream is complete once one of these events arrived
    is_error: Callable[[bytes], bool]  # a complete SSE event that reports a failure

    def output_tokens(self, data: bytes) -> int | None:
        """The last output token count ``data`` mentions (usage objects grow along a stream)."""
        found = self.usage.findall(data)
        return int(found[-1]) if found else None


# ------------------------------------------------------------------ OpenAI chat completions
def _chat_body(model: str, prompt: str, output_tokens: int, stream: bool) -> dict[str, Any]:
    data: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": output_tokens,
        "temperature": 0,
        "stream": stream,
        "ignore_eos": True,  # SGLang extension: exactly output_tokens tokens (the other dialects have no such field)
    }
    if stream:
        data["stream_options"] = {"include_usage": True}
    return data


def _chat_text(event: bytes) -> bool:
    if b'"content":"' not in event and b'"content": "' not in event:
        return False
    return b'"content":""' not in event and b'"content": ""' not in event


def _chat_error(event: bytes) -> bool:
    return b'"error"' in event and b'"choices"' not in event


CHAT = Api(
    name="chat",
    path="/v1/chat/completions",
    body=_chat_body,
    is_text=_chat_text,
    usage=_COMPLETION_TOKENS,
    ends=(b"data: [DONE]",),
    is_error=_chat_error,
)


# ------------------------------------------------------------------ OpenAI Responses
def _responses_body(model: str, prompt: str, output_tokens: int, stream: bool) -> dict[str, Any]:
    return {"model": model, "input": prompt, "max_output_tokens": output_tokens, "temperature": 0, "stream": stream}


RESPONSES = Api(
    name="responses",
    path="/v1/responses",
    body=_responses_body,
    is_text=lambda event: event.startswith(b"event: response.output_text.delta\n"),
    usage=_OUTPUT_TOKENS,
    # SGLang ends a stream cut by max_output_tokens with response.incomplete, others with response.completed
    ends=(b"event: response.completed\n", b"event: response.incomplete\n"),
    is_error=lambda event: event.startswith((b"event: error\n", b"event: response.failed\n")),
)


# ------------------------------------------------------------------ Anthropic Messages
def _messages_body(model: str, prompt: str, output_tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": output_tokens,
        "temperature": 0,
        "stream": stream,
    }


MESSAGES = Api(
    name="messages",
    path="/v1/messages",
    body=_messages_body,
    is_text=lambda event: event.startswith(b"event: content_block_delta\n") and b'"text_delta"' in event,
    usage=_OUTPUT_TOKENS,
    ends=(b"event: message_stop\n",),
    is_error=lambda event: event.startswith(b"event: error\n"),
)

APIS: dict[str, Api] = {api.name: api for api in (CHAT, RESPONSES, MESSAGES)}


def parse_apis(text: str) -> list[Api]:
    """``chat,responses`` -> those dialects, in order (ValueError naming the unknown one)."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in APIS]
    if unknown or not names:
        raise ValueError(f"unknown API {', '.join(unknown) or repr(text)} (choose from {', '.join(APIS)})")
    return [APIS[name] for name in dict.fromkeys(names)]
