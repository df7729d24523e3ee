"""Inputs that become a forward pass over no token: SGLang 0.5.23's scheduler dies on one.

A prompt of 0 tokens reaches the model as a tensor of 0 elements (``cannot reshape tensor of 0 elements into shape
[0, -1, 32]``), and the scheduler process, with every request on it, is gone. The tokenizers of Qwen and others add
no BOS token, so an empty text is 0 tokens. What each route makes of its inputs, read from SGLang 0.5.23's serving
code and checked on the real engine (the CPU tiny model):

==================================  =========================================  ===================================
route                               the prompt(s) the engine forwards          an empty one, in SGLang 0.5.23
==================================  =========================================  ===================================
``/v1/score``                       ``query + item`` for each item (``item +   **crashes** (no check at all): an
                                    query`` with ``item_first``); an absent    empty item with no query, ``""`` or
                                    query is ``""`` (``[]`` for token ids)     ``[]``. Refused here.
``/v1/completions``                 each prompt (a text or token ids)          refused by SGLang only when *every*
                                                                               prompt is empty: ``["", "x"]``
                                                                               crashed. Refused here.
``/v1/embeddings``, ``/v1/classify``  each input                               refused by SGLang for texts, not for
                                                                               a token list in a list (``[[]]``).
                                                                               Refused here.
``/v1/rerank``                      query and documents (a template)           refused by SGLang (400)
chat, Responses, Messages           the chat template's rendering (role        never empty; an empty conversation
                                    markers around every message)              is SGLang's 400. ``input_ids`` (an
                                                                               extension): refused here when empty.
``/v1/tokenize``, ``/v1/detokenize``,  nothing: no forward pass                allowed
``count_tokens``
==================================  =========================================  ===================================

The schemas (:mod:`engine_guard.schemas`) already refuse most of these as types (a prompt's strings and token lists
have at least one element); :func:`check_inputs` is the rule itself, per route, for what the types cannot say (a
score item is empty only when its query is) and whatever a schema lets through.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from engine_guard.refusal import Refused

# path -> the fields whose every entry is one forward pass (a text or a token list, or a list of them)
_PROMPTS: dict[str, tuple[str, ...]] = {
    "/v1/completions": ("prompt",),
    "/v1/chat/completions": ("input_ids",),
    "/v1/embeddings": ("input",),
    "/v1/classify": ("input",),
}
_WHY = "it has no token, and SGLang 0.5.23's engine crashes on a forward pass over no token"


def check_inputs(path: str, body: dict[str, Any]) -> None:
    """Raise Refused (400 naming the field) when ``body``, valid for route ``path`` (the engine's path), would make the
    engine run a forward pass over no token (see the module's table)."""
    if path == "/v1/score":
        _check_score(body)
        return
    for field in _PROMPTS.get(path, ()):
        for where, prompt in _prompts(field, body.get(field)):
            if _empty(prompt):
                raise Refused(f"{where}: an empty prompt: {_WHY}", code="empty_input", param=field)


def _prompts(field: str, value: Any) -> Iterator[tuple[str, Any]]:
    """(where, prompt) of each forward pass a prompt field makes: a text, a token list, or a list of either."""
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        yield from ((f"{field}.{index}", item) for index, item in enumerate(value))
    elif value is not None:
        yield field, value


def _empty(prompt: Any) -> bool:
    return isinstance(prompt, (str, list)) and len(prompt) == 0


def _check_score(body: dict[str, Any]) -> None:
    """Each item is scored as one prompt, the query and the item joined: refused when both are empty."""
    if not _empty(body.get("query")) and body.get("query") is not None:
        return
    items = body.get("items")
    if not isinstance(items, list):
        return  # a single text item: "" scores nothing (SGLang answers no score), anything else has a token
    for index, item in enumerate(items):
        if _empty(item):
            raise Refused(
                f"items.{index}: an empty item with no query: the prompt scored is the query and the item joined, so {_WHY}",
                code="empty_input", param="items",
            )  # fmt: skip
