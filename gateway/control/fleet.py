"""The processes the control plane runs: it starts engines and SGLang routers, stops them, and stops them all
at shutdown.

Engines start through :func:`launch.lifecycle.start_ready` in a worker thread (preflight, start from
launch's long-lived starter thread, which the parent-death signal requires, wait until ready). Every engine
started (boot, reload, swap, restart) is *owned* until its backend leaves the registry, so that the watchdog
restarts an owned engine that died and shutdown stops every one.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

from loguru import logger

from gateway.core.backends import Backend, EngineBackend, RouterBackend
from launch.config import EngineConfig, RouterConfig
from launch.lifecycle import STARTER, start_ready
from launch.preflight import PreflightError
from launch.process import EngineError, EngineProcess, ProgressCallback, new_engine_key
from launch.router import RouterProcess


class SwapError(Exception):
    """A backend could not be brought up; ``log_tail`` holds the engine's last log lines, ``cause`` the
    engine's or preflight's own error (raised as is when a boot fails)."""

    def __init__(
        self, model: str, message: str, log_tail: Iterable[str] = (), cause: BaseException | None = None
    ) -> None:
        super().__init__(message)
        self.model = model
        self.message = message
        self.log_tail = list(log_tail)
        self.cause = cause


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


class Fleet:
    """The engine and router processes this gateway started, and the only code that starts or stops them."""

    def __init__(self, *, owned: Iterable[EngineProcess] = (), log_dir: str | Path | None = None) -> None:
        self.log_dir = log_dir
        self._owned: set[EngineProcess] = set(owned)
        self._routers: set[RouterProcess] = set()  # SGLang routers started in front of replicas
        self._closing = False
        self._abort = threading.Event()  # set from a signal handler, or by a failed boot: starts give up
        self._stop_requested = False  # set from a signal handler only: the user asked to stop

    @property
    def aborted(self) -> bool:
        """A stop was requested (SIGTERM / Ctrl-C) while engines started: not a failure of theirs."""
        return self._stop_requested

    @property
    def stopping(self) -> bool:
        return self._closing or self._abort.is_set()

    def abort_starts(self) -> None:
        """Make every engine start in progress stop its engine and fail, because a stop was requested
        (thread-safe; signal handlers too)."""
        self._stop_requested = True
        self._abort.set()

    def give_up_starts(self) -> None:
        """Make every engine start in progress stop its engine and fail, because another one failed (a boot
        fails fast): that failure, not a stop request, is what the boot reports."""
        self._abort.set()

    def owns(self, engine: EngineProcess | None) -> bool:
        return engine is not None and engine in self._owned

    def forget(self, engine: EngineProcess) -> None:
        """``engine``'s backend has left the registry for good: the watchdog no longer restarts it."""
        self._owned.discard(engine)

    async def start_engine(
        self, model: str, config: EngineConfig, *, replica: int = 0, api_key: str | None = None
    ) -> EngineBackend:
        """Launch an engine for ``model`` (replica ``replica``) and wait until it is ready: preflight, start
        and wait by :func:`launch.lifecycle.start_ready`; SwapError (with the engine's log tail) if not."""
        if self.stopping:
            raise SwapError(model, "the gateway is shutting down")
        name = model if not replica else f"{model}-{replica}"
        given_up = threading.Event()  # this start was cancelled (its caller went away): the thread stops the engine
        starting = asyncio.ensure_future(
            asyncio.to_thread(
                start_ready, name, config, log_dir=self.log_dir, api_key=api_key or new_engine_key(), on_progress=log_progress(name),
                served_model_name=model, stop_when=lambda: given_up.is_set() or self.stopping,
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
            if self.stopping:
                raise SwapError(model, "start aborted (the gateway is stopping)") from None
            tail = error.log_tail[-40:]
            raise SwapError(
                model, f"new engine for {model!r} failed to start: {str(error).splitlines()[0]}", tail, cause=error
            ) from None
        self._owned.add(engine)
        if self._closing:  # closed while it came up: close() did not see it
            await self.stop_engine(engine, forget=True)
            raise SwapError(model, "the gateway is shutting down")
        return EngineBackend(config.served_model_name or model, engine, replica=replica)

    async def stop_engine(self, engine: EngineProcess | None, *, forget: bool = False) -> None:
        """Stop an engine we own. ``forget`` once its backend has left the registry: an engine stopped
        while its backend still routes the model stays owned, so the watchdog restarts it."""
        if engine is None or engine not in self._owned:
            return
        await asyncio.to_thread(engine.stop)
        if forget:
            self._owned.discard(engine)

    async def start_router(
        self,
        model: str,
        served_name: str,
        config: RouterConfig,
        worker_urls: Sequence[str],
        *,
        api_key: str,
        tokenizer_path: str,
    ) -> RouterBackend:
        """Start SGLang's router in front of ``worker_urls`` and wait until it routes to them."""
        urls = list(worker_urls)
        router = RouterProcess(model, config, tokenizer_path=tokenizer_path, api_key=api_key, log_dir=self.log_dir)
        STARTER.run(lambda: router.start(urls))  # forked from launch's long-lived thread (parent-death signal)
        self._routers.add(router)
        try:
            await asyncio.to_thread(router.wait_ready, urls, None, lambda: self.stopping)
        except EngineError as error:
            await asyncio.to_thread(router.stop)
            self._routers.discard(router)
            raise SwapError(
                model, f"router of {model!r} failed to start: {str(error).splitlines()[0]}", error.log_tail, cause=error
            ) from None
        return RouterBackend(served_name, router, api_key=api_key)

    async def stop_router(self, front: Backend | None) -> None:
        if isinstance(front, RouterBackend):
            await asyncio.to_thread(front.router.stop)
            self._routers.discard(front.router)

    async def close(self) -> None:
        """Stop every process this gateway owns (shutdown); starts in progress fail and stop too."""
        self._closing = True
        processes = [*self._owned, *self._routers]
        if processes:
            await asyncio.gather(*(asyncio.to_thread(process.stop) for process in processes), return_exceptions=True)
        self._owned.clear()
        self._routers.clear()
