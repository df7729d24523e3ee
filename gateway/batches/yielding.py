"""How many batch lines of a model may run now: ``batches.max_concurrency`` while the model serves nothing else,
``batches.max_concurrency_beside_interactive`` while it has other requests (in flight or queued, in this process or
its workers), and for :data:`HOLD_S` after the last one was seen, so that interactive requests sent one after another
keep the engine to themselves between them.

Why the gateway and not only the engine's priority scheduling: an engine runs every admitted request in each step,
and each one it runs lengthens the step (on CPU, and on a GPU whose batch is full), so a request beside a full batch
waits longer for its first token whatever its priority. Lines that wait here have not started; those already running
finish (a line is short next to a batch: the engine is given back within one line's time).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from gateway.config import BatchSettings

HOLD_S = 1.0  # how long after the last interactive request the batch still yields
POLL_S = 0.05  # how often a line held back looks again


class Yielding:
    """The batch lines running per model, and whether one more may start beside the model's other requests."""

    def __init__(self, load: Callable[[str], int | None], settings: BatchSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.load = load  # requests of a model in flight or queued now, batch lines included (None: no such model)
        self.settings = settings
        self.clock = clock
        self.running: Counter[str] = Counter()  # lines started and not yet ended (sent, waiting to be resent, or recorded)
        self.sending: Counter[str] = Counter()  # of those, the lines being sent now: the batch's share of ``load``
        self._seen: dict[str, float] = {}  # when each model last had requests other than batch lines

    def room(self, model: str) -> bool:
        """Whether one more line of ``model`` may start now."""
        now = self.clock()
        load = self.load(model)
        if load is not None and load > self.sending[model]:
            self._seen[model] = now
        beside = now - self._seen.get(model, float("-inf")) < HOLD_S
        cap = min(self.settings.max_concurrency_beside_interactive, self.settings.max_concurrency) if beside else self.settings.max_concurrency
        return self.running[model] < cap

    async def enter(self, model: str, stopped: Callable[[], bool]) -> None:
        """Wait until a line of ``model`` may start (or ``stopped()``), and count it as running."""
        while not self.room(model) and not stopped():
            await asyncio.sleep(POLL_S)
        self.running[model] += 1

    @contextmanager
    def sent(self, model: str) -> Iterator[None]:
        """Count a line of ``model`` in the load while it is being sent. A line that has its answer is no longer in
        ``load`` but still ``running`` (its result is being written): compared with ``running``, the load would hide
        an interactive request beside it, and the lines next in line would start at the full concurrency."""
        self.sending[model] += 1
        try:
            yield
        finally:
            _count_down(self.sending, model)

    def leave(self, model: str) -> None:
        _count_down(self.running, model)


def _count_down(counts: Counter[str], model: str) -> None:
    """One less of ``model``; none left: no entry (the counters hold only models with lines)."""
    counts[model] -= 1
    if counts[model] <= 0:
        del counts[model]
