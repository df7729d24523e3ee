"""Replace the backends of one model without dropping requests: blue-green, rolling or stop-first.

Blue-green starts the new replicas beside the old ones, switches the route in one registry
assignment once they are ready, then lets the old ones finish their in-flight requests (up to the
drain timeout) and stops them. Rolling does that one replica at a time (never more than one engine
extra: the default for models with replicas). Stop-first is for engines that cannot both fit in
memory: the old ones are drained (new requests get 503 + Retry-After) and stopped before the new
ones start.

Every operation on a model runs under that model's ``asyncio.Lock`` (held by the caller), so
swaps, reloads and watchdog restarts of the same model never interleave. Processes start and stop
through the :class:`~gateway.control.fleet.Fleet`; old backends retire through the
:class:`~gateway.control.drain.Drainer`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from loguru import logger

from gateway.config import SwapPolicy
from gateway.control.drain import Drainer
from gateway.control.fleet import Fleet, SwapError
from gateway.core.backends import Backend, EngineBackend, RouterBackend
from gateway.core.state import GatewayState
from launch.config import RouterConfig
from launch.process import EngineProcess

BackendFactory = Callable[[], Awaitable[Backend]]
__all__ = ["BackendFactory", "SwapError", "SwapExecutor", "SwapResult", "describe_backend"]


@dataclass
class SwapResult:
    """What one swap did, for the reload report and the admin API."""

    model: str
    policy: SwapPolicy
    ok: bool = False
    error: str | None = None
    log_tail: list[str] = field(default_factory=list)
    old: dict[str, Any] | None = None
    new: dict[str, Any] | None = None
    start_s: float | None = None  # launching the new backend until ready
    drain_s: float | None = None  # old backend: switch until its last request finished (or the timeout)
    drain_timed_out: bool = False
    unavailable_s: float | None = None  # stop-first only: how long the model answered 503
    replicas: int | None = None  # how many replicas the model has after the swap
    adapters: dict[str, str] | None = None  # a reload that only changed LoRA adapters: each one's outcome
    cause: BaseException | None = field(default=None, repr=False)  # why a start failed (not reported)
    lora_paths: dict[str, str] | None = field(default=None, repr=False)  # the adapters served after it (not reported)

    def as_dict(self) -> dict[str, Any]:
        hidden = ("cause", "lora_paths")
        return {key: value for key, value in self.__dict__.items() if key not in hidden and value is not None and value != []}


def _describe(backends: Sequence[Backend]) -> str:
    return ", ".join(backend.describe() for backend in backends)


def describe_backend(backend: Backend) -> dict[str, Any]:
    info: dict[str, Any] = {"url": backend.url, "served_model_name": backend.served_name, "in_flight": backend.in_flight}
    if isinstance(backend, EngineBackend):
        info.update(pid=backend.engine.pid, port=backend.engine.port)
    return info


def _engine_of(backend: Backend) -> EngineProcess | None:
    return backend.engine if isinstance(backend, EngineBackend) else None


class SwapExecutor:
    """Switches a model's backends (swaps, restarts, its router's worker list) for the controller and the watchdog."""

    def __init__(self, state: GatewayState, *, owned: Iterable[EngineProcess] = (), log_dir: str | Path | None = None) -> None:
        self.state = state
        self.registry = state.registry
        self.fleet = Fleet(owned=owned, log_dir=log_dir)
        self.drainer = Drainer(state, self.fleet)
        self._locks: dict[str, asyncio.Lock] = {}

    def lock(self, model: str) -> asyncio.Lock:
        """The lock every change to ``model``'s backend is made under."""
        return self._locks.setdefault(model, asyncio.Lock())

    def owns(self, backend: Backend) -> bool:
        """True for an engine this gateway started and still answers for (the watchdog restarts it)."""
        return self.fleet.owns(_engine_of(backend))

    # --------------------------------------------------------------- swaps (caller holds the model's lock)
    async def swap(self, model: str, builds: Sequence[BackendFactory], policy: SwapPolicy, *, fixed_port: int = 0) -> SwapResult:
        """Replace ``model``'s replicas with the ones ``builds`` make (``builds[i]`` makes replica ``i``);
        never raises for a failed start.

        ``fixed_port``: the new engine's configured port; if the old engine holds it, both cannot run
        at once and the swap is done stop-first.
        """
        route = self.registry.route(model)
        if route is None:
            return SwapResult(model, policy, error=f"no model named {model!r}")
        old = list(route.replicas)
        if policy == "blue-green" and fixed_port and any(isinstance(b, EngineBackend) and b.engine.port == fixed_port for b in old):
            logger.info("model {}: the new engine needs port {} held by the old one; swapping stop-first", model, fixed_port)
            policy = "stop-first"
        if policy == "stop-first" and not any(self.owns(b) for b in old):
            policy = "blue-green"  # nothing of ours to stop first
        result = SwapResult(model, policy, old=describe_backend(old[0]), replicas=len(builds))
        refused = self.state.quarantine.clear(model)  # a new engine: what crashed the old one may not crash it
        if refused:
            logger.info("model {}: {} quarantined request shape(s) cleared by the swap", model, refused)
        if policy == "stop-first":
            await self._swap_stop_first(model, old, builds, result)
        elif policy == "rolling":
            await self._swap_rolling(model, old, builds, result)
        else:
            await self._swap_blue_green(model, old, builds, result)
        return result

    async def build_all(self, model: str, builds: Sequence[BackendFactory]) -> list[Backend]:
        """Start every replica at once; if one fails, stop the others and raise its SwapError."""
        outcomes = await asyncio.gather(*(build() for build in builds), return_exceptions=True)
        started = [outcome for outcome in outcomes if isinstance(outcome, Backend)]
        failures = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
        if failures:
            await asyncio.gather(*(self.drainer.retire(model, backend) for backend in started))
            raise failures[0]
        return started

    async def _swap_blue_green(self, model: str, old: list[Backend], builds: Sequence[BackendFactory], result: SwapResult) -> None:
        started = time.monotonic()
        try:
            new = await self.build_all(model, builds)
        except SwapError as error:
            result.error, result.log_tail = error.message, error.log_tail
            return
        result.start_s = time.monotonic() - started
        route = self.registry.route(model)
        if route is None:  # removed by a reload meanwhile
            await asyncio.gather(*(self.drainer.retire(model, backend) for backend in new))
            result.error = f"model {model!r} was removed while its new engine started"
            return
        self.registry.put(replace(route, replicas=tuple(new)))
        await self.sync_router(model)
        result.ok, result.new = True, describe_backend(new[0])
        logger.info("model {}: now served by {} (ready after {:.1f}s); draining {}", model, _describe(new), result.start_s, _describe(old))
        drains = await asyncio.gather(*(self.drainer.retire(model, backend) for backend in old))
        result.drain_s = max(drain for drain, _ in drains)
        result.drain_timed_out = any(timed_out for _, timed_out in drains)

    async def _swap_rolling(self, model: str, old: list[Backend], builds: Sequence[BackendFactory], result: SwapResult) -> None:
        """One replica at a time: start its successor, put it in its place, drain and stop the old one;
        replicas beyond the new count are drained and removed. Never more than one engine extra."""
        started = time.monotonic()
        by_replica = {backend.replica: backend for backend in old}
        for replica in range(max(len(builds), len(old))):
            previous = by_replica.get(replica)
            if replica >= len(builds):  # scaled down
                route = self.registry.route(model)
                if route is not None and previous is not None:
                    self.registry.put(route.without_replica(replica))
                    await self.sync_router(model)
                    await self.drainer.retire(model, previous)
                continue
            try:
                new = await builds[replica]()
            except SwapError as error:
                result.error = f"replica {replica}: {error.message}; replicas before it were replaced, the others keep their engines"
                result.log_tail = error.log_tail
                return
            if self.registry.set_backend(model, new) is None:
                await self.drainer.retire(model, new)
                result.error = f"model {model!r} was removed during its rolling swap"
                return
            await self.sync_router(model)
            logger.info("model {}: replica {} now served by {}", model, replica, new.describe())
            if previous is not None:
                drain_s, timed_out = await self.drainer.retire(model, previous)
                result.drain_s = max(result.drain_s or 0.0, drain_s)
                result.drain_timed_out = result.drain_timed_out or timed_out
            result.new = result.new or describe_backend(new)
        result.start_s = time.monotonic() - started
        result.ok = True

    async def _swap_stop_first(self, model: str, old: list[Backend], builds: Sequence[BackendFactory], result: SwapResult) -> None:
        down = time.monotonic()
        for backend in old:
            backend.retry_after_s = self.state.settings.swap_retry_after_s
            backend.failure = f"model {model!r} is being swapped (stop-first); retry shortly"
        logger.info("model {}: stop-first swap: draining and stopping {}", model, _describe(old))
        drains = await asyncio.gather(*(self.drainer.drain(backend, model) for backend in old))
        result.drain_s = max(drain for drain, _ in drains)
        result.drain_timed_out = any(timed_out for _, timed_out in drains)
        await asyncio.gather(*(self.fleet.stop_engine(_engine_of(backend)) for backend in old))
        started = time.monotonic()
        try:
            new = await self.build_all(model, builds)
        except SwapError as error:
            # The old engines are gone: leave their (dead) backends in place, so the watchdog restarts
            # them with the previous config, and say so.
            for backend in old:
                backend.failure = backend.retry_after_s = None
            result.error = f"{error.message}; the old engine was already stopped (stop-first): the watchdog restarts it with the previous config"
            result.log_tail = error.log_tail
            return
        result.start_s = time.monotonic() - started
        route = self.registry.route(model)
        if route is None:
            await asyncio.gather(*(self.drainer.retire(model, backend) for backend in new))
            result.error = f"model {model!r} was removed while its new engine started"
            return
        self.registry.put(replace(route, replicas=tuple(new)))
        await self.sync_router(model)
        for backend in old:
            if isinstance(backend, EngineBackend):
                self.fleet.forget(backend.engine)
        result.unavailable_s = time.monotonic() - down
        result.ok, result.new = True, describe_backend(new[0])
        logger.info("model {}: now served by {}; it was unavailable for {:.1f}s", model, _describe(new), result.unavailable_s)

    async def restart(self, model: str, old: EngineBackend) -> Backend:
        """Stop ``old`` (dead or hung) and start a fresh engine with its config (watchdog; lock held)."""
        await self.fleet.stop_engine(old.engine)
        new = await self.fleet.start_engine(model, old.engine.config, replica=old.replica, api_key=old.engine.api_key)  # the same key
        if self.registry.set_backend(model, new) is None:
            await self.drainer.retire(model, new)
            raise SwapError(model, f"model {model!r} was removed while its engine restarted")
        await self.sync_router(model)
        self.fleet.forget(old.engine)
        return new

    async def end_crashed(self, backend: EngineBackend) -> None:
        """Stop the engine of ``backend`` now: after a crash SGLang lingers for seconds (crash diagnostics)
        while the requests it held wait; stopped, their connections break, which names the suspects."""
        await self.fleet.stop_engine(backend.engine)

    # --------------------------------------------------------------- SGLang's router in front of replicas
    async def router_front(self, model: str, config: RouterConfig, api_key: str, tokenizer_path: str) -> RouterBackend:
        """Start SGLang's router in front of ``model``'s current replicas; the backend requests go to."""
        route = self.registry.route(model)
        urls = [backend.url for backend in route.replicas] if route else []
        served = route.backend.served_name if route else model
        return await self.fleet.start_router(model, served, config, urls, api_key=api_key, tokenizer_path=tokenizer_path)

    async def sync_router(self, model: str) -> None:
        """Make the router in front of ``model`` (if any) route to exactly the replicas that can take requests now
        (a dead, hung or draining replica leaves its list at once, instead of after the router's own health checks)."""
        route = self.registry.route(model)
        front = route.front if route is not None else None
        if not isinstance(front, RouterBackend) or not front.router.running:
            return
        try:
            await asyncio.to_thread(front.router.sync_workers, [backend.url for backend in route.available()])  # type: ignore[union-attr]
        except Exception as error:  # noqa: BLE001 - the watchdog restarts a router that stopped answering
            logger.warning("router of model {}: could not update its workers: {}", model, error)

    async def restart_router(self, model: str) -> None:
        """Replace a router that died by a fresh one with the same settings and the current replicas."""
        route = self.registry.route(model)
        old = route.front if route is not None else None
        if not isinstance(old, RouterBackend):
            return
        router = old.router
        new = await self.router_front(model, router.config, router.api_key or "", router.tokenizer_path)
        current = self.registry.route(model)
        if current is None:
            await self.fleet.stop_router(new)
            return
        self.registry.put(replace(current, front=new))
        await self.fleet.stop_router(old)
        logger.info("model {}: router back at {}", model, new.url)
