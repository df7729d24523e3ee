"""The gateway's control plane: reload the YAML, swap or drain a model, supervise engines.

A reload is validated whole before anything changes (an invalid file changes nothing and raises
:class:`ReloadInvalid` naming file, key and reason). Then, in this order: live gateway settings
(keys, limits, drain timeout...) and alias/limit changes apply at once in one registry assignment;
models whose backend changes are swapped concurrently, each under its own lock; removed models
stop taking requests at once and are drained. A model whose new engine fails keeps its old one
(and the effective config remembers the old engine, so the next reload retries). Reloads are
serialized; a reload runs as its own task, so a client that hangs up cannot cut one in half.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loguru import logger

from gateway.auth import KeyHolder, key_policy
from gateway.config import GatewaySettings, SwapPolicy, gateway_settings
from gateway.errors import GatewayError
from gateway.limits import ConcurrencyLimiter
from gateway.registry import Backend, ModelRoute, url_backend
from gateway.reload import Action, ModelChange, ReloadPlan, plan_reload
from gateway.state import GatewayState
from gateway.swap import SwapError, SwapExecutor, SwapResult, describe_backend
from gateway.watchdog import Watchdog
from launch.config import ConfigError, DeploymentConfig, ModelEntry, load_config

WATCH_INTERVAL_S = 1.0


class ReloadInvalid(Exception):
    """The new config file cannot be used; nothing was changed."""


@dataclass
class ReloadOutcome:
    """What one reload did (rendered for the admin API by :func:`gateway.admin.reload_report`)."""

    trigger: str
    file: str | None
    at: float = field(default_factory=time.time)
    plan: ReloadPlan | None = None
    results: dict[str, SwapResult] = field(default_factory=dict)
    duration_s: float = 0.0
    error: str | None = None  # the file could not be used: nothing changed

    @property
    def failed(self) -> list[str]:
        return [name for name, result in self.results.items() if not result.ok]

    @property
    def ok(self) -> bool:
        return self.error is None and not self.failed


class Controller:
    def __init__(
        self,
        state: GatewayState,
        keys: KeyHolder,
        executor: SwapExecutor,
        *,
        deployment: DeploymentConfig | None = None,
        overrides: dict[str, Any] | None = None,
        watch: bool = False,
    ) -> None:
        self.state = state
        self.registry = state.registry
        self.keys = keys
        self.executor = executor
        self.deployment = deployment
        self.config_path: Path | None = deployment.source if deployment is not None else None
        self.overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
        self.watch = watch
        self.watchdog = Watchdog(state, executor)
        self.last_reload: ReloadOutcome | None = None
        self.last_errors: dict[str, str] = {}
        self._reload_lock = asyncio.Lock()
        self._swaps: dict[str, asyncio.Task[SwapResult]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Begin supervision (and file watching); called by the lifespan once the engines are ready."""
        self._loop = asyncio.get_running_loop()
        self._spawn(self.watchdog.run())
        if self.watch and self.config_path is not None:
            self._spawn(self._watch_file(self.config_path))

    async def close(self) -> None:
        """Stop supervision, abandon reloads in progress, stop every engine the gateway owns."""
        self._loop = None
        for task in list(self._tasks):
            task.cancel()
        await self.watchdog.close()
        await self.executor.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ------------------------------------------------------------------ reload
    def request_reload(self, trigger: str) -> None:
        """Schedule a reload from any thread (a signal handler): the result is logged."""
        loop = self._loop
        if loop is None:
            logger.warning("{}: ignored, the gateway is not serving yet (or is stopping)", trigger)
            return
        loop.call_soon_threadsafe(lambda: self._spawn(self._logged_reload(trigger)))

    async def _logged_reload(self, trigger: str) -> None:
        try:
            await self.reload(trigger)
        except ReloadInvalid:
            pass  # already logged
        except GatewayError as error:
            logger.error("reload ({}): {}", trigger, error.message)

    async def reload(self, trigger: str = "admin") -> ReloadOutcome:
        """Re-read the config file and apply it; the outcome says what changed and what failed."""
        if self.config_path is None:
            raise GatewayError(400, "this gateway was not started from a config file; nothing to reload", code="no_config_file")
        task = self._spawn(self._reload(trigger))
        return await asyncio.shield(task)

    async def _reload(self, trigger: str) -> ReloadOutcome:
        assert self.config_path is not None and self.deployment is not None
        async with self._reload_lock:
            started = time.monotonic()
            try:
                new = load_config(self.config_path)
                new_settings = gateway_settings(new, **self.overrides)
                policy = key_policy(new_settings.resolved_keys(str(new.source)), new_settings.resolved_admin_keys(str(new.source)), new_settings.open_paths)
            except ConfigError as error:
                self.state.metrics.reloads.labels("invalid").inc()
                logger.error("reload ({}): invalid config, nothing changed:\n{}", trigger, error)
                self.last_reload = ReloadOutcome(trigger, str(self.config_path), error=str(error))
                raise ReloadInvalid(str(error)) from None
            plan = plan_reload(self.deployment, self.state.settings, new, new_settings)
            logger.info("reload ({}): {}", trigger, {k: v for k, v in plan.summary().items() if k != "unchanged"} or "no change")
            if plan.restart_required:
                logger.warning("reload ({}): changed keys need a restart and were ignored: gateway.{}", trigger, ", gateway.".join(plan.restart_required))
            settings = new_settings.model_copy(update={k: getattr(self.state.settings, k) for k in plan.restart_required})
            self.state.settings = settings
            self.keys.policy = policy
            removed = self._apply_routes(new, settings)
            outcomes = await asyncio.gather(
                *(self._apply_backend(change, settings) for change in plan.changes if _needs_backend(change)),
                *(self._retire(name, backend) for name, backend in removed),
            )
            results = {result.model: result for result in outcomes if isinstance(result, SwapResult)}
            self.deployment = _effective(new, plan, results)
            outcome = ReloadOutcome(trigger, str(self.config_path), plan=plan, results=results, duration_s=time.monotonic() - started)
            self.last_reload = outcome
            self.state.metrics.reloads.labels("ok" if outcome.ok else "partial").inc()
            for name, result in results.items():
                self.state.metrics.swaps.labels(name, "ok" if result.ok else "failed").inc()
                if result.ok:
                    self.last_errors.pop(name, None)
                else:
                    self.last_errors[name] = result.error or "failed"
                    tail = "\n".join(f"    {line}" for line in result.log_tail[-30:])
                    logger.error("reload ({}): model {}: {}; it keeps its previous backend\n{}", trigger, name, result.error, tail)
            return outcome

    def _apply_routes(self, new: DeploymentConfig, settings: GatewaySettings) -> list[tuple[str, Backend]]:
        """Install the new names, aliases and limits at once (backends unchanged); drop removed models."""
        current = {route.name: route for route in self.registry.routes()}
        routes = []
        for name, entry in new.models.items():
            limits = settings.limits_for(name)
            route = current.get(name)
            if route is None:
                if entry.engine is None:  # an added url model is ready at once
                    routes.append(ModelRoute(name, url_backend(name, entry), tuple(entry.aliases), ConcurrencyLimiter(limits)))
                continue  # an added engine joins when ready
            limiter = route.limiter if route.limiter.settings == limits else ConcurrencyLimiter(limits)
            routes.append(ModelRoute(name, route.backend, tuple(entry.aliases), limiter, route.drained))
        self.registry.replace(routes)
        return [(name, route.backend) for name, route in current.items() if name not in new.models]

    async def _apply_backend(self, change: ModelChange, settings: GatewaySettings) -> SwapResult:
        name, entry = change.name, change.new
        assert entry is not None
        async with self.executor.lock(name):
            if self.registry.route(name) is None:  # added (or its earlier addition failed)
                result = SwapResult(name, change.swap_policy)
                started = time.monotonic()
                try:
                    backend = await self._build(name, entry)
                except SwapError as error:
                    result.error, result.log_tail = error.message, error.log_tail
                    return result
                limiter = ConcurrencyLimiter(settings.limits_for(name))
                self.registry.put(ModelRoute(name, backend, tuple(entry.aliases), limiter))
                result.ok, result.new, result.start_s = True, describe_backend(backend), time.monotonic() - started
                logger.info("model {}: added, served by {}", name, backend.describe())
                return result
            port = entry.engine.port if entry.engine is not None else 0
            return await self.executor.swap(name, lambda: self._build(name, entry), change.swap_policy, fixed_port=port)

    async def _build(self, name: str, entry: ModelEntry) -> Backend:
        if entry.engine is not None:
            return await self.executor.engine_backend(name, entry.engine)
        return url_backend(name, entry)

    async def _retire(self, name: str, backend: Backend) -> None:
        logger.info("model {}: removed; draining {}", name, backend.describe())
        await self.executor.retire(name, backend)

    async def _watch_file(self, path: Path) -> None:
        """Reload when the file's content changes (polling: no extra dependency, works on any filesystem)."""
        seen = _digest(path)
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            digest = _digest(path)
            if digest is None or digest == seen:
                continue
            await asyncio.sleep(0.3)  # let an editor finish writing
            digest = _digest(path)
            seen = digest
            logger.info("{} changed; reloading", path)
            await self._logged_reload("watch")

    # ------------------------------------------------------------------ swap and drain
    async def swap(self, name: str, policy: SwapPolicy | None = None) -> SwapResult:
        """Replace ``name``'s engine with a fresh one of the same config; concurrent calls share one swap."""
        route = self._managed_route(name)
        task = self._swaps.get(route.name)
        if task is None or task.done():
            task = self._swaps[route.name] = self._spawn(self._swap(route.name, policy))
        return await asyncio.shield(task)

    async def _swap(self, name: str, policy: SwapPolicy | None) -> SwapResult:
        async with self.executor.lock(name):
            route = self._managed_route(name)
            config = route.backend.engine.config  # type: ignore[union-attr]
            chosen = policy or self.state.settings.swap_policy_for(name)

            async def build() -> Backend:
                return await self.executor.engine_backend(name, config, checked=True)

            result = await self.executor.swap(name, build, chosen, fixed_port=config.port)
        self.state.metrics.swaps.labels(name, "ok" if result.ok else "failed").inc()
        if result.ok:
            self.last_errors.pop(name, None)
        else:
            self.last_errors[name] = result.error or "failed"
        return result

    def _managed_route(self, name: str) -> ModelRoute:
        route = self.registry.route(name) or self.registry.resolve(name)
        if route is None:
            raise GatewayError(404, f"no model named {name!r}", code="model_not_found", param="name")
        if not self.executor.owns(route.backend.engine):
            raise GatewayError(400, f"model {route.name!r} is not served by an engine this gateway launched; nothing to swap", code="not_managed")
        return route

    def set_drained(self, name: str, drained: bool) -> ModelRoute:
        route = self.registry.route(name) or self.registry.resolve(name)
        if route is None:
            raise GatewayError(404, f"no model named {name!r}", code="model_not_found", param="name")
        route.drained = drained  # routes are shared by the registry snapshot: this takes effect at once
        logger.info("model {}: {}", route.name, "drained (new requests get 503)" if drained else "undrained")
        return route

    async def wait_idle(self, route: ModelRoute, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while route.backend.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return route.backend.in_flight == 0


def _needs_backend(change: ModelChange) -> bool:
    return change.action is Action.ENGINE_CHANGED or (change.action is Action.ADDED and change.needs_engine_start)


def _effective(new: DeploymentConfig, plan: ReloadPlan, results: dict[str, SwapResult]) -> DeploymentConfig:
    """The config actually in force: ``new``, except that failed models keep their old backend source."""
    models = dict(new.models)
    for change in plan.changes:
        result = results.get(change.name)
        if result is None or result.ok:
            continue
        if change.old is None:
            models.pop(change.name, None)
        else:
            assert change.new is not None
            old = change.old
            models[change.name] = ModelEntry.model_construct(
                engine=old.engine, url=old.url, served_model_name=old.served_model_name, api_key=old.api_key,
                vocab_size=old.vocab_size, aliases=list(change.new.aliases),
            )
    return new.model_copy(update={"models": models})


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None
