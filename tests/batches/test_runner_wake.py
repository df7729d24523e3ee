"""A lone batch runner sleeps until told while no batch is unfinished; a create must always reach it. Two ways it
could be missed: a create that commits while the runner's read of the unfinished batches is under way (the read's
snapshot has no batch, and the wake came before the sleep), and a wake from another thread (an ``asyncio.Event`` set
there does not wake a loop sleeping in ``epoll``). The store here is a fake that records reads, because the moment a
create lands inside a read is what a real database cannot be made to hit on demand."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import uvloop

from gateway.batches.runner import BatchRunner
from gateway.config import BatchSettings
from gateway.core.metrics import Metrics
from gateway.core.registry import Registry

PATIENCE_S = 30.0  # a runner that missed its wake sleeps forever: this only bounds the test's failure


class _FakeStore:
    """Answers ``unfinished`` with no batch and counts the reads; ``during_read`` runs inside the first one."""

    def __init__(self) -> None:
        self.reads = 0
        self.read_again = asyncio.Event()
        self.during_read: Any = None

    def unfinished(self) -> list[Any]:
        self.reads += 1
        if self.reads == 1 and self.during_read is not None:
            self.during_read()
        if self.reads > 1:
            self.read_again.set()
        return []


def _runner(store: _FakeStore) -> BatchRunner:
    async def connect(_create: bool) -> Any:
        return store

    async def db(call: Any, *args: Any, **kwargs: Any) -> Any:
        return call(*args, **kwargs)

    class NoSender:
        def load(self, _model: str) -> int:
            return 0

    return BatchRunner(connect, db, files=None, sender=NoSender(), settings=BatchSettings(),  # type: ignore[arg-type]
                       metrics=Metrics(Registry(), multiprocess_dir=""), alone=True)  # fmt: skip


def _later(call: Any) -> None:
    time.sleep(0.2)
    call()


def _runs_on_the_gateways_loop(main: Any) -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())


def test_a_create_committed_during_the_runners_read_is_still_looked_at() -> None:
    async def main() -> None:
        store = _FakeStore()
        runner = _runner(store)
        store.during_read = runner.wake  # the create's commit and wake land after the read's snapshot
        runner.start()
        try:
            await asyncio.wait_for(store.read_again.wait(), PATIENCE_S)
        finally:
            await runner.close(1.0)

    _runs_on_the_gateways_loop(main)


def test_a_wake_from_another_thread_rouses_a_runner_asleep_until_told() -> None:
    async def main() -> None:
        store = _FakeStore()
        runner = _runner(store)
        runner.start()
        try:
            while store.reads < 1:
                await asyncio.sleep(0.01)
            waker = threading.Thread(target=_later, args=(runner.wake,))  # once this loop sleeps in epoll
            waker.start()
            try:
                await asyncio.wait_for(store.read_again.wait(), PATIENCE_S)
            finally:
                waker.join()
        finally:
            await runner.close(1.0)

    _runs_on_the_gateways_loop(main)
