"""The gateway's control plane: boot, reload the YAML, swap or drain a model, supervise engines.

Boot and reload are one path (:class:`~gateway.control.applier.DeploymentApplier`): a boot applies the
deployment to an empty registry, a reload the re-read file to the current one. A boot fails fast: the
first model that cannot start stops the others and the gateway does not serve.

A reload is validated whole before anything changes (an invalid file changes nothing and raises
:class:`ReloadInvalid` naming file, key and reason); live gateway settings (keys, limits, drain
timeout...) then apply at once, and the applier does the rest. Reloads are serialized; a reload runs as
its own task, so a client that hangs up cannot cut one in half.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loguru import logger

from gateway.config import GatewaySettings, SwapPolicy, gateway_settings
from gateway.control.applier import DeploymentApplier, empty_deployment, resolve_policy
from gateway.control.reload import ReloadPlan, plan_reload
from gateway.control.residency import Residency
from gateway.control.swap import SwapError, SwapExecutor, SwapResult
from gateway.control.watchdog import Watchdog
from gateway.core.backends import EngineBackend
from gateway.core.errors import GatewayError
from gateway.core.registry import ModelRoute
from gateway.core.state import GatewayState
from gateway.edge.auth import KeyHolder, key_policy
from gateway.tenants.keys import tenants_of
from launch.config import ConfigError, DeploymentConfig, load_config

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
    """Boot, reload, swap and drain on request (admin API, SIGHUP, file watch), and supervision (the watchdog)."""

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
        in_force = empty_deployment(deployment) if boot and deployment is not None else deployment
        self.applier = DeploymentApplier(state, executor, self._spawn, in_force)
        self.residency = Residency(state, self.applier, executor, self._spawn)  # models that start on demand and sleep when idle

    # ------------------------------------------------------------------ lifecycle
    async def boot(self) -> None:
        """Apply the deployment to the empty registry, the way a reload applies a changed file; the first
        model that cannot start stops the others and raises (its engine's error, with its log tail)."""
        deployment, self._to_boot = self._to_boot, None
        if deployment is None:
            return
        started = time.monotonic()
        plan = plan_reload(self.applier.deployment, self.state.settings, deployment, self.state.settings)  # type: ignore[arg-type]
        outcome = await self._apply(deployment, self.state.settings, plan, "boot", fail_fast=True)
        if self.executor.fleet.aborted:
            raise StartAborted("shutdown requested while the engines were starting")
        if not outcome.ok:
            name = outcome.failed[0]
            result = outcome.results[name]
            raise result.cause or SwapError(name, result.error or "failed", result.log_tail)
        engines = [f"{r.name} at {', '.join(b.url for b in r.replicas)}" for r in self.registry.routes() if isinstance(r.backend, EngineBackend)]
        if engines:
            logger.info("engines ready in {:.1f}s: {}", time.monotonic() - started, "; ".join(engines))

    def abort_start(self) -> None:
        """Make a boot in progress stop its engines and give up (safe from a signal handler)."""
        self.executor.fleet.abort_starts()

    async def start(self) -> None:
        """Begin supervision (and file watching); called by the lifespan once the engines are ready."""
        self._loop = asyncio.get_running_loop()
        self._spawn(self.watchdog.run())
        self._spawn(self.residency.run())
        if self.watch and self.config_path is not None:
            self._spawn(self._watch_file(self.config_path))

    async def close(self) -> None:
        """Stop supervision, abandon reloads in progress, stop every engine the gateway owns."""
        self._loop = None
        for task in list(self._tasks):
            task.cancel()
        await self.watchdog.close()
        await self.executor.fleet.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_failure)
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
        assert self.config_path is not None and self.applier.deployment is not None
        async with self._reload_lock:
            started = time.monotonic()
            try:
                new = load_config(self.config_path)
                new_settings = gateway_settings(new, **self.overrides)
                policy = key_policy(
                    tenants_of(new_settings, str(new.source)), new_settings.resolved_admin_keys(str(new.source)), new_settings.open_paths,
                    new_settings.resolved_metrics_keys(str(new.source)),
                )
            except ConfigError as error:
                self.state.metrics.reloads.labels("invalid").inc()
                self.state.events.record("reload", None, False, f"{trigger}: invalid config, nothing changed: {_first_line(error)}")
                logger.error("reload ({}): invalid config, nothing changed:\n{}", trigger, error)
                self.last_reload = ReloadOutcome(trigger, str(self.config_path), error=str(error))
                raise ReloadInvalid(str(error)) from None
            plan = plan_reload(self.applier.deployment, self.state.settings, new, new_settings)
            logger.info("reload ({}): {}", trigger, {k: v for k, v in plan.summary().items() if k != "unchanged"} or "no change")
            if plan.restart_required:
                logger.warning("reload ({}): changed keys need a restart and were ignored: gateway.{}", trigger, ", gateway.".join(plan.restart_required))
            settings = new_settings.model_copy(update={k: getattr(self.state.settings, k) for k in plan.restart_required})
            self.keys.policy = policy
            outcome = await self._apply(new, settings, plan, trigger, started=started)
            self.last_reload = outcome
            self.state.metrics.reloads.labels("ok" if outcome.ok else "partial").inc()
            changes = {k: v for k, v in plan.summary().items() if k != "unchanged"}
            self.state.events.record("reload", None, outcome.ok, f"{trigger}: {_summary(changes)}")
            for name, result in outcome.results.items():
                self._note_swap(name, result)
                if not result.ok:
                    tail = "\n".join(f"    {line}" for line in result.log_tail[-30:])
                    logger.error("reload ({}): model {}: {}; it keeps its previous backend\n{}", trigger, name, result.error, tail)
            return outcome

    async def _apply(
        self, new: DeploymentConfig, settings: GatewaySettings, plan: ReloadPlan, trigger: str, *,
        fail_fast: bool = False, started: float | None = None,
    ) -> ReloadOutcome:  # fmt: skip
        started = time.monotonic() if started is None else started
        results = await self.applier.apply(new, settings, plan, fail_fast=fail_fast)
        for name, result in results.items():
            if result.ok:
                self.last_errors.pop(name, None)
            else:
                self.last_errors[name] = result.error or "failed"
        return ReloadOutcome(trigger, str(self.config_path), plan=plan, results=results, duration_s=time.monotonic() - started)

    @property
    def deployment(self) -> DeploymentConfig | None:
        """The deployment in force (a model whose new engine failed keeps its old source here)."""
        return self.applier.deployment

    def swap_policy_for(self, name: str) -> SwapPolicy:
        route = self.registry.route(name)
        return resolve_policy(self.state.settings.swap_policy_for(name), len(route.replicas) if route else 1)

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
            chosen = resolve_policy(policy or self.state.settings.swap_policy_for(name), len(route.replicas))
            builds = self.applier.engine_builds(name, route.replicas)
            first = route.backend
            port = first.engine.config.port if isinstance(first, EngineBackend) else 0
            result = await self.executor.swap(name, builds, chosen, fixed_port=port)
        self._note_swap(name, result)
        if result.ok:
            self.last_errors.pop(name, None)
        else:
            self.last_errors[name] = result.error or "failed"
        return result

    def _note_swap(self, name: str, result: SwapResult) -> None:
        if result.adapters is not None:  # adapters loaded into the running engines: no swap
            said = ", ".join(f"{adapter} {outcome}" for adapter, outcome in result.adapters.items())
            self.state.events.record("adapters", name, result.ok, said or "unchanged")
            return
        self.state.metrics.swaps.labels(name, "ok" if result.ok else "failed").inc()
        took = f" in {result.start_s:.1f}s" if result.start_s is not None else ""
        detail = f"{result.policy}: new backend ready{took}" if result.ok else f"{result.policy}: {result.error or 'failed'}; the old backend serves on"
        self.state.events.record("swap", name, result.ok, detail)

    def _managed_route(self, name: str) -> ModelRoute:
        route = self.registry.route(name) or self.registry.resolve(name)
        if route is None:
            raise GatewayError(404, f"no model named {name!r}", code="model_not_found", param="name")
        if route.asleep:
            raise GatewayError(409, f"model {route.name!r} is asleep (residency): its next request starts its engine with the config in force; nothing to swap", code="model_asleep")
        if not self.executor.owns(route.backend):
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


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _summary(changes: dict[str, list[str]]) -> str:
    """``{"added": ["a"], "swapped": ["b"]}`` -> ``added a; swapped b`` (no change: ``no change``)."""
    return "; ".join(f"{action} {', '.join(names)}" for action, names in changes.items()) or "no change"


def _log_failure(task: asyncio.Task[Any]) -> None:
    """Retrieve a spawned task's failure and log it in one line: whoever waited for it may be gone (a request
    that timed out while a residency start waited for room), and asyncio would otherwise print "Task exception
    was never retrieved" with a traceback when the task is collected."""
    if task.cancelled() or (error := task.exception()) is None:
        return
    if isinstance(error, SwapError):
        logger.warning("model {}: {} (nobody waits for it any more, or each waiter was told)", error.model, error)
    else:
        logger.opt(exception=error).error("gateway: background task {} failed", task.get_name())
