"""Engines that run only while they are used: started at a model's first request (``residency.on_demand``),
stopped after ``residency.idle_stop_s`` without one, and at most ``max_resident`` models of a residency group
(``gateway.residency_groups``, models sharing GPUs) running at once, the least recently used idle one stopped to
make room.

An asleep model keeps its route (names, aliases, limiter) with a :class:`DormantBackend` in each replica's place. A
request for it enters here and waits while its engine starts: one start however many wait, bounded for each by the
engine's own ``startup_timeout_s`` (plus its group's ``turn_s`` when it waits for room), not by the slot queue's
``queue_timeout_s``: a cold start of a GPU model takes minutes.

No member keeps a group: a member resident ``turn_s`` while another's request waits for room has had its turn. It
takes no new request (those wait for its next turn, as an asleep model's do) and is stopped once its requests in
flight end; none is cut. No member is stopped to make room before it was resident ``min_resident_s``, and one key
causes at most ``wakes_per_key_per_hour`` cold starts in a group (429 ``wake_limit_exceeded`` past it). A stop takes the engine out of the registry first (no new request reaches it), then stops it,
so the watchdog never takes a deliberate stop for a failure. Only an idle model is stopped: no request in flight,
none waiting. On CPU and on GPUs alike a sleep is a stop and a wake a cold start.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any, Protocol

from loguru import logger

from gateway.config import ResidencyGroup
from gateway.control.engine_api import engine_post
from gateway.control.fleet import SwapError
from gateway.control.swap import BackendFactory, SwapExecutor
from gateway.core.backends import Backend, DormantBackend, EngineBackend
from gateway.core.errors import GatewayError
from gateway.core.registry import ModelRoute
from gateway.core.state import GatewayState
from launch.config import DeploymentConfig, ModelEntry, ResidencyConfig

WAKE_WINDOW_S = 3600.0  # the window of wakes_per_key_per_hour
CHECK_INTERVAL_S = 0.5  # how often idle models are looked for
ROOM_POLL_S = 0.1  # how often a start waiting for room in its group looks again
STARTING, SLEEPING, RESIDENT = "starting", "sleeping", "resident"
RELEASE, RESUME = "/release_memory_occupation", "/resume_memory_occupation"  # SGLang 0.5.23 (needs --enable-memory-saver)

Spawn = Callable[[Coroutine[Any, Any, Any]], "asyncio.Task[Any]"]  # the controller's: runs a task to its end


class Applier(Protocol):
    """What residency needs of the deployment's applier (:class:`gateway.control.applier.DeploymentApplier`, which
    imports this module): the deployment in force, and how to build a model's engines."""

    @property
    def deployment(self) -> DeploymentConfig | None: ...

    async def deployment_changed(self) -> None: ...

    def builds(self, name: str, entry: ModelEntry) -> list[BackendFactory]: ...


def dormant(route_name: str, replicas: int) -> tuple[Backend, ...]:
    """The replicas of an asleep model."""
    return tuple(DormantBackend(route_name, replica=index) for index in range(replicas))


def wait_bound(entry: ModelEntry | None, group: ResidencyGroup | None, fallback_s: float) -> float:
    """How long a request waits for a model's engine: the launcher's start timeout (``startup_timeout_s``), plus its
    group's ``turn_s`` (the wait for room); ``fallback_s`` for a model without an engine section any more."""
    bound = entry.engine.startup_timeout_s if entry is not None and entry.engine is not None else fallback_s
    return bound + (group.turn_s if group is not None else 0.0)


def starts_asleep(entry: ModelEntry) -> bool:
    """A model whose engine is not started at boot (or when it is added by a reload)."""
    return entry.engine is not None and entry.residency is not None and entry.residency.on_demand


class Residency:
    """Wakes asleep models for their requests and puts idle ones to sleep (the control process's; one process)."""

    def __init__(self, state: GatewayState, applier: Applier, executor: SwapExecutor, spawn: Spawn) -> None:
        self.state = state
        self._spawn = spawn  # the controller's: a start is not cut by the client that asked for it, and ends at shutdown
        self.registry = state.registry
        self.applier = applier
        self.executor = executor
        self.metrics = state.metrics
        self._seen: DeploymentConfig | None = None
        self._config: dict[str, ResidencyConfig] = {}  # models with a residency section, as the deployment in force says
        self._last_used: dict[str, float] = {}  # monotonic time of each model's last request (or of its start)
        self._pending: dict[str, int] = {}  # requests entered and not yet holding their backend
        self._waking: dict[str, asyncio.Task[None]] = {}
        self._groups: dict[str, asyncio.Lock] = {}  # one start at a time per group: room is counted once
        self._resident_since: dict[str, float] = {}  # monotonic time each model's engine came up (or the boot)
        self._closing: dict[str, asyncio.Event] = {}  # members whose turn is over: set once they are stopped (or kept after all)
        self._key_wakes: dict[tuple[str, str], deque[float]] = {}  # (group, key) -> times of the cold starts that key caused

    # ------------------------------------------------------------------ what the data plane calls
    def manages(self, model: str) -> bool:
        """A model with a residency section, or one asleep (a reload took its section away: its request wakes it)."""
        if model in self._configs():
            return True
        route = self.registry.route(model)
        return route is not None and route.asleep

    async def enter(self, route: ModelRoute, owner: str | None = None) -> ModelRoute:
        """Count a request of ``route``'s model; wait while its turn is over or it is asleep (``owner``: the client
        key's identity, whose cold starts ``wakes_per_key_per_hour`` counts; None: not counted)."""
        name = route.name
        self._last_used[name] = time.monotonic()
        bound = self._wait_bound(name)
        try:
            async with asyncio.timeout(bound):
                closing = self._closing.get(name)
                if closing is not None:  # its turn is over: not counted as pending, so that it stops, then it wakes again
                    await closing.wait()
        except TimeoutError:
            raise self._not_ready(name, bound) from None
        self._pending[name] = self._pending.get(name, 0) + 1
        try:
            current = self.registry.route(name) or route
            if not current.asleep:
                return current
            self._count_wake(name, owner)
            return await self._wait_awake(name, bound)
        except BaseException:
            self.leave(name)
            raise

    def leave(self, model: str) -> None:
        self._pending[model] = max(0, self._pending.get(model, 0) - 1)
        self._last_used[model] = time.monotonic()

    def status(self, model: str) -> str | None:
        """``starting``, ``sleeping`` or ``resident`` for a model with a residency section (None for the others)."""
        if not self.manages(model):
            return None
        if model in self._waking:
            return STARTING
        route = self.registry.route(model)
        return SLEEPING if route is None or route.asleep else RESIDENT

    # ------------------------------------------------------------------ waking
    async def _wait_awake(self, name: str, bound: float) -> ModelRoute:
        task = self._waking.get(name)
        if task is None:
            logger.info("model {}: asleep; starting its engine for a waiting request", name)
            task = self._waking[name] = self._spawn(self._wake(name))
            task.add_done_callback(lambda done: self._waking.pop(name, None) if self._waking.get(name) is done else None)
        limits = self.state.settings.limits_for(name)
        try:
            await asyncio.wait_for(asyncio.shield(task), bound)
        except TimeoutError:
            raise self._not_ready(name, bound) from None
        except SwapError as error:
            raise GatewayError(
                503, f"model {name!r} could not start: {error.message}", code="engine_unavailable",
                headers={"Retry-After": str(limits.retry_after_s)},
            ) from None  # fmt: skip
        route = self.registry.route(name)
        if route is None or route.asleep:
            raise GatewayError(503, f"model {name!r} was stopped again before this request got to it; retry", code="engine_unavailable",
                               headers={"Retry-After": str(limits.retry_after_s)})  # fmt: skip
        return route

    async def _wake(self, name: str) -> None:
        asked = time.monotonic()
        config = self._configs().get(name)
        group = config.group if config is not None else None
        lock = self._groups.setdefault(group, asyncio.Lock()) if group is not None else None
        async with self.executor.lock(name):
            if lock is not None:
                await lock.acquire()
            try:
                route = self.registry.route(name)
                entry = self._entry(name)
                if route is None or entry is None:
                    raise SwapError(name, "the model was removed")
                if not route.asleep:
                    return
                if group is not None:
                    await self._make_room(name, group)
                how = "started"
                if not await self._resume(name, route):
                    replicas = await self.executor.build_all(name, self.applier.builds(name, entry))
                    current = self.registry.route(name)
                    if current is None:
                        await asyncio.gather(*(self.executor.drainer.retire(name, backend) for backend in replicas))
                        raise SwapError(name, "the model was removed while its engine started")
                    self.registry.put(replace(current, replicas=tuple(replicas)))
                else:
                    how = "resumed"
            finally:
                if lock is not None:
                    lock.release()
        waited = time.monotonic() - asked
        self._last_used[name] = self._resident_since[name] = time.monotonic()
        self.metrics.child(self.metrics.wakes, name, how).inc()
        self.metrics.child(self.metrics.wake_seconds, name).observe(waited)
        route = self.registry.route(name)
        where = ", ".join(backend.describe() for backend in route.replicas) if route is not None else "-"
        logger.info("model {}: {} for a waiting request in {:.1f}s: {}", name, how, waited, where)
        self.state.events.record("wake", name, True, f"{how} for a waiting request in {waited:.1f}s")

    async def _resume(self, name: str, route: ModelRoute) -> bool:
        """Engines asleep with their memory released take it back (True); False: there are none, or one could not
        (those are stopped, and the caller starts new ones)."""
        engines = [backend for backend in route.replicas if isinstance(backend, EngineBackend)]
        if not engines or len(engines) != len(route.replicas):
            return False
        failed = await asyncio.gather(*(engine_post(backend, RESUME) for backend in engines))
        if all(error is None for error in failed):
            for backend in engines:
                backend.asleep = False  # last: only an engine holding its memory again takes requests
            return True
        problem = next(error for error in failed if error is not None)
        logger.error("model {}: an engine could not take its memory back ({}); starting new engines", name, problem)
        self.registry.put(replace(route, replicas=dormant(name, len(route.replicas))))
        for backend in engines:
            await self.executor.fleet.stop_engine(backend.engine, forget=True)
        return False

    async def _make_room(self, name: str, group: str) -> None:
        """Stop the least recently used idle model of ``group`` resident ``min_resident_s`` until one more fits. While
        all are busy, the one resident longest past ``turn_s`` is closed: it takes no new request and is stopped once
        idle. A close this wait made is lifted if it ends otherwise (its waiters then go to the engine still up)."""
        closed: list[str] = []
        try:
            while True:
                settings = self.state.settings.residency_groups.get(group) or ResidencyGroup()
                members = [m for m, c in self._configs().items() if c.group == group and m != name]
                awake = [m for m in members if (route := self.registry.route(m)) is not None and not route.asleep]
                if len(awake) < settings.max_resident:
                    return
                now = time.monotonic()
                idle = [
                    m for m in awake
                    if self._idle(m) and not self.executor.lock(m).locked() and self._resident_for(m, now) >= settings.min_resident_s
                ]  # fmt: skip
                if idle:
                    victim = min(idle, key=lambda m: self._last_used.get(m, 0.0))
                    turn = " (its turn was over)" if victim in self._closing else ""
                    await self.sleep(victim, "evicted", f"to make room for {name} in group {group}{turn}")
                    continue
                if not self._pending.get(name):
                    raise SwapError(name, f"no request waits any more for a place in group {group}")
                share = max(settings.turn_s, settings.min_resident_s)
                over = [m for m in awake if self._resident_for(m, now) >= share and not self.executor.lock(m).locked()]
                if over and not any(m in self._closing for m in awake):
                    victim = max(over, key=lambda m: self._resident_for(m, now))
                    self._closing[victim] = asyncio.Event()
                    closed.append(victim)
                    why = f"its turn of {settings.turn_s:g}s in group {group} is over while {name} waits: no new request; stopped when its requests end"
                    logger.info("model {}: {}", victim, why)
                    self.state.events.record("turn", victim, True, why)
                await asyncio.sleep(ROOM_POLL_S)
        finally:
            for victim in closed:
                self._lift_close(victim)

    def _lift_close(self, name: str) -> None:
        closing = self._closing.pop(name, None)
        if closing is not None:
            closing.set()

    def _resident_for(self, name: str, now: float) -> float:
        return now - self._resident_since.get(name, now)

    def _group_of(self, name: str) -> str | None:
        config = self._configs().get(name)
        return config.group if config is not None else None

    def _wait_bound(self, name: str) -> float:
        group = self._group_of(name)
        settings = (self.state.settings.residency_groups.get(group) or ResidencyGroup()) if group is not None else None
        return wait_bound(self._entry(name), settings, self.state.settings.limits_for(name).queue_timeout_s)

    def _not_ready(self, name: str, bound: float) -> GatewayError:
        return GatewayError(
            503, f"model {name!r} is starting for waiting requests and was not ready within {bound:g}s (its engine's "
            "startup_timeout_s, plus its group's turn_s); retry later", code="model_starting",
            headers={"Retry-After": str(self.state.settings.limits_for(name).retry_after_s)},
        )  # fmt: skip

    def _count_wake(self, name: str, owner: str | None) -> None:
        """Note the cold start ``owner``'s request causes (none when one is under way), or refuse it past the key's
        ``wakes_per_key_per_hour`` in the model's group."""
        group = self._group_of(name)
        if owner is None or group is None or name in self._waking:
            return
        limit = (self.state.settings.residency_groups.get(group) or ResidencyGroup()).wakes_per_key_per_hour
        if limit is None:
            return
        now = time.monotonic()
        wakes = self._key_wakes.setdefault((group, owner), deque())
        while wakes and wakes[0] <= now - WAKE_WINDOW_S:
            wakes.popleft()
        if len(wakes) >= limit:
            retry = max(1, math.ceil(wakes[0] + WAKE_WINDOW_S - now))
            raise GatewayError(
                429, f"model {name!r} is asleep, and this key started {limit} engines of group {group!r} in the last hour "
                f"(gateway.residency_groups.{group}.wakes_per_key_per_hour); retry later or use a model that is up",
                code="wake_limit_exceeded", headers={"Retry-After": str(retry)},
            )  # fmt: skip
        wakes.append(now)

    # ------------------------------------------------------------------ sleeping
    async def sleep(self, name: str, reason: str, why: str) -> bool:
        """Put ``name`` to sleep (it is idle: no request in flight or waiting); False when it was asleep already.

        ``sleep: stop``: its engines leave the registry, then stop. ``sleep: memory_saver``: each engine is marked
        asleep (no request reaches it), then releases its GPU memory through SGLang's API, its process kept; an
        engine that cannot release is stopped instead (logged)."""
        route = self.registry.route(name)
        if route is None or route.asleep:
            return False
        config = self._configs().get(name)
        engines = [backend for backend in route.replicas if isinstance(backend, EngineBackend)]
        if config is not None and config.sleep == "memory_saver" and len(engines) == len(route.replicas):
            for backend in engines:
                backend.asleep = True  # first: from now on a request wakes it instead of reaching it
            logger.info("model {}: releasing its engines' GPU memory ({})", name, why)
            released = await asyncio.gather(*(engine_post(backend, RELEASE) for backend in engines))
            if all(error is None for error in released):
                self._count_sleep(name, reason, f"{why}; GPU memory released, processes kept")
                return True
            problem = next(error for error in released if error is not None)
            logger.error("model {}: an engine could not release its memory ({}); stopping the engines instead", name, problem)
            why = f"{why}; release failed ({problem}), stopped"
        self.registry.put(replace(route, replicas=dormant(name, len(route.replicas))))
        logger.info("model {}: stopping its engine ({})", name, why)
        for backend in engines:
            await self.executor.fleet.stop_engine(backend.engine, forget=True)
        self._count_sleep(name, reason, why)
        return True

    def _count_sleep(self, name: str, reason: str, why: str) -> None:
        self._lift_close(name)  # asleep now: the requests that waited for its turn's end wake it again
        self.metrics.child(self.metrics.residency_stops, name, reason).inc()
        self.state.events.record("sleep", name, True, why)

    async def run(self) -> None:
        """Stop models idle for their ``idle_stop_s`` (the controller runs this for the gateway's lifetime). While no
        model has one, it sleeps until a reload brings another deployment, instead of looking twice a second."""
        while True:
            if not any(config.idle_stop_s is not None for config in self._configs().values()):
                await self.applier.deployment_changed()
                continue
            await asyncio.sleep(CHECK_INTERVAL_S)
            now = time.monotonic()
            for name, config in list(self._configs().items()):
                route = self.registry.route(name)
                if route is not None and route.in_flight:
                    self._last_used[name] = now  # in use: idle_stop_s counts from its last request's end
                if config.idle_stop_s is None or not self._idle(name) or self.executor.lock(name).locked():
                    continue
                if now - self._last_used.get(name, now) >= config.idle_stop_s:
                    await self.sleep(name, "idle", f"no request for {config.idle_stop_s:g}s")

    # ------------------------------------------------------------------ helpers
    def _idle(self, name: str) -> bool:
        route = self.registry.route(name)
        return route is not None and not self._pending.get(name) and name not in self._waking and route.in_flight == 0

    def _entry(self, name: str) -> ModelEntry | None:
        deployment = self.applier.deployment
        return deployment.models.get(name) if deployment is not None else None

    def _configs(self) -> dict[str, ResidencyConfig]:
        deployment = self.applier.deployment
        if deployment is not self._seen:  # a boot or reload made another deployment the one in force
            self._seen = deployment
            models = deployment.models if deployment is not None else {}
            self._config = {name: entry.residency for name, entry in models.items() if entry.residency is not None and entry.engine is not None}
            now = time.monotonic()
            for name in self._config:
                self._resident_since.setdefault(name, now)
                self._last_used.setdefault(name, now)  # idle_stop_s counts from the boot (or the reload that added it)
        return self._config
