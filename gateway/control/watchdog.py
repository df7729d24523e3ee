"""Supervise the engines the gateway launched: notice a dead or hung engine and restart it.

Every ``interval_s`` each owned engine (each replica of each model) is checked: a process that exited is down at once; a running
one that fails ``unhealthy_after`` ``/health`` probes in a row is down too. A busy engine is not a frozen one: SGLang's
``/health`` runs a one-token generation that waits behind the batch, so a loaded CPU engine can miss it while it works.
When a probe fails, the watchdog reads the engine's work counters (:meth:`~gateway.core.health.HealthProbes.progress`:
tokens its scheduler ran, requests it finished): if they moved since the previous check, the probe does not count.
A frozen engine (SIGSTOP, a scheduler stuck) moves none, so it is down after as many failed probes as before. A down model answers 503
(its backend carries the reason; ``/ready`` and ``gateway_engine_up`` follow), and a fresh engine
with the same config is started after an exponential backoff, capped at ``backoff_max_s``.

Client traffic must never keep a model down: an engine that died with requests in flight (a request
crashed a working engine) is restarted without growing the backoff, and those requests go to the
:class:`~gateway.core.poison.Quarantine`, which refuses them if they come again. The backoff grows only
for engines that die again soon after a restart with nothing in flight (a crash loop at start-up).
By default the watchdog never gives up; with ``max_restarts`` set it stops after that many restarts
with no ``stable_after_s`` healthy stretch in between, until an operator swaps or reloads the model.
Restarts take the model's swap lock, so they never race a swap or a reload; the backoff wait does
not hold it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from loguru import logger

from engine_guard.shapes import fields_of as _fields
from gateway.config import GatewaySettings, WatchdogSettings
from gateway.control.swap import SwapError, SwapExecutor
from gateway.core.backends import Backend, EngineBackend, RouterBackend
from gateway.core.health import ProgressMark
from gateway.core.state import GatewayState


def backoff_delay(attempt: int, settings: WatchdogSettings) -> float:
    """Seconds to wait before restart number ``attempt`` (0-based) of a streak: doubling, capped."""
    return min(settings.backoff_initial_s * (2**attempt), settings.backoff_max_s)


@dataclass
class ModelHealth:
    """What the watchdog knows about one model's engine (reset when a swap installs a new one)."""

    backend: Backend | None = None
    failures: int = 0  # failed /health probes in a row (with no progress meanwhile)
    progress: ProgressMark | None = None  # the engine's work counters at the last check (None: unknown)
    busy: bool = False  # the last check's probe failed but the engine had made progress
    attempts: int = 0  # restarts in the current streak
    restarts: int = 0  # restarts ever made for this model
    gave_up: bool = False
    last_restart_at: float | None = None
    last_error: str | None = None
    down_since: float | None = None


class Watchdog:
    def __init__(self, state: GatewayState, executor: SwapExecutor) -> None:
        self.state = state
        self.registry = state.registry
        self.executor = executor
        self.metrics = state.metrics
        self.quarantine = state.quarantine
        self.health: dict[tuple[str, int], ModelHealth] = {}  # by (model, replica)
        self._restarting: dict[tuple[str, int], asyncio.Task[None]] = {}

    async def run(self) -> None:
        """Check forever (cancel to stop)."""
        while True:
            await asyncio.sleep(self.state.settings.watchdog.interval_s)
            settings = self.state.settings  # read after the sleep: a reload meanwhile applies to this check
            if settings.watchdog.enabled:
                await self.check_all(settings)

    async def check_all(self, settings: GatewaySettings) -> None:
        owned = [
            (r.name, b) for r in self.registry.routes() for b in r.replicas
            if isinstance(b, EngineBackend) and self.executor.owns(b) and not b.asleep  # asleep by design: residency's
        ]  # fmt: skip
        await asyncio.gather(*(self._check(name, backend, settings) for name, backend in owned))
        for route in self.registry.routes():  # SGLang's router in front of replicas: restarted when it died
            front = route.front
            if isinstance(front, RouterBackend) and not front.router.running and not self.restarting(route.name, -1):
                logger.error("model {}: its router exited with code {}; restarting it", route.name, front.router.returncode)
                self._restarting[(route.name, -1)] = asyncio.ensure_future(self._restart_router(route.name))

    async def _restart_router(self, name: str) -> None:
        async with self.executor.lock(name):
            try:
                await self.executor.restart_router(name)
            except SwapError as error:
                logger.error("model {}: its router did not come back: {}", name, error.message)

    async def close(self) -> None:
        for task in self._restarting.values():
            task.cancel()
        await asyncio.gather(*self._restarting.values(), return_exceptions=True)

    def restarting(self, name: str, replica: int | None = None) -> bool:
        """A restart of ``name``'s replica (any replica when None) is scheduled or running."""
        return any(
            not task.done() for (model, index), task in self._restarting.items() if model == name and replica in (None, index)
        )

    def model(self, name: str, replica: int = 0) -> ModelHealth:
        """What the watchdog knows about one replica of ``name``."""
        return self.health.setdefault((name, replica), ModelHealth())

    def restarts(self, name: str) -> int:
        """Restarts made for every replica of ``name``."""
        return sum(health.restarts for (model, _), health in self.health.items() if model == name)

    async def _check(self, name: str, backend: EngineBackend, settings: GatewaySettings) -> None:
        key = (name, backend.replica)
        health = self.model(*key)
        if health.backend is not backend:
            # A backend the watchdog did not install (boot, swap, reload): start a fresh record.
            restarts = health.restarts
            health = self.health[key] = ModelHealth(backend=backend, restarts=restarts)
        if self.restarting(*key) or self.executor.lock(name).locked():
            return
        reason = None
        if not backend.engine.running:
            reason = f"engine exited with code {backend.engine.returncode}"
        elif backend.failure is None and not await self._alive(name, backend, health, settings):
            health.failures += 1
            if health.failures >= settings.watchdog.unhealthy_after:
                reason = f"engine failed {health.failures} /health probes in a row with no progress"
        else:
            health.failures = 0
        config = settings.watchdog
        if reason is None:
            if health.down_since is None and health.attempts and health.last_restart_at is not None:
                if time.monotonic() - health.last_restart_at >= config.stable_after_s:
                    health.attempts = 0  # stable again: the next failure starts a new backoff streak
            return
        if health.down_since is None:
            health.down_since = time.monotonic()
            tail = "\n".join(f"    {line}" for line in backend.engine.log_tail(20))
            cause = backend.engine.crash_exception()  # the tail may hold only the frames, or what failed on shutdown
            crashed = f"; it crashed: {cause}" if cause is not None else ""
            logger.error("model {}: {} (pid {}){}; last lines of its log:\n{}", name, reason, backend.engine.pid, crashed, tail)
            self.state.events.record("engine_down", name, False, f"{backend.describe()}: {reason}{crashed}")
            if backend.engine.running and cause is not None:
                await self.executor.end_crashed(backend)  # unhealthy because it crashed: end it now
            if backend.engine.running:
                await self._note_freeze_suspects(name, backend, reason)
            elif await self._note_crash_suspects(name, backend):
                health.attempts = 0  # a request crashed a working engine: restart at once, no backoff
        if health.gave_up:
            return
        if config.max_restarts is not None and health.attempts >= config.max_restarts:
            health.gave_up = True
            backend.failure = (
                f"engine is down ({reason}) and {health.attempts} restart(s) did not help; "
                f"an operator must swap or reload model {name!r}"
            )
            backend.retry_after_s = None
            logger.error("model {}: giving up after {} restart(s)", name, health.attempts)
            return
        delay = backoff_delay(health.attempts, config)
        health.attempts += 1
        of = f" of {config.max_restarts}" if config.max_restarts is not None else ""
        backend.failure = f"{reason}; restarting (attempt {health.attempts}{of})"
        backend.retry_after_s = max(1, int(delay) + 1)
        self._restarting[key] = asyncio.ensure_future(self._restart(name, backend, delay, health))
        await self.executor.sync_router(name)  # out of the router's list until it is back

    async def _note_crash_suspects(self, name: str, backend: EngineBackend) -> bool:
        """True when a request most likely crashed the engine: it died of an exception (its log says
        so) with requests in flight. Those requests go to the quarantine."""
        await _settled(backend)  # every request upstream at the crash has seen its connection break (noted if lost)
        if self.state.peers is not None:  # and the worker processes report theirs
            await self.state.peers.settle(2.0)
        suspects = list(backend.lost)
        backend.lost.clear()
        cause = backend.engine.crash_exception()
        if not suspects or cause is None:
            if suspects:
                logger.warning("model {}: the engine was killed with {} request(s) in flight (no crash in its log)", name, len(suspects))
            return False
        refused = self.quarantine.engine_failed(name, suspects, f"crashed: {cause}")
        logger.warning(
            "model {}: the engine crashed ({}) with {} request(s) in flight; {} request shape(s) are now refused",
            name, cause, len(set(suspects)), len(refused),
        )  # fmt: skip
        self._log_gaps(name, refused, f"crashed ({cause})")
        return True

    async def _note_freeze_suspects(self, name: str, backend: Backend, reason: str) -> None:
        """An engine that stopped answering /health while running froze on something (a pattern that
        backtracks forever, a fan-out it cannot get through): every request upstream on it is a suspect,
        streams that already produced tokens included (a freeze can come at any decode step), and those that left
        in the last ``watchdog.suspect_linger_s`` while the engine could still be working for them (a grammar compile
        goes on after its client gave up), in this process and in the worker processes."""
        suspects = backend.suspects(self.state.settings.watchdog.suspect_linger_s)  # those that left while their work goes on too
        if self.state.peers is not None:
            suspects += await self.state.peers.upstream_shapes(name, backend.identity, 2.0)
        if not suspects:
            return
        refused = self.quarantine.engine_failed(name, suspects, f"froze: {reason}")
        logger.warning(
            "model {}: the engine froze ({}) with {} request(s) in flight; {} request shape(s) are now refused",
            name, reason, len(suspects), len(refused),
        )  # fmt: skip
        self._log_gaps(name, refused, f"froze ({reason})")

    @staticmethod
    def _log_gaps(name: str, shapes: list[str], what: str) -> None:
        """A request that took an engine down got past the allowlist and its bounds: a gap to close there."""
        for shape in shapes:
            fields = ", ".join(_fields(shape)) or "none"
            logger.error("allowlist gap: a request with fields [{}] {} the engine of model {}; its shape is quarantined: {}", fields, what, name, shape[:500])

    async def _alive(self, name: str, backend: Backend, health: ModelHealth, settings: GatewaySettings) -> bool:
        """One ``/health`` probe, and beside it one read of the engine's work counters: alive when the probe passed,
        or when it failed but a second read, once it failed, finds the counters moved since the previous check (busy:
        the probe waited behind the batch). The second read comes after the failure so that an engine that froze
        while the probe waited is not excused by the work it did before; it is skipped when the first read got no
        answer either (frozen for the whole check), so a frozen engine's checks take no longer than the probe."""
        probes = self.state.probes
        if probes is None:
            return True
        timeout_s = settings.watchdog.progress_timeout_s
        healthy, progress = await asyncio.gather(probes.healthy(backend, settings.health_timeout_s), probes.progress(backend, timeout_s))
        before = health.progress if health.progress is not None else progress
        if not healthy and progress is not None:
            progress = await probes.progress(backend, timeout_s)
        health.progress = progress
        if healthy or progress is None or progress == before:
            health.busy = False
            return healthy
        self.metrics.engine_busy_probes.labels(name).inc()
        if not health.busy:  # once per busy stretch: under a long overload this would repeat every check
            health.busy = True
            logger.warning(
                "model {}: {} missed its /health probe but its work counters moved since the last check: busy, not frozen"
                " (missed probes are not counted while it makes progress)", name, backend.describe(),
            )  # fmt: skip
        return True

    async def _restart(self, name: str, backend: EngineBackend, delay: float, health: ModelHealth) -> None:
        await asyncio.sleep(delay)
        async with self.executor.lock(name):
            route = self.registry.route(name)
            if route is None or backend not in route.replicas:
                return  # swapped or removed meanwhile: nothing to restart
            health.restarts += 1
            self.metrics.engine_restarts.labels(name).inc()
            logger.warning("model {}: restarting {} (attempt {})", name, backend.describe(), health.attempts)
            started = time.monotonic()
            try:
                new = await self.executor.restart(name, backend)
            except SwapError as error:
                self.metrics.engine_restart_failures.labels(name).inc()
                health.last_error = error.message
                tail = "\n".join(f"    {line}" for line in error.log_tail[-20:])
                logger.error("model {}: restart failed: {}\n{}", name, error.message, tail)
                self.state.events.record("restart", name, False, f"attempt {health.attempts}: {error.message}")
                backend.failure = f"engine is down; restart {health.attempts} failed, retrying"
                return
        outage = time.monotonic() - (health.down_since or started)
        logger.info("model {}: back in rotation at {} after {:.1f}s down", name, new.url, outage)
        self.state.events.record("restart", name, True, f"back in rotation at {new.url} after {outage:.1f}s down")
        self.health[(name, new.replica)] = ModelHealth(
            backend=new, attempts=health.attempts, restarts=health.restarts, last_restart_at=time.monotonic(), last_error=health.last_error
        )


CRASH_SETTLE_S = 5.0
"""The longest the watchdog waits, after an engine's death, for the requests that were upstream to see it."""


async def _settled(backend: Backend, timeout_s: float = CRASH_SETTLE_S) -> None:
    """Wait until each request that is upstream on ``backend`` now has ended (a broken one is in ``backend.lost`` by
    then: the proxy notes it before it lets go), at most ``timeout_s``. A fixed pause was not enough: on a loaded
    machine a bystander's broken connection was noted after the suspects were counted, so the crash looked like the
    crashing request's alone (or, the other way round, a bystander's). Requests that arrive meanwhile are not waited
    for."""
    pending = set(backend.active)
    deadline = time.monotonic() + timeout_s
    while pending & backend.active and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
