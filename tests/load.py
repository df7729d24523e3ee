"""A bounded loop of concurrent requests from worker threads, every outcome kept (the shared part of the
load the swap, replica and router tests run while they break something)."""

from __future__ import annotations

import threading
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar


class Timed(Protocol):
    started: float


OutcomeT = TypeVar("OutcomeT", bound=Timed)


@dataclass
class ThreadedLoad(Generic[OutcomeT]):
    """``workers`` threads send requests (every other one streamed) until the block ends or ``max_requests``.

    A subclass says how to open a client (:meth:`client`), send one request (:meth:`one`) and how long to
    wait after an outcome (:meth:`pause`)."""

    base_url: str
    workers: int = 3
    max_requests: int = 5000
    join_s: float = 150
    outcomes: list[OutcomeT] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(self.workers)]

    def client(self) -> AbstractContextManager[Any]:
        raise NotImplementedError

    def one(self, client: Any, stream: bool) -> OutcomeT:
        raise NotImplementedError

    def pause(self, outcome: OutcomeT) -> float:
        return 0.05

    def __enter__(self) -> ThreadedLoad[OutcomeT]:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(self.join_s)
        assert not any(thread.is_alive() for thread in self._threads), "a load worker hung"

    def _run(self, worker: int) -> None:
        with self.client() as client:
            n = 0
            while not self._stop.is_set() and len(self.outcomes) < self.max_requests:
                outcome = self.one(client, stream=(n + worker) % 2 == 0)
                n += 1
                with self._lock:
                    self.outcomes.append(outcome)
                time.sleep(self.pause(outcome))

    def since(self, start: float, end: float = float("inf")) -> list[OutcomeT]:
        """The outcomes of requests started in [start, end)."""
        with self._lock:
            return [o for o in self.outcomes if start <= o.started < end]
