"""One call from an engine config to a ready engine: preflight, start, wait for ``/health``, stop on failure.

Linux sends the parent-death signal when the *thread* that forked the engine exits, and callers
often run on short-lived threads (a notebook's ``load_context``, a server's worker thread). So every
engine is forked by one long-lived daemon thread of this module (:data:`STARTER`), whatever thread
asks for it.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from loguru import logger

from launch.config import EngineConfig
from launch.preflight import preflight, require
from launch.process import EngineExited, EngineProcess, ProgressCallback, port_was_taken

T = TypeVar("T")

PORT_TAKEN_RETRIES = 2


class StarterThread:
    """One daemon thread that runs the functions given to :meth:`run` (used to fork engines)."""

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the starter thread and return its result (or raise its exception)."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="sglang-engine-starter", daemon=True)
                self._thread.start()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._queue.put((fn, future))
        return future.result()

    def _loop(self) -> None:
        while True:
            fn, future = self._queue.get()
            try:
                future.set_result(fn())
            except BaseException as error:  # handed back to the caller
                future.set_exception(error)


STARTER = StarterThread()


def start_ready(
    name: str,
    engine: EngineConfig,
    *,
    log_dir: str | Path | None = None,
    api_key: str | None = None,
    on_progress: ProgressCallback | None = None,
    echo_level: str | None = "DEBUG",
    stop_when: Callable[[], bool] | None = None,
    served_model_name: str | None = None,
) -> EngineProcess:
    """A ready engine for ``engine``: preflight (warnings logged), start from :data:`STARTER`, wait for
    ``/health``. On any failure (or ``stop_when()`` turning true while it starts) the engine is stopped
    and the error raised: :class:`launch.preflight.PreflightError` or a :class:`launch.process.EngineError`.

    An engine whose port was picked for it (``port: 0``) and taken by another process before the engine bound
    it (a race no pick can close) is started again on a new port, up to :data:`PORT_TAKEN_RETRIES` times.
    """
    checked = require(preflight(engine), name)
    for attempt in range(PORT_TAKEN_RETRIES + 1):
        process = EngineProcess(
            name, checked, log_dir=log_dir, on_progress=on_progress, api_key=api_key, echo_level=echo_level,
            served_model_name=served_model_name,
        )  # fmt: skip
        STARTER.run(process.start)
        try:
            process.wait_ready(stop_when=stop_when)
            return process
        except EngineExited as error:
            process.stop()
            if checked.port != 0 or attempt == PORT_TAKEN_RETRIES or not port_was_taken(error.log_tail):
                raise
            logger.warning("engine {}: port {} was taken before the engine could bind it; starting it on another", name, process.port)
        except BaseException:
            process.stop()
            raise
    raise AssertionError("unreachable: the last attempt returns or raises")
