"""Requests that can crash an engine: refuse the known kinds, and the unknown ones once they have.

The known kinds are refused by the request guard (:mod:`engine_guard`: token ids outside the vocabulary,
unbounded grammars, fields off the allowlist). For crash classes nobody has found yet there is :class:`Quarantine`: when an engine dies, the requests
whose connections broke with it are suspects; when it freezes (the watchdog restarts it for failed health
probes), every request in flight on it is, less those of shapes the engine had answered in full before (they are
not what crashes it: :func:`evidence`). A request shape that was the only suspect of a failure, or a
suspect of two, is refused (400). Requests are identified by their *shape* (:func:`engine_guard.shapes.request_shape`: route,
fields, types and size classes), not their bytes: an SDK retrying, a client editing a word, the same
request an hour later or on another replica are all refused, while requests made of other fields pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from dataclasses import field as dataclass_field
from typing import Any

from engine_guard.shapes import fields_of
from gateway.core.errors import GatewayError

# (request shape, the key that sent it: None on an open gateway, whether its engine answered that shape in full before)
Suspicion = tuple[str, "str | None", bool]


@dataclass
class Suspect:
    """A request shape suspected of crashing or freezing an engine of a model, and whose evidence it is."""

    strikes: int = 0
    blocked: bool = False  # refused for everyone
    fields: tuple[str, ...] = ()
    last_cause: str = ""
    since: float = dataclass_field(default_factory=time.time)
    keys: dict[str | None, int] = dataclass_field(default_factory=dict)  # strikes per implicated key
    refused_for: set[str | None] = dataclass_field(default_factory=set)  # keys this shape is refused for

    def copy(self) -> Suspect:
        return replace(self, keys=dict(self.keys), refused_for=set(self.refused_for))

    @property
    def refusing(self) -> bool:
        return self.blocked or bool(self.refused_for)


def evidence(suspects: list[tuple[str, str | None, bool]]) -> list[tuple[str, str | None]]:
    """The (shape, key) pairs a failure is held against: those of shapes the engine had never answered in full.

    The quarantine's premise is that a shape which crashed an engine crashes it whenever it comes; a shape the
    engine answered before is then not the cause, however many of its requests were in flight. So a steady client's
    ordinary requests next to another key's crafted one are not evidence at all: the crafted one is the only
    suspect (refused at once). When every suspect's shape had been answered (a crash that depends on the bytes, not
    the shape), every suspect is evidence, as if nothing had been answered."""
    pairs = list(dict.fromkeys((shape, key) for shape, key, _ in suspects))
    doubted = list(dict.fromkeys((shape, key) for shape, key, answered in suspects if not answered))
    return doubted or pairs


def implicated_keys(suspects: list[tuple[str, str | None]]) -> set[str | None]:
    """The keys a failure is held against: those that had in flight a shape no other key had (something only
    they sent), or the only key in flight. When every shape was sent by several keys, all of them (the shared
    shape is then the likely cause, met by independent keys). A key whose in-flight shapes were all also in
    flight from another key is not implicated: ordinary requests next to a key's crafted one are not evidence."""
    holders: dict[str, set[str | None]] = {}
    for shape, key in suspects:
        holders.setdefault(shape, set()).add(key)
    keys = {key for _, key in suspects}
    distinctive = {next(iter(held)) for held in holders.values() if len(held) == 1}
    return distinctive if distinctive and len(keys) > 1 else keys


class Quarantine:
    """Per model: request shapes suspected of crashing (or freezing) its engine, and the keys that sent them.

    A failure's suspects are the requests in flight, each with its key; the failure is held against the
    *implicated* keys (:func:`implicated_keys`). For an implicated key, a shape is refused (400, every route and
    replica of the model) once it was the only request in flight at a failure, or in flight from that key at two
    failures; it is refused for *everyone* once that holds for two distinct keys (evidence no single key made),
    or at once on an open gateway (no keys: one anonymous client, as before keys existed). It stays refused until
    the model's engine is swapped (:meth:`clear` from the swap) or an operator clears it
    (``DELETE /admin/quarantine``): a request that took a model down once will do it again, whenever it comes.
    """

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        self._records: dict[tuple[str, str], Suspect] = {}
        self._blocked = 0  # records refusing anyone: asked on every request, so counted, not scanned
        self.on_change: Callable[[], None] | None = None  # replicas sharing a store: publish at once (shared_quarantine)

    def __bool__(self) -> bool:
        return self._blocked > 0

    def engine_failed(self, model: str, suspects: Iterable[str | tuple[str, str | None] | Suspicion], cause: str) -> list[str]:
        """Note the requests (shapes, (shape, key) pairs or :data:`Suspicion`; a bare shape is an open gateway's) in
        flight when ``model``'s engine crashed or froze; returns the shapes newly refused (for anyone).

        The evidence is the suspects whose shape the engine had not answered in full before (:func:`evidence`)."""
        suspicions = [(item, None, False) if isinstance(item, str) else (item[0], item[1], len(item) > 2 and bool(item[2])) for item in suspects]
        pairs = evidence(suspicions)
        implicated = implicated_keys(pairs)
        alone = len({shape for shape, _ in pairs}) == 1
        # A shape the engine had answered in full (every suspicion of it says so) took no engine down by itself: one
        # failure never condemns it, for its key or for everyone (a steady client's plain request, the only one in
        # flight when another key's aborted work froze the engine); a second failure with it in flight does.
        never_answered = {shape for shape, _, answered in suspicions if not answered}
        newly = []
        for shape in dict.fromkeys(shape for shape, _ in pairs):
            record = self._records.get((model, shape))
            if record is None:
                record = self._records[(model, shape)] = Suspect(fields=fields_of(shape))
            record.strikes += 1
            record.last_cause = cause
            was_refusing, was_blocked = record.refusing, record.blocked
            for key in {key for s, key in pairs if s == shape} & implicated:
                record.keys[key] = record.keys.get(key, 0) + 1
                if (alone and shape in never_answered) or record.keys[key] >= 2:
                    record.refused_for.add(key)
            if not record.blocked and (None in record.refused_for or len(record.refused_for) >= 2):
                record.blocked = True
            if record.refusing and not was_refusing:
                self._blocked += 1
            if (record.refusing and not was_refusing) or (record.blocked and not was_blocked):
                newly.append(shape)
        while len(self._records) > self.max_entries:  # forget the oldest suspects that are not refused first
            oldest = next((key for key, record in self._records.items() if not record.refusing), next(iter(self._records)))
            self._blocked -= self._records.pop(oldest).refusing
        if newly and self.on_change is not None:
            self.on_change()
        return list(dict.fromkeys(newly))

    def check(self, model: str, shape: str, key: str | None = None) -> None:
        """Raise GatewayError(400) when requests of this shape are quarantined for ``model`` (for everyone, or for ``key``)."""
        record = self._records.get((model, shape))
        if record is None or not (record.blocked or key in record.refused_for):
            return
        whose = "" if record.blocked else " when this key sends them"
        raise GatewayError(
            400,
            f"requests of this shape (fields {', '.join(record.fields) or 'none'}) took the engine of model {model!r} "
            f"down{whose} and are refused until an operator clears them; change the request, or ask the operator",
            code="request_quarantined",
        )

    def clear(self, model: str | None = None) -> int:
        """Forget the suspects of ``model`` (every model when None); returns how many shapes were refused."""
        keys = [key for key in self._records if model is None or key[0] == model]
        refused = sum(self._records[key].refusing for key in keys)
        for key in keys:
            del self._records[key]
        self._blocked -= refused
        if keys and self.on_change is not None:
            self.on_change()
        return refused

    def records(self) -> dict[tuple[str, str], Suspect]:
        """A copy of every record (model, shape) -> suspect: what worker processes receive from the control process."""
        return {key: record.copy() for key, record in self._records.items()}

    def restore(self, records: dict[tuple[str, str], Suspect]) -> None:
        """Replace every record with ``records`` (a worker, given the control process's quarantine)."""
        self._records = {key: record.copy() for key, record in records.items()}
        self._blocked = sum(record.refusing for record in self._records.values())

    def refusing(self) -> dict[tuple[str, str], Suspect]:
        """A copy of the records that refuse someone: what replicas sharing a store exchange."""
        return {key: record.copy() for key, record in self._records.items() if record.refusing}

    def merge(self, records: dict[tuple[str, str], Suspect], gone: Iterable[tuple[str, str]] = ()) -> None:
        """Take what other replicas refuse (``records``, added to what is known here: the union of whom it is refused
        for and of the evidence) and forget ``gone`` (cleared on another replica). Says nothing to ``on_change``."""
        for key in gone:
            record = self._records.pop(key, None)
            if record is not None:
                self._blocked -= record.refusing
        for key, theirs in records.items():
            record = self._records.get(key)
            if record is None:
                record = self._records[key] = Suspect(fields=theirs.fields, since=theirs.since)
            was_refusing = record.refusing
            record.strikes = max(record.strikes, theirs.strikes)
            record.blocked = record.blocked or theirs.blocked
            record.last_cause = max(record.last_cause, theirs.last_cause)  # either order gives the same record
            record.since = min(record.since, theirs.since)
            for who, strikes in theirs.keys.items():
                record.keys[who] = max(record.keys.get(who, 0), strikes)
            record.refused_for |= theirs.refused_for
            self._blocked += record.refusing - was_refusing

    def report(self) -> list[dict[str, Any]]:
        """The refused shapes, for the admin API: whose evidence it is (key names or key hashes, never keys)."""
        return [
            {
                "model": model, "shape": shape, "fields": list(record.fields), "strikes": record.strikes,
                "cause": record.last_cause, "since": record.since, "everyone": record.blocked,
                "refused_for": sorted(key for key in record.refused_for if key is not None),
                "evidence": {key: strikes for key, strikes in record.keys.items() if key is not None},
            }
            for (model, shape), record in self._records.items() if record.refusing
        ]  # fmt: skip
