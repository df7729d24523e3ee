"""Requests that can crash an engine: refuse the known kinds, and the unknown ones once they have.

The known kinds are refused by the request guard (:mod:`engine_guard`: token ids outside the vocabulary,
unbounded grammars, fields off the allowlist). For crash classes nobody has found yet there is :class:`Quarantine`: when an engine dies, the requests
whose connections broke with it are suspects; when it freezes (the watchdog restarts it for failed health
probes), every request in flight on it is. A request shape that was the only suspect of a failure, or a
suspect of two, is refused (400). Requests are identified by their *shape* (:func:`engine_guard.shapes.request_shape`: route,
fields, types and size classes), not their bytes: an SDK retrying, a client editing a word, the same
request an hour later or on another replica are all refused, while requests made of other fields pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from dataclasses import field as dataclass_field
from typing import Any

from engine_guard.shapes import fields_of
from gateway.core.errors import GatewayError


@dataclass
class Suspect:
    """A request shape suspected of crashing or freezing an engine of a model."""

    strikes: int = 0
    blocked: bool = False
    fields: tuple[str, ...] = ()
    last_cause: str = ""
    since: float = dataclass_field(default_factory=time.time)


class Quarantine:
    """Per model: request shapes suspected of crashing (or freezing) its engine.

    A shape is refused (400, on every route and replica of the model) once it was the only request in flight
    when an engine failed, or in flight at two failures. It stays refused until the model's engine is
    swapped (:meth:`clear` from the swap) or an operator clears it (``DELETE /admin/quarantine``): a
    request that took a model down once will do it again, whenever it comes.
    """

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        self._records: dict[tuple[str, str], Suspect] = {}
        self._blocked = 0  # records refused: asked on every request, so counted, not scanned

    def __bool__(self) -> bool:
        return self._blocked > 0

    def engine_failed(self, model: str, suspects: list[str], cause: str) -> list[str]:
        """Note the request shapes in flight when ``model``'s engine crashed or froze; returns the newly refused ones."""
        unique = list(dict.fromkeys(suspects))
        newly = []
        for shape in unique:
            record = self._records.get((model, shape))
            if record is None:
                record = self._records[(model, shape)] = Suspect(fields=fields_of(shape))
            record.strikes += 1
            record.last_cause = cause
            if not record.blocked and (len(unique) == 1 or record.strikes >= 2):
                record.blocked = True
                self._blocked += 1
                newly.append(shape)
        while len(self._records) > self.max_entries:  # forget the oldest suspects that are not refused first
            oldest = next((key for key, record in self._records.items() if not record.blocked), next(iter(self._records)))
            self._blocked -= self._records.pop(oldest).blocked
        return newly

    def check(self, model: str, shape: str) -> None:
        """Raise GatewayError(400) when requests of this shape are quarantined for ``model``."""
        record = self._records.get((model, shape))
        if record is None or not record.blocked:
            return
        raise GatewayError(
            400,
            f"requests of this shape (fields {', '.join(record.fields) or 'none'}) took the engine of model {model!r} "
            "down and are refused until an operator clears them; change the request, or ask the operator",
            code="request_quarantined",
        )

    def clear(self, model: str | None = None) -> int:
        """Forget the suspects of ``model`` (every model when None); returns how many shapes were refused."""
        keys = [key for key in self._records if model is None or key[0] == model]
        refused = sum(self._records[key].blocked for key in keys)
        for key in keys:
            del self._records[key]
        self._blocked -= refused
        return refused

    def records(self) -> dict[tuple[str, str], Suspect]:
        """A copy of every record (model, shape) -> suspect: what worker processes receive from the control process."""
        return {key: replace(record) for key, record in self._records.items()}

    def restore(self, records: dict[tuple[str, str], Suspect]) -> None:
        """Replace every record with ``records`` (a worker, given the control process's quarantine)."""
        self._records = {key: replace(record) for key, record in records.items()}
        self._blocked = sum(record.blocked for record in self._records.values())

    def report(self) -> list[dict[str, Any]]:
        """The refused shapes, for the admin API."""
        return [
            {"model": model, "shape": shape, "fields": list(record.fields), "strikes": record.strikes, "cause": record.last_cause, "since": record.since}
            for (model, shape), record in self._records.items() if record.blocked
        ]  # fmt: skip
