"""LoRA adapters changed by a reload, loaded into and unloaded from the running engines through SGLang's API.

SGLang's ``/load_lora_adapter`` and ``/unload_lora_adapter`` change one engine's adapters without a restart, so
a reload that only adds or removes adapters keeps the engines:

- a removed adapter (or one whose path changed) leaves the route first: the gateway answers 404 for it; its
  requests still running finish (the gateway's count, its worker processes' included, bounded by the drain
  timeout; then SGLang's own wait) before every replica unloads it;
- an added adapter is loaded into every replica and routed once all of them serve it. One that fails to load
  on any replica is unloaded from those that took it and reported with the engine's message; the rest of the
  change goes ahead;
- each replica's engine config then names exactly the adapters it serves, so a watchdog restart (which starts
  from that config) and a later swap load them all again. A replica that is down now is not asked: its restart
  loads them from the command line.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from loguru import logger

from gateway.control.engine_api import engine_post
from gateway.control.swap import SwapResult
from gateway.core.backends import EngineBackend
from gateway.core.state import GatewayState
from launch.config import ModelEntry

LOAD, UNLOAD = "/load_lora_adapter", "/unload_lora_adapter"  # SGLang 0.5.23
DRAIN_POLL_S = 0.05


def adapter_change(running: dict[str, str], wanted: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """(adapters to unload, adapters to load: name -> path) to go from ``running`` to ``wanted``; a changed path
    is both."""
    unload = [name for name, path in running.items() if wanted.get(name) != path]
    load = {name: path for name, path in wanted.items() if running.get(name) != path}
    return unload, load


class AdapterSync:
    """Brings a model's running engines to the adapters of its new entry (the caller holds the model's lock)."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self.registry = state.registry

    async def apply(self, name: str, entry: ModelEntry, result: SwapResult) -> SwapResult:
        """Unload, then load; ``result`` gets each adapter's outcome and, when one failed to load, ``ok`` False."""
        route = self.registry.route(name)
        assert route is not None and entry.engine is not None
        engines = [backend for backend in route.replicas if isinstance(backend, EngineBackend)]
        running = dict(engines[0].engine.config.lora_paths) if engines else {}
        unload, load = adapter_change(running, dict(entry.engine.lora_paths))
        outcome: dict[str, str] = {}
        if unload:
            kept = tuple(adapter for adapter in route.adapters if adapter not in unload)
            self.registry.put(replace(route, adapters=kept))  # 404 from now on
            await self._drain(name, unload, engines)
            for adapter, errors in zip(unload, await self._on_each(engines, UNLOAD, unload), strict=True):
                outcome[adapter] = "unloaded"
                for replica, error in errors:  # no longer routed whatever the engine said: the YAML drops it
                    logger.warning("model {}: replica {} could not unload adapter {}: {}", name, replica, adapter, error)
        loaded = {}
        for adapter, errors in zip(load, await self._on_each(engines, LOAD, list(load), load), strict=True):
            if not errors:
                loaded[adapter] = load[adapter]
                outcome[adapter] = "loaded"
                continue
            replica, error = errors[0]
            outcome[adapter] = f"failed on replica {replica}: {error}"
            logger.error("model {}: adapter {} failed to load on replica {}: {}", name, adapter, replica, error)
            took = [backend for backend in engines if backend.replica not in {r for r, _ in errors}]
            await self._on_each(took, UNLOAD, [adapter])  # all replicas or none
        serving = {adapter: path for adapter, path in running.items() if adapter not in unload} | loaded
        for backend in engines:  # what a restart of each replica loads
            backend.engine.config = backend.engine.config.model_copy(update={"enable_lora": True, "lora_paths": serving})
        current = self.registry.route(name)
        if current is not None:
            self.registry.put(replace(current, adapters=tuple(a for a in entry.adapters if a in serving)))
        failed = sorted(adapter for adapter, said in outcome.items() if said.startswith("failed"))
        result.ok = not failed
        result.error = f"adapter(s) {', '.join(failed)} failed to load; the others serve on" if failed else None
        result.adapters, result.lora_paths, result.replicas = outcome, serving, len(route.replicas)
        logger.info("model {}: adapters {}", name, ", ".join(f"{a} {said}" for a, said in outcome.items()) or "unchanged")
        return result

    async def _drain(self, name: str, adapters: list[str], engines: list[EngineBackend]) -> None:
        """Wait until no request of ``adapters`` runs on ``engines`` (every worker process routes without them first)."""
        deadline = time.monotonic() + self.state.settings.drain_timeout_s
        peers = self.state.peers
        if peers is not None:
            await peers.settle(max(0.0, deadline - time.monotonic()))

        def busy() -> int:
            return sum(self.state.adapter_in_flight(name, adapter, backend) for adapter in adapters for backend in engines)

        while busy() and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if busy():
            logger.warning("model {}: {} request(s) of removed adapters still running after the drain timeout", name, busy())

    @staticmethod
    async def _on_each(
        engines: list[EngineBackend], path: str, adapters: list[str], paths: dict[str, str] | None = None
    ) -> list[list[tuple[int, str]]]:
        """Call ``path`` for each adapter on every replica that is up (replicas at once, adapters in turn on each);
        per adapter, the (replica, error) of the calls that failed."""

        async def on(backend: EngineBackend) -> list[str | None]:
            said = []
            for adapter in adapters:
                body = {"lora_name": adapter, **({"lora_path": paths[adapter]} if paths is not None else {})}
                said.append(await engine_post(backend, path, body))
            return said

        up = [backend for backend in engines if backend.failure is None]
        answers = await asyncio.gather(*(on(backend) for backend in up))
        return [
            [(backend.replica, said[index]) for backend, said in zip(up, answers, strict=True) if said[index] is not None]
            for index in range(len(adapters))
        ]
