"""The last things the control plane did to the fleet (reloads, swaps, restarts), for people to read.

Prometheus counts them; an operator looking at the status page (or ``GET /admin/models``) wants the story:
*what* happened to *which* model, *when*, and whether it worked. A short, bounded log in memory is enough:
it is about the gateway's current run, and the request log keeps the full history.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Literal

EventKind = Literal["reload", "swap", "adapters", "restart", "engine_down", "wake", "sleep"]


@dataclass(frozen=True)
class Event:
    at: float  # Unix time
    kind: EventKind
    model: str | None  # None: the whole deployment (a reload)
    ok: bool
    detail: str


class EventLog:
    """The newest ``size`` events; appended by the controller and the watchdog (one event loop: no lock)."""

    def __init__(self, size: int = 50) -> None:
        self._events: deque[Event] = deque(maxlen=size)

    def record(self, kind: EventKind, model: str | None, ok: bool, detail: str) -> None:
        self._events.append(Event(time.time(), kind, model, ok, detail))

    def newest_first(self) -> list[dict[str, Any]]:
        return [asdict(event) for event in reversed(self._events)]
