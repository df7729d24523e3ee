"""Make a deployment the one in force: names and limits at once, then engines started, swapped or retired.

Boot and reload are one path: a boot applies the deployment to an empty registry, a reload applies the
re-read file to the current one, both planned by :func:`gateway.control.reload.plan_reload`. Models whose
backend changes are swapped concurrently, each under its own lock (a model with several replicas one
replica at a time by default); removed models stop taking requests at once and are drained. A model whose
new engine fails keeps its old one, and the effective deployment remembers the old engine, so the next
reload retries.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from functools import partial

from loguru import logger

from gateway.config import GatewaySettings, SwapPolicy
from gateway.control.adapters import AdapterSync
from gateway.control.reload import Action, ModelChange, ReloadPlan
from gateway.control.residency import Spawn, dormant, starts_asleep
from gateway.control.swap import BackendFactory, SwapError, SwapExecutor, SwapResult, describe_backend
from gateway.core.backends import Backend, DormantBackend, EngineBackend, RouterBackend
from gateway.core.limits import ConcurrencyLimiter
from gateway.core.registry import ModelRoute, adapter_aliases, url_backend
from gateway.core.state import GatewayState
from launch.config import ConfigError, DeploymentConfig, ModelEntry
from launch.preflight import visible_gpu_count
from launch.process import new_engine_key
from launch.replicas import replica_engines, visible_gpu_ids


class DeploymentApplier:
    """Applies planned deployment changes to the registry and the engines; holds the deployment in force."""

    def __init__(
        self, state: GatewayState, executor: SwapExecutor, spawn: Spawn, deployment: DeploymentConfig | None
    ) -> None:
        self.state = state
        self.registry = state.registry
        self.executor = executor
        self._deployment = deployment  # in force: what the last apply achieved (failed models keep their old source)
        self._changed = asyncio.Event()  # set (and replaced) each time another deployment is in force
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop of those waiting for a change
        self._spawn = spawn  # the controller's: a client hanging up cannot cut an apply in half
        self._keys: dict[str, str] = {}  # one engine key per model (see model_key)

    @property
    def deployment(self) -> DeploymentConfig | None:
        """The deployment in force."""
        return self._deployment

    @deployment.setter
    def deployment(self, deployment: DeploymentConfig | None) -> None:
        self._deployment = deployment
        changed, self._changed = self._changed, asyncio.Event()
        loop = self._loop
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:  # set from a thread without a loop (a test's): the waiters are told in their loop
            here = None
        if loop is None or here is loop:
            changed.set()
        elif not loop.is_closed():
            loop.call_soon_threadsafe(changed.set)

    async def deployment_changed(self) -> None:
        """Until another deployment is in force (a boot's or a reload's apply): what watches the deployment sleeps
        on this, not on a timer."""
        self._loop = asyncio.get_running_loop()
        await self._changed.wait()

    async def apply(
        self, new: DeploymentConfig, settings: GatewaySettings, plan: ReloadPlan, *, fail_fast: bool = False
    ) -> dict[str, SwapResult]:
        """Make ``new`` the deployment in force; the result of every model whose backend was started or swapped.
        ``fail_fast`` (a boot): the first failed start makes the others give up, and its result comes first
        (the others then failed only because they gave up)."""
        self.state.settings = settings
        removed = self._apply_routes(new, settings)
        work = [
            self._spawn(self._apply_backend(change, settings))
            for change in plan.changes
            if _needs_backend(change) and not self._stays_asleep(change.name)
        ]
        work += [
            self._spawn(self._retire(name, backend))
            for name, route in removed
            for backend in (*route.replicas, *([route.front] if route.front is not None else []))
        ]
        first: list[SwapResult] = []
        if fail_fast:
            for finished in asyncio.as_completed(work):
                outcome = await finished
                if isinstance(outcome, SwapResult) and not outcome.ok:
                    first.append(outcome)
                    self.executor.fleet.give_up_starts()
                    break
        outcomes = await asyncio.gather(*work)
        results = {result.model: result for result in [*first, *outcomes] if isinstance(result, SwapResult)}
        self.deployment = _effective(new, plan, results)
        return results

    def _apply_routes(self, new: DeploymentConfig, settings: GatewaySettings) -> list[tuple[str, ModelRoute]]:
        """Install the new names, aliases and limits at once (backends unchanged); drop removed models."""
        current = {route.name: route for route in self.registry.routes()}
        routes = []
        for name, entry in new.models.items():
            limits = settings.limits_for(name)
            route = current.get(name)
            if route is None:
                if entry.engine is None:  # an added url model is ready at once
                    routes.append(
                        ModelRoute(name, url_backend(name, entry), tuple(entry.aliases), ConcurrencyLimiter(limits))
                    )
                elif starts_asleep(entry):  # an on-demand engine: listed at once, started by its first request
                    routes.append(
                        ModelRoute(
                            name, dormant(name, entry.replicas), tuple(entry.aliases), ConcurrencyLimiter(limits),
                            adapters=tuple(entry.adapters), adapter_aliases=adapter_aliases(entry),
                        )  # fmt: skip
                    )
                continue  # an added engine joins when ready
            limiter = route.limiter if route.limiter.settings == limits else ConcurrencyLimiter(limits)
            # adapters the running engines lack (the YAML added them) are routed once the swap's new engines serve them
            adapters = tuple(entry.adapters) if route.asleep else tuple(a for a in entry.adapters if a in route.adapters)
            routes.append(
                replace(route, aliases=tuple(entry.aliases), limiter=limiter, adapters=adapters, adapter_aliases=adapter_aliases(entry))
            )
        self.registry.replace(routes)
        return [(name, route) for name, route in current.items() if name not in new.models]

    def _stays_asleep(self, name: str) -> bool:
        """An asleep model's changed engine is not started: its next request starts the new one."""
        route = self.registry.route(name)
        return route is not None and route.asleep

    async def _apply_backend(self, change: ModelChange, settings: GatewaySettings) -> SwapResult:
        name, entry = change.name, change.new
        assert entry is not None
        async with self.executor.lock(name):
            try:
                builds = self.builds(name, entry)
            except ConfigError as error:
                return SwapResult(name, change.swap_policy, error=str(error))
            if self.registry.route(name) is None:  # added (or its earlier addition failed)
                result = await self._add(name, entry, builds, change.swap_policy, settings)
            elif change.action is Action.ADAPTERS_CHANGED:  # loaded into and unloaded from the running engines
                return await AdapterSync(self.state).apply(name, entry, SwapResult(name, change.swap_policy))
            elif change.details == ("router",):  # only the router in front changed: the engines stay
                result = SwapResult(name, change.swap_policy, ok=True, replicas=len(builds))
            else:
                port = entry.engine.port if entry.engine is not None else 0
                policy = resolve_policy(change.swap_policy, entry.replicas)
                result = await self.executor.swap(name, builds, policy, fixed_port=port)
            if result.ok:
                route = self.registry.route(name)
                if route is not None and route.adapters != tuple(entry.adapters):  # the new engines load them all
                    self.registry.put(replace(route, adapters=tuple(entry.adapters)))
                try:
                    await self._ensure_router(name, entry)
                except SwapError as error:
                    result.ok, result.error, result.log_tail, result.cause = (
                        False,
                        error.message,
                        error.log_tail,
                        error.cause,
                    )
            return result

    async def _add(
        self, name: str, entry: ModelEntry, builds: list[BackendFactory], policy: SwapPolicy, settings: GatewaySettings
    ) -> SwapResult:
        result = SwapResult(name, policy, replicas=len(builds))
        started = time.monotonic()
        try:
            replicas = await self.executor.build_all(name, builds)
        except SwapError as error:
            result.error, result.log_tail, result.cause = error.message, error.log_tail, error.cause
            return result
        limiter = ConcurrencyLimiter(settings.limits_for(name))
        self.registry.put(
            ModelRoute(name, tuple(replicas), tuple(entry.aliases), limiter, adapters=tuple(entry.adapters), adapter_aliases=adapter_aliases(entry))
        )
        result.ok, result.new, result.start_s = True, describe_backend(replicas[0]), time.monotonic() - started
        logger.info("model {}: added, served by {}", name, ", ".join(backend.describe() for backend in replicas))
        return result

    async def _ensure_router(self, name: str, entry: ModelEntry) -> None:
        """Start, restart (its config changed) or stop SGLang's router in front of ``name``'s replicas."""
        route = self.registry.route(name)
        if route is None:
            return
        front = route.front
        wanted = entry.router
        if isinstance(front, RouterBackend) and wanted == front.router.config and front.router.running:
            await self.executor.sync_router(name)
            return
        first = route.backend
        if wanted is not None and entry.engine is not None and isinstance(first, EngineBackend):
            tokenizer = entry.engine.tokenizer_path or first.engine.config.model_path
            new_front = await self.executor.router_front(name, wanted, self.model_key(name), tokenizer)
            current = self.registry.route(name)
            if current is not None:
                self.registry.put(replace(current, front=new_front))
        elif front is not None:
            current = self.registry.route(name)
            if current is not None:
                self.registry.put(replace(current, front=None))
        await self.executor.fleet.stop_router(front)

    def model_key(self, name: str) -> str:
        """The one API key of all engines of a model, kept across swaps and restarts: SGLang's router, which may be
        put in front of running replicas later, holds one key for all of its workers."""
        return self._keys.setdefault(name, new_engine_key())

    def engine_builds(self, name: str, replicas: tuple[Backend, ...]) -> list[BackendFactory]:
        """One maker per replica of a running model, each a fresh engine of that replica's config (a swap)."""
        key = self.model_key(name)
        start = self.executor.fleet.start_engine
        return [
            partial(start, name, backend.engine.config, replica=backend.replica, api_key=key)
            for backend in replicas if isinstance(backend, EngineBackend)
        ]  # fmt: skip

    def builds(self, name: str, entry: ModelEntry) -> list[BackendFactory]:
        """One backend maker per replica of ``entry`` (ConfigError when its replicas do not fit the GPUs)."""
        if entry.engine is None:

            async def url() -> Backend:
                return url_backend(name, entry)

            return [url]
        configs = replica_engines(entry, visible_gpu_ids(visible_gpu_count()))
        key = self.model_key(name)
        start = self.executor.fleet.start_engine
        return [partial(start, name, config, replica=index, api_key=key) for index, config in enumerate(configs)]

    async def _retire(self, name: str, backend: Backend) -> None:  # a removed model's replica (or router)
        if isinstance(backend, DormantBackend):
            return  # an asleep model: no engine to drain or stop
        if isinstance(backend, RouterBackend):
            await self.executor.fleet.stop_router(backend)
            return
        logger.info("model {}: removed; draining {}", name, backend.describe())
        await self.executor.drainer.retire(name, backend)


def resolve_policy(policy: SwapPolicy, replicas: int) -> SwapPolicy:
    """``auto``: blue-green for one engine, one replica at a time (rolling) for several."""
    if policy == "auto":
        return "rolling" if replicas > 1 else "blue-green"
    return policy


def _needs_backend(change: ModelChange) -> bool:
    return change.action in (Action.ENGINE_CHANGED, Action.ADAPTERS_CHANGED) or (
        change.action is Action.ADDED and change.needs_engine_start
    )


def _effective(new: DeploymentConfig, plan: ReloadPlan, results: dict[str, SwapResult]) -> DeploymentConfig:
    """The config actually in force: ``new``, except that failed models keep their old backend source."""
    models = dict(new.models)
    for change in plan.changes:
        result = results.get(change.name)
        if result is None or result.ok:
            continue
        if change.old is None:
            models.pop(change.name, None)
        elif result.lora_paths is not None:  # some adapters failed to load: in force without them (a reload retries)
            assert change.new is not None and change.new.engine is not None
            served = {name: path for name, path in change.new.adapters.items() if name in result.lora_paths}
            engine = change.new.engine.model_copy(update={"lora_paths": result.lora_paths})
            models[change.name] = change.new.model_copy(update={"adapters": served, "engine": engine})
        else:
            assert change.new is not None
            old = change.old
            models[change.name] = ModelEntry.model_construct(
                engine=old.engine,
                url=old.url,
                served_model_name=old.served_model_name,
                api_key=old.api_key,
                vocab_size=old.vocab_size,
                enable_priority_scheduling=old.enable_priority_scheduling,
                aliases=list(change.new.aliases),
                replicas=old.replicas,
                replica_gpus=old.replica_gpus,
                router=old.router,
                residency=change.new.residency,
                adapters=old.adapters,
                adapter_aliases=old.adapter_aliases,
            )
    return new.model_copy(update={"models": models})


def empty_deployment(deployment: DeploymentConfig) -> DeploymentConfig:
    """What a gateway serves before its boot: nothing (the boot is a reload from this)."""
    return DeploymentConfig.model_construct(models={}, gateway=deployment.gateway, source=deployment.source)
