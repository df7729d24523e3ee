"""Replace the backends of one model without dropping requests: blue-green, rolling or stop-first.

Blue-green starts the new replicas beside the old ones, switches the route in one registry
assignment once they are ready, then lets the old ones finish their in-flight requests (up to the
drain timeout) and stops them. Rolling does that one replica at a time (never more than one engine
extra: the default for models with replicas). Stop-first is for engines that cannot both fit in
memory: the old ones are drained (new requests get 503 + Retry-After) and stopped before the new
ones start.

Every operation on a model runs under that model's ``asyncio.Lock`` (held by the caller), so
swaps, reloads and watchdog restarts of the same model never interleave. The executor owns every
engine it started (boot, reload, swap, restart) and stops them all on shutdown.

Engines start through :func:`launch.lifecycle.start_ready` in a worker thread (preflight, start from
launch's long-lived starter thread, which the parent-death signal requires, wait until ready).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from loguru import logger

from gateway.config import SwapPolicy
from gateway.core.registry import Backend
from gateway.core.state import GatewayState
from launch.config import EngineConfig, RouterConfig
from launch.lifecycle import STARTER, start_ready
from launch.preflight import PreflightError
from launch.process import EngineError, EngineProcess, ProgressCallback, new_engine_key
from launch.router import RouterProcess

BackendFactory = Callable[[], Awaitable[Backend]]


def _stop_if_started(starting: asyncio.Future[EngineProcess]) -> None:
    """A start nobody waits for any more: stop the engine if it came up anyway."""
    if not starting.cancelled() and starting.exception() is None:
        threading.Thread(target=starting.result().stop, name="stop-orphan-engine", daemon=True).start()


def log_progress(name: str) -> ProgressCallback:
    """Log each start-up phase of engine ``name`` at INFO (loading weights, KV cache, CUDA graphs, warm-up):
    where the gateway runs as a serving platform's entrypoint, its log is the only view of a cold start."""

    def progress(phase: str, elapsed_s: float) -> None:
        if phase not in ("starting", "ready"):  # EngineProcess logs both itself, with its port / URL
            logger.info("engine {}: {} ({:.0f}s)", name, phase, elapsed_s)

    return progress


class SwapError(Exception):
    """A backend could not be brought up; ``log_tail`` holds the engine's last log lines, ``cause`` the
    engine's or preflight's own error (raised as is when a boot fails)."""

    def __init__(self, model: str, message: str, log_tail: Iterable[str] = (), cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.model = model
        self.message = message
        self.log_tail = list(log_tail)
        self.cause = cause


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
    cause: BaseException | None = field(default=None, repr=False)  # why a start failed (not reported)


    def as_dict(self) -> dict[str, Any]:
        hidden = ("cause", "_hidden")
        return {key: value for key, value in self.__dict__.items() if key not in hidden and value is not None and value != []}


def _describe(backends: Sequence[Backend]) -> str:
    return ", ".join(backend.describe() for backend in backends)


def describe_backend(backend: Backend) -> dict[str, Any]:
    engine = backend.engine
    info: dict[str, Any] = {"url": backend.url, "served_model_name": backend.served_name, "in_flight": backend.in_flight}
    if engine is not None:
        info.update(pid=engine.pid, port=engine.port)
    return info


class SwapExecutor:
    """Starts, switches, drains and stops backends for the controller and the watchdog."""

    def __init__(self, state: GatewayState, *, owned: Iterable[EngineProcess] = (), log_dir: str | Path | None = None) -> None:
        self.state = state
        self.registry = state.registry
        self.log_dir = log_dir
        self._owned: set[EngineProcess] = set(owned)
        self._locks: dict[str, asyncio.Lock] = {}
        self.retiring: dict[str, list[Backend]] = {}  # old backends still finishing requests, by model
        self._closing = False
        self._abort = threading.Event()  # set from a signal handler, or by a failed boot: starts give up
        self._routers: set[RouterProcess] = set()  # SGLang routers started in front of replicas

    @property
    def aborted(self) -> bool:
        return self._abort.is_set()

    def abort_starts(self) -> None:
        """Make every engine start in progress stop its engine and fail (thread-safe; signal handlers too)."""
        self._abort.set()

    # --------------------------------------------------------------- ownership and locks
    def lock(self, model: str) -> asyncio.Lock:
        """The lock every change to ``model``'s backend is made under."""
        return self._locks.setdefault(model, asyncio.Lock())

    def owns(self, engine: EngineProcess | None) -> bool:
        return engine is not None and engine in self._owned

    # --------------------------------------------------------------- backends
    async def engine_backend(self, model: str, config: EngineConfig, *, replica: int = 0, api_key: str | None = None) -> Backend:
        """Launch an engine for ``model`` (replica ``replica``) and wait until it is ready: preflight, start
        and wait by :func:`launch.lifecycle.start_ready`; SwapError (with the engine's log tail) if not."""
        if self._closing or self.aborted:
            raise SwapError(model, "the gateway is shutting down")
        name = model if not replica else f"{model}-{replica}"
        given_up = threading.Event()  # this start was cancelled (its caller went away): the thread stops the engine
        starting = asyncio.ensure_future(
            asyncio.to_thread(
                start_ready, name, config, log_dir=self.log_dir, api_key=api_key or new_engine_key(), on_progress=log_progress(name),
                served_model_name=model, stop_when=lambda: given_up.is_set() or self._closing or self.aborted,
            )
        )  # fmt: skip
        try:
            engine = await asyncio.shield(starting)
        except asyncio.CancelledError:
            given_up.set()
            starting.add_done_callback(_stop_if_started)
            raise
        except PreflightError as error:
            raise SwapError(model, str(error), cause=error) from None
        except EngineError as error:
            if self.aborted or self._closing:
                raise SwapError(model, "start aborted (the gateway is stopping)") from None
            tail = error.log_tail[-40:]
            raise SwapError(model, f"new engine for {model!r} failed to start: {str(error).splitlines()[0]}", tail, cause=error) from None
        self._owned.add(engine)
        if self._closing:  # closed while it came up: close() did not see it
            await self._stop(engine, forget=True)
            raise SwapError(model, "the gateway is shutting down")
        return Backend(config.served_model_name or model, engine=engine, replica=replica)

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
        if policy == "blue-green" and fixed_port and any(b.engine is not None and b.engine.port == fixed_port for b in old):
            logger.info("model {}: the new engine needs port {} held by the old one; swapping stop-first", model, fixed_port)
            policy = "stop-first"
        if policy == "stop-first" and not any(self.owns(b.engine) for b in old):
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
            await asyncio.gather(*(self.retire(model, backend) for backend in started))
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
            await asyncio.gather(*(self.retire(model, backend) for backend in new))
            result.error = f"model {model!r} was removed while its new engine started"
            return
        self.registry.put(replace(route, replicas=tuple(new)))
        await self.sync_router(model)
        result.ok, result.new = True, describe_backend(new[0])
        logger.info("model {}: now served by {} (ready after {:.1f}s); draining {}", model, _describe(new), result.start_s, _describe(old))
        drains = await asyncio.gather(*(self.retire(model, backend) for backend in old))
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
                    await self.retire(model, previous)
                continue
            try:
                new = await builds[replica]()
            except SwapError as error:
                result.error = f"replica {replica}: {error.message}; replicas before it were replaced, the others keep their engines"
                result.log_tail = error.log_tail
                return
            if self.registry.set_backend(model, new) is None:
                await self.retire(model, new)
                result.error = f"model {model!r} was removed during its rolling swap"
                return
            await self.sync_router(model)
            logger.info("model {}: replica {} now served by {}", model, replica, new.describe())
            if previous is not None:
                drain_s, timed_out = await self.retire(model, previous)
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
        drains = await asyncio.gather(*(self._drain(backend, model) for backend in old))
        result.drain_s = max(drain for drain, _ in drains)
        result.drain_timed_out = any(timed_out for _, timed_out in drains)
        await asyncio.gather(*(self._stop(backend.engine) for backend in old))
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
            await asyncio.gather(*(self.retire(model, backend) for backend in new))
            result.error = f"model {model!r} was removed while its new engine started"
            return
        self.registry.put(replace(route, replicas=tuple(new)))
        await self.sync_router(model)
        for backend in old:
            self._owned.discard(backend.engine)  # type: ignore[arg-type]
        result.unavailable_s = time.monotonic() - down
        result.ok, result.new = True, describe_backend(new[0])
        logger.info("model {}: now served by {}; it was unavailable for {:.1f}s", model, _describe(new), result.unavailable_s)

    async def restart(self, model: str, old: Backend) -> Backend:
        """Stop ``old`` (dead or hung) and start a fresh engine with its config (watchdog; lock held)."""
        assert old.engine is not None
        await self._stop(old.engine)
        new = await self.engine_backend(model, old.engine.config, replica=old.replica, api_key=old.engine.api_key)  # the same key
        if self.registry.set_backend(model, new) is None:
            await self.retire(model, new)
            raise SwapError(model, f"model {model!r} was removed while its engine restarted")
        await self.sync_router(model)
        self._owned.discard(old.engine)
        return new

    # --------------------------------------------------------------- draining and stopping
    async def retire(self, model: str, backend: Backend) -> tuple[float, bool]:
        """Wait for ``backend``'s in-flight requests (bounded by the drain timeout), then stop its engine."""
        self.retiring.setdefault(model, []).append(backend)
        try:
            drained = await self._drain(backend, model)
            await self._stop(backend.engine, forget=True)
        finally:
            self.retiring[model].remove(backend)
            if not self.retiring[model]:
                del self.retiring[model]
        return drained

    async def _drain(self, backend: Backend, model: str | None = None) -> tuple[float, bool]:
        """Wait (up to the drain timeout) until ``backend`` has no request left: the gateway's own count, and
        for a replica behind SGLang's router (which the gateway does not see through) the engine's count."""
        started = time.monotonic()
        deadline = started + self.state.settings.drain_timeout_s
        route = self.registry.route(model) if model is not None else None
        behind_router = backend.engine is not None and route is not None and route.front is not None
        peers = self.state.peers
        if peers is not None:  # worker processes route to it too: first every one of them must route past it
            if not await peers.settle(max(0.0, deadline - time.monotonic())):
                logger.warning("{}: not every worker process confirmed the new routing before the drain", backend.describe())

        def in_flight() -> int:
            return self.state.in_flight(model, backend)

        while time.monotonic() < deadline:
            if in_flight() == 0 and not (behind_router and await self._engine_busy(backend)):
                break
            await asyncio.sleep(0.05 if not behind_router else 0.25)
        timed_out = in_flight() > 0 or (behind_router and await self._engine_busy(backend))
        if timed_out:
            logger.warning("{}: {} request(s) still running after the drain timeout; stopping anyway", backend.describe(), in_flight())
        return time.monotonic() - started, timed_out

    async def end_crashed(self, backend: Backend) -> None:
        """Stop the engine of ``backend`` now: after a crash SGLang lingers for seconds (crash diagnostics)
        while the requests it held wait; stopped, their connections break, which names the suspects."""
        await self._stop(backend.engine)

    async def _stop(self, engine: EngineProcess | None, *, forget: bool = False) -> None:
        """Stop an engine we own. ``forget`` once its backend has left the registry: an engine stopped
        while its backend still routes the model stays owned, so the watchdog restarts it."""
        if engine is None or engine not in self._owned:
            return
        await asyncio.to_thread(engine.stop)
        if forget:
            self._owned.discard(engine)

    async def _engine_busy(self, backend: Backend) -> bool:
        probes = self.state.probes
        return bool(probes and await probes.engine_requests(backend))

    # --------------------------------------------------------------- SGLang's router in front of replicas
    async def router_front(self, model: str, config: RouterConfig, api_key: str, tokenizer_path: str) -> Backend:
        """Start SGLang's router in front of ``model``'s current replicas; the Backend requests go to."""
        route = self.registry.route(model)
        urls = [backend.url for backend in route.replicas] if route else []
        router = RouterProcess(model, config, tokenizer_path=tokenizer_path, api_key=api_key, log_dir=self.log_dir)
        STARTER.run(lambda: router.start(urls))  # forked from launch's long-lived thread (parent-death signal)
        self._routers.add(router)
        try:
            await asyncio.to_thread(router.wait_ready, urls, None, lambda: self._closing or self.aborted)
        except EngineError as error:
            await asyncio.to_thread(router.stop)
            self._routers.discard(router)
            raise SwapError(model, f"router of {model!r} failed to start: {str(error).splitlines()[0]}", error.log_tail, cause=error) from None
        served = route.backend.served_name if route else model
        return Backend(served, url=router.url, api_key=api_key, router=router)

    async def sync_router(self, model: str) -> None:
        """Make the router in front of ``model`` (if any) route to exactly the replicas that can take requests now
        (a dead, hung or draining replica leaves its list at once, instead of after the router's own health checks)."""
        route = self.registry.route(model)
        router = route.front.router if route is not None and route.front is not None else None
        if router is None or not router.running:
            return
        try:
            await asyncio.to_thread(router.sync_workers, [backend.url for backend in route.available()])  # type: ignore[union-attr]
        except Exception as error:  # noqa: BLE001 - the watchdog restarts a router that stopped answering
            logger.warning("router of model {}: could not update its workers: {}", model, error)

    async def restart_router(self, model: str) -> None:
        """Replace a router that died by a fresh one with the same settings and the current replicas."""
        route = self.registry.route(model)
        old = route.front if route is not None else None
        if old is None or old.router is None:
            return
        router = old.router
        new = await self.router_front(model, router.config, router.api_key or "", router.tokenizer_path)
        current = self.registry.route(model)
        if current is None:
            await self.stop_router(new)
            return
        self.registry.put(replace(current, front=new))
        await self.stop_router(old)
        logger.info("model {}: router back at {}", model, new.url)

    async def stop_router(self, front: Backend | None) -> None:
        if front is not None and front.router is not None:
            await asyncio.to_thread(front.router.stop)
            self._routers.discard(front.router)

    async def close(self) -> None:
        """Stop every engine this gateway owns (shutdown); starts in progress fail and stop too."""
        self._closing = True
        processes = [*self._owned, *self._routers]
        if processes:
            await asyncio.gather(*(asyncio.to_thread(process.stop) for process in processes), return_exceptions=True)
        self._owned.clear()
        self._routers.clear()
