"""Start the managed engines of a deployment in parallel, and stop every one of them.

``start()`` of each :class:`EngineProcess` runs on the calling (event-loop) thread, because Linux ties
the parent-death signal to the thread that forked; the blocking readiness waits run in worker
threads so that several engines load at once.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from loguru import logger

from launch.config import DeploymentConfig
from launch.preflight import preflight, require
from launch.process import EngineError, EngineProcess, ProgressCallback, new_engine_key


def log_progress(name: str) -> ProgressCallback:
    """Log each start-up phase of engine ``name`` at INFO (loading weights, KV cache, CUDA graphs, warm-up):
    where the gateway runs as a serving platform's entrypoint, its log is the only view of a cold start."""

    def progress(phase: str, elapsed_s: float) -> None:
        if phase not in ("starting", "ready"):  # EngineProcess logs both itself, with its port / URL
            logger.info("engine {}: {} ({:.0f}s)", name, phase, elapsed_s)

    return progress


class StartAborted(Exception):
    """Shutdown was requested while the engines were still starting."""


class EngineManager:
    """The engines this gateway owns (one per managed model)."""

    def __init__(self, deployment: DeploymentConfig, *, log_dir: str | Path | None = None) -> None:
        self.engines: dict[str, EngineProcess] = {}
        self._abort = threading.Event()
        for name, engine in deployment.managed().items():
            self.engines[name] = EngineProcess(
                name,
                require(preflight(engine), name),
                log_dir=log_dir,
                api_key=new_engine_key(),
                on_progress=log_progress(name),
            )

    async def start_all(self) -> None:
        """Start every engine and wait until all are ready; on any failure stop them all and raise."""
        if not self.engines:
            return
        started = time.monotonic()
        try:
            for engine in self.engines.values():
                engine.start()
            waiting = asyncio.gather(
                *(asyncio.to_thread(engine.wait_ready) for engine in self.engines.values()), return_exceptions=True
            )
            while not waiting.done():
                await asyncio.wait({waiting}, timeout=0.2)
                if self._abort.is_set():  # stopping the engines ends their wait_ready threads too
                    await self.stop_all()
                    await waiting
                    raise StartAborted("shutdown requested while the engines were starting")
            results = waiting.result()
        except BaseException:
            await self.stop_all()
            raise
        errors = [result for result in results if isinstance(result, BaseException)]
        if errors:
            await self.stop_all()
            raise errors[0] if isinstance(errors[0], EngineError) else errors[0]
        ready = ", ".join(f"{n} at {e.url}" for n, e in self.engines.items())
        logger.info("engines ready in {:.1f}s: {}", time.monotonic() - started, ready)

    def abort_start(self) -> None:
        """Make a running :meth:`start_all` stop the engines and give up (safe from a signal handler)."""
        self._abort.set()

    async def stop_all(self) -> None:
        """Stop every started engine (in parallel: each may take seconds to exit)."""
        started = [engine for engine in self.engines.values() if engine.pid is not None]
        if started:
            await asyncio.gather(*(asyncio.to_thread(engine.stop) for engine in started), return_exceptions=True)
