"""Token ids checked against the model's vocabulary before they reach an engine.

SGLang 0.5.23 trusts prompt token ids: one id outside ``[0, vocab_size)`` in a completions prompt, a chat's
``input_ids`` (or an embeddings input) crashes its scheduler, and with it the model, for every client.
:func:`token_id_problem` names the first such id.
"""

from __future__ import annotations

import re
from typing import Any

CHAT_TOKEN_ID_FIELDS = ("input_ids", "logit_bias")
"""The fields of a chat completions body that carry token ids (the gateway's chat routes and the MLflow wrapper)."""

_TOKEN_ID_KEY = re.compile(r"-?[0-9]+")  # ASCII digits with at most one sign: what int() takes (not "--5", not "²")


def token_id_problem(fields: tuple[str, ...], body: dict[str, Any], vocab_size: int | None) -> str | None:
    """Why the token ids in ``body``'s ``fields`` (a list of ints, or a list of lists) cannot go to an
    engine, or None. Negative ids are always refused; ids at or above ``vocab_size`` when it is known.
    """
    for field in fields:
        value = body.get(field)
        if isinstance(value, dict):  # logit_bias: {"<token id>": bias}
            keys = [int(key) if _TOKEN_ID_KEY.fullmatch(key) else None for key in value]
            if None in keys:
                return f"{field}: keys must be token ids (integers as strings)"
            value = keys
        if not isinstance(value, list):
            continue
        for row in value if value and isinstance(value[0], list) else [value]:
            if not isinstance(row, list):
                continue
            for token in row:
                if not isinstance(token, int) or isinstance(token, bool):
                    continue
                if token < 0:
                    return f"{field}: token id {token} is negative"
                if vocab_size is not None and token >= vocab_size:
                    return f"{field}: token id {token} is outside the model's vocabulary [0, {vocab_size})"
    return None
