"""What a request may cost, and the usage the gateway asks the engine for on every stream.

Both feed the accounting (docs/tenants.md): a limited key's admission reserves :func:`cost_bound` and settles it
with the engine's usage at the end; a chat or completions stream always asks the engine for its usage
(:func:`ask_for_usage`), and the relay drops the usage event the client did not ask for.
"""

from __future__ import annotations

from typing import Any

# what a request without a completion limit reserves when the model's context length is not known
DEFAULT_COMPLETION_BOUND = 4096

_LIMIT_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def prompt_bound(size: int) -> int:
    """The prompt's tokens as at most the request body's bytes: a byte-level tokenizer makes at most one token per
    byte of text, and the body's JSON framing (keys, quotes, the model name) outweighs a chat template's markers."""
    return size


def cost_bound(body: dict[str, Any], size: int, context_length: int | None) -> tuple[int, int]:
    """(prompt, whole request) at most: the prompt bound plus the completion limit times the choices (``n``);
    without a limit, the model's context length (else :data:`DEFAULT_COMPLETION_BOUND`) per choice."""
    limit = next((body[name] for name in _LIMIT_FIELDS if isinstance(body.get(name), int)), None)
    if limit is None:
        limit = context_length or DEFAULT_COMPLETION_BOUND
    n = body.get("n")
    choices = n if isinstance(n, int) and n > 0 else 1
    prompt = prompt_bound(size)
    return prompt, prompt + limit * choices


def ask_for_usage(body: dict[str, Any]) -> bool:
    """Make a chat or completions stream carry the engine's usage; True when the client had not asked for it (its
    stream must then not show the usage event). Other stream options (``continuous_usage_stats``) stay as sent."""
    options = body.get("stream_options")
    if isinstance(options, dict):
        if options.get("include_usage") is True:
            return False
        body["stream_options"] = {**options, "include_usage": True}
    else:
        body["stream_options"] = {"include_usage": True}
    return True
