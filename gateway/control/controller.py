"""The gateway's control plane: boot, reload the YAML, swap or drain a model, supervise engines.

Boot and reload are one path: :meth:`Controller.boot` applies the deployment to an empty registry,
a reload applies the re-read file to the current one, both through :meth:`Controller._apply` and
:func:`gateway.control.reload.plan_reload`. A boot fails fast: the first model that cannot start stops the
others and the gateway does not serve.

A reload is validated whole before anything changes (an invalid file changes nothing and raises
:class:`ReloadInvalid` naming file, key and reason). Then, in this order: live gateway settings
(keys, limits, drain timeout...) and alias/limit changes apply at once in one registry assignment;
models whose backend changes are swapped concurrently, each under its own lock (a model with several
replicas is swapped one replica at a time by default); removed models stop taking requests at once and
are drained. A model whose new engine fails keeps its old one (and the effective config remembers the
old engine, so the next reload retries). Reloads are serialized; a reload runs as its own task, so a
client that hangs up cannot cut one in half.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from loguru import logger

from gateway.config import GatewaySettings, SwapPolicy, gateway_settings
from gateway.control.reload import Action, ModelChange, ReloadPlan, plan_reload
from gateway.control.swap import BackendFactory, SwapError, SwapExecutor, SwapResult, describe_backend
from gateway.control.watchdog import Watchdog
from gateway.core.errors import GatewayError
from gateway.core.limits import ConcurrencyLimiter
from gateway.core.registry import Backend, ModelRoute, url_backend
from gateway.core.state import GatewayState
from gateway.edge.auth import KeyHolder, key_policy
from launch.config import ConfigError, DeploymentConfig, ModelEntry, load_config
from launch.preflight import visible_gpu_count
from launch.process import new_engine_key
from launch.replicas import replica_engines, visible_gpu_ids

WATCH_INTERVAL_S = 1.0


class ReloadInvalid(Exception):
    """The new config file cannot be used; nothing was changed."""


class StartAborted(Exception):
    """Shutdown was requested while the engines were still starting."""


@dataclass
class ReloadOutcome:
    """What one reload did (rendered for the admin API by :func:`gateway.control.admin.reload_report`)."""

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
        boot: bool = False,
    ) -> None:
        self.state = state
        self.registry = state.registry
        self.keys = keys
        self.executor = executor
        # The config in force: ``boot`` starts from nothing and applies ``deployment`` (see :meth:`boot`).
        self._to_boot = deployment if boot else None
        self.deployment = _empty(deployment) if boot and deployment is not None else deployment
        self.config_path: Path | None = deployment.source if deployment is not None else None
        self.overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
        self.watch = watch
        self.watchdog = Watchdog(state, executor)
        self.last_reload: ReloadOutcome | None = None
        self.last_errors: dict[str, str] = {}
        self._keys: dict[str, str] = {}  # one engine key per model (see _model_key)
        self._reload_lock = asyncio.Lock()
        self._swaps: dict[str, asyncio.Task[SwapResult]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ lifecycle
    async def boot(self) -> None:
        """Apply the deployment to the empty registry, the way a reload applies a changed file; the first
        model that cannot start stops the others and raises (its engine's error, with its log tail)."""
        deployment, self._to_boot = self._to_boot, None
        if deployment is None:
            return
        started = time.monotonic()
        plan = plan_reload(self.deployment, self.state.settings, deployment, self.state.settings)  # type: ignore[arg-type]
        outcome = await self._apply(deployment, self.state.settings, plan, "boot", fail_fast=True)
        if self.executor.aborted:
            raise StartAborted("shutdown requested while the engines were starting")
        if not outcome.ok:
            name = outcome.failed[0]
            result = outcome.results[name]
            raise result.cause or SwapError(name, result.error or "failed", result.log_tail)
        engines = [f"{r.name} at {', '.join(b.url for b in r.replicas)}" for r in self.registry.routes() if r.backend.managed]
        if engines:
            logger.info("engines ready in {:.1f}s: {}", time.monotonic() - started, "; ".join(engines))

    def abort_start(self) -> None:
        """Make a boot in progress stop its engines and give up (safe from a signal handler)."""
        self.executor.abort_starts()

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
            self.keys.policy = policy
            outcome = await self._apply(new, settings, plan, trigger, started=started)
            self.last_reload = outcome
            self.state.metrics.reloads.labels("ok" if outcome.ok else "partial").inc()
            for name, result in outcome.results.items():
                self.state.metrics.swaps.labels(name, "ok" if result.ok else "failed").inc()
                if not result.ok:
                    tail = "\n".join(f"    {line}" for line in result.log_tail[-30:])
                    logger.error("reload ({}): model {}: {}; it keeps its previous backend\n{}", trigger, name, result.error, tail)
            return outcome

    async def _apply(
        self, new: DeploymentConfig, settings: GatewaySettings, plan: ReloadPlan, trigger: str, *,
        fail_fast: bool = False, started: float | None = None,
    ) -> ReloadOutcome:  # fmt: skip
        """Make ``new`` the deployment in force: routes at once, then engines (started, swapped or retired)."""
        started = time.monotonic() if started is None else started
        self.state.settings = settings
        removed = self._apply_routes(new, settings)
        work = [self._spawn(self._apply_backend(change, settings)) for change in plan.changes if _needs_backend(change)]
        work += [
            self._spawn(self._retire(name, backend))
            for name, route in removed
            for backend in (*route.replicas, *([route.front] if route.front is not None else []))
        ]
        if fail_fast:  # the first failed start stops the others' starts
            for finished in asyncio.as_completed(work):
                outcome = await finished
                if isinstance(outcome, SwapResult) and not outcome.ok:
                    self.executor.abort_starts()
        outcomes = await asyncio.gather(*work)
        results = {result.model: result for result in outcomes if isinstance(result, SwapResult)}
        self.deployment = _effective(new, plan, results)
        for name, result in results.items():
            if result.ok:
                self.last_errors.pop(name, None)
            else:
                self.last_errors[name] = result.error or "failed"
        return ReloadOutcome(trigger, str(self.config_path), plan=plan, results=results, duration_s=time.monotonic() - started)

    def _apply_routes(self, new: DeploymentConfig, settings: GatewaySettings) -> list[tuple[str, ModelRoute]]:
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
            routes.append(replace(route, aliases=tuple(entry.aliases), limiter=limiter))
        self.registry.replace(routes)
        return [(name, route) for name, route in current.items() if name not in new.models]

    async def _apply_backend(self, change: ModelChange, settings: GatewaySettings) -> SwapResult:
        name, entry = change.name, change.new
        assert entry is not None
        async with self.executor.lock(name):
            try:
                builds = self._builds(name, entry)
            except ConfigError as error:
                return SwapResult(name, change.swap_policy, error=str(error))
            if self.registry.route(name) is None:  # added (or its earlier addition failed)
                result = SwapResult(name, change.swap_policy, replicas=len(builds))
                started = time.monotonic()
                try:
                    replicas = await self.executor.build_all(name, builds)
                except SwapError as error:
                    result.error, result.log_tail, result.cause = error.message, error.log_tail, error.cause
                    return result
                limiter = ConcurrencyLimiter(settings.limits_for(name))
                self.registry.put(ModelRoute(name, tuple(replicas), tuple(entry.aliases), limiter))
                result.ok, result.new, result.start_s = True, describe_backend(replicas[0]), time.monotonic() - started
                logger.info("model {}: added, served by {}", name, ", ".join(backend.describe() for backend in replicas))
            elif change.details == ("router",):  # only the router in front changed: the engines stay
                result = SwapResult(name, change.swap_policy, ok=True, replicas=len(builds))
            else:
                port = entry.engine.port if entry.engine is not None else 0
                policy = self._resolve_policy(change.swap_policy, entry.replicas)
                result = await self.executor.swap(name, builds, policy, fixed_port=port)
            if result.ok:
                try:
                    await self._ensure_router(name, entry)
                except SwapError as error:
                    result.ok, result.error, result.log_tail, result.cause = False, error.message, error.log_tail, error.cause
            return result

    async def _ensure_router(self, name: str, entry: ModelEntry) -> None:
        """Start, restart (its config changed) or stop SGLang's router in front of ``name``'s replicas."""
        route = self.registry.route(name)
        if route is None:
            return
        front = route.front
        wanted = entry.router
        if front is not None and front.router is not None and wanted == front.router.config and front.router.running:
            await self.executor.sync_router(name)
            return
        if wanted is not None and entry.engine is not None:
            tokenizer = entry.engine.tokenizer_path or route.backend.engine.config.model_path  # type: ignore[union-attr]
            new_front = await self.executor.router_front(name, wanted, self._model_key(name), tokenizer)
            current = self.registry.route(name)
            if current is not None:
                self.registry.put(replace(current, front=new_front))
        elif front is not None:
            current = self.registry.route(name)
            if current is not None:
                self.registry.put(replace(current, front=None))
        await self.executor.stop_router(front)

    def _model_key(self, name: str) -> str:
        """The one API key of all engines of a model, kept across swaps and restarts: SGLang's router, which may be
        put in front of running replicas later, holds one key for all of its workers."""
        return self._keys.setdefault(name, new_engine_key())

    def _builds(self, name: str, entry: ModelEntry) -> list[BackendFactory]:
        """One backend maker per replica of ``entry`` (ConfigError when its replicas do not fit the GPUs)."""
        if entry.engine is None:

            async def url() -> Backend:
                return url_backend(name, entry)

            return [url]
        configs = replica_engines(entry, visible_gpu_ids(visible_gpu_count()))
        key = self._model_key(name)
        return [partial(self.executor.engine_backend, name, config, replica=index, api_key=key) for index, config in enumerate(configs)]

    def swap_policy_for(self, name: str) -> SwapPolicy:
        route = self.registry.route(name)
        return self._resolve_policy(self.state.settings.swap_policy_for(name), len(route.replicas) if route else 1)

    @staticmethod
    def _resolve_policy(policy: SwapPolicy, replicas: int) -> SwapPolicy:
        """``auto``: blue-green for one engine, one replica at a time (rolling) for several."""
        if policy == "auto":
            return "rolling" if replicas > 1 else "blue-green"
        return policy

    async def _retire(self, name: str, backend: Backend) -> None:  # a removed model's replica (or router)
        if backend.router is not None:
            await self.executor.stop_router(backend)
            return
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
            chosen = self._resolve_policy(policy or self.state.settings.swap_policy_for(name), len(route.replicas))
            key = self._model_key(name)
            builds = [
                partial(self.executor.engine_backend, name, backend.engine.config, replica=backend.replica, api_key=key)  # type: ignore[union-attr]
                for backend in route.replicas
            ]
            result = await self.executor.swap(name, builds, chosen, fixed_port=route.backend.engine.config.port)  # type: ignore[union-attr]
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
        while route.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return route.in_flight == 0


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
                vocab_size=old.vocab_size, aliases=list(change.new.aliases), replicas=old.replicas, replica_gpus=old.replica_gpus,
                router=old.router,
            )
    return new.model_copy(update={"models": models})


def _empty(deployment: DeploymentConfig) -> DeploymentConfig:
    """What a gateway serves before its boot: nothing (the boot is a reload from this)."""
    return DeploymentConfig.model_construct(models={}, gateway=deployment.gateway, source=deployment.source)


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None
