"""Retiring a backend: wait until no request uses it (bounded by the drain timeout), then stop its engine.

The count waited on is the gateway's own (summed over its worker processes, after every worker confirmed the
routing that no longer sends it requests); a replica behind SGLang's router is also asked for the engine's own
count, since requests reach it through the router, which the gateway does not see through.
"""

from __future__ import annotations

import asyncio
import time

from loguru import logger

from gateway.control.fleet import Fleet
from gateway.core.backends import Backend, EngineBackend
from gateway.core.state import GatewayState


class Drainer:
    """Drains backends and retires them; ``retiring`` lists the old backends still finishing requests, by model."""

    def __init__(self, state: GatewayState, fleet: Fleet) -> None:
        self.state = state
        self.fleet = fleet
        self.retiring: dict[str, list[Backend]] = {}

    async def retire(self, model: str, backend: Backend) -> tuple[float, bool]:
        """Wait for ``backend``'s in-flight requests (bounded by the drain timeout), then stop its engine;
        returns (seconds waited, whether the timeout cut the wait)."""
        self.retiring.setdefault(model, []).append(backend)
        try:
            drained = await self.drain(backend, model)
            if isinstance(backend, EngineBackend):
                await self.fleet.stop_engine(backend.engine, forget=True)
        finally:
            self.retiring[model].remove(backend)
            if not self.retiring[model]:
                del self.retiring[model]
        return drained

    async def drain(self, backend: Backend, model: str | None = None) -> tuple[float, bool]:
        """Wait (up to the drain timeout) until ``backend`` has no request left."""
        started = time.monotonic()
        deadline = started + self.state.settings.drain_timeout_s
        route = self.state.registry.route(model) if model is not None else None
        behind_router = isinstance(backend, EngineBackend) and route is not None and route.front is not None
        peers = self.state.peers
        if peers is not None:  # worker processes route to it too: first every one of them must route past it
            if not await peers.settle(max(0.0, deadline - time.monotonic())):
                logger.warning(
                    "{}: not every worker process confirmed the new routing before the drain", backend.describe()
                )

        def in_flight() -> int:
            return self.state.in_flight(model, backend)

        while time.monotonic() < deadline:
            if in_flight() == 0 and not (behind_router and await self._engine_busy(backend)):
                break
            await asyncio.sleep(0.05 if not behind_router else 0.25)
        timed_out = in_flight() > 0 or (behind_router and await self._engine_busy(backend))
        if timed_out:
            logger.warning(
                "{}: {} request(s) still running after the drain timeout; stopping anyway",
                backend.describe(),
                in_flight(),
            )
        return time.monotonic() - started, timed_out

    async def _engine_busy(self, backend: Backend) -> bool:
        probes = self.state.probes
        return bool(probes and await probes.engine_requests(backend))
