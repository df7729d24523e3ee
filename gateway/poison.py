"""Requests that can crash an engine: refuse the known kinds, and the unknown ones once they have.

SGLang 0.5.23 trusts prompt token ids: one id outside ``[0, vocab_size)`` in a completions prompt (or an
embeddings input) crashes its scheduler, and with it the model, for every client. :func:`token_id_problem`
refuses such requests before they leave the gateway.

For crash classes nobody has found yet there is :class:`Quarantine`: when an engine dies, the requests
whose connections broke with it are suspects. A request that was the only suspect of a crash, or a
suspect of two, is refused (400) for a while. It stops the common loop where an SDK retries the very
request that crashed the engine (the ``openai`` client retries twice by default), and does not rely on
knowing what made the engine fail. Requests are identified by a hash of route and body.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

from gateway.errors import GatewayError


def token_id_problem(fields: tuple[str, ...], body: dict[str, Any], vocab_size: int | None) -> str | None:
    """Why the token ids in ``body``'s ``fields`` (a list of ints, or a list of lists) cannot go to an
    engine, or None. Negative ids are always refused; ids at or above ``vocab_size`` when it is known.
    """
    for field in fields:
        value = body.get(field)
        if isinstance(value, dict):  # logit_bias: {"<token id>": bias}
            keys = [int(key) if key.lstrip("-").isdigit() else None for key in value]
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


def request_fingerprint(path: str, payload: bytes) -> bytes:
    """Identifies a request by route and body (a client retrying sends the same bytes)."""
    return hashlib.blake2b(path.encode() + b"\0" + payload, digest_size=16).digest()


@dataclass
class _Record:
    strikes: int
    blocked: bool
    expires: float


class Quarantine:
    """Per model: fingerprints of requests suspected of crashing its engine, refused for ``ttl_s``."""

    def __init__(self, ttl_s: float = 600.0, max_entries: int = 4096) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._records: dict[tuple[str, bytes], _Record] = {}

    def __bool__(self) -> bool:
        return bool(self._records)

    def engine_crashed(self, model: str, suspects: list[bytes]) -> int:
        """Note the requests in flight when ``model``'s engine died; returns how many are now refused."""
        now = time.monotonic()
        self._expire(now)
        unique = list(dict.fromkeys(suspects))
        newly = 0
        for fingerprint in unique:
            record = self._records.get((model, fingerprint))
            if record is None:
                record = self._records[(model, fingerprint)] = _Record(0, False, 0.0)
            record.strikes += 1
            record.expires = now + self.ttl_s
            if not record.blocked and (len(unique) == 1 or record.strikes >= 2):
                record.blocked = True
                newly += 1
        while len(self._records) > self.max_entries:
            self._records.pop(next(iter(self._records)))
        return newly

    def check(self, model: str, fingerprint: bytes) -> None:
        """Raise GatewayError(400) when this request is quarantined for ``model``."""
        record = self._records.get((model, fingerprint))
        if record is None or not record.blocked:
            return
        if record.expires <= time.monotonic():
            del self._records[(model, fingerprint)]
            return
        raise GatewayError(
            400,
            f"this exact request was in flight when the engine of model {model!r} crashed, and is refused for "
            f"{self.ttl_s:g}s after that; change the request, or ask the operator to look at the engine's log",
            code="request_quarantined",
        )

    def _expire(self, now: float) -> None:
        for key in [key for key, record in self._records.items() if record.expires <= now]:
            del self._records[key]
