"""Who owns the engine a loaded model uses.

- ``engine_sharing: shared`` (default): the machine's one engine for this configuration
  (:func:`launch.shared.join`); every process that loads the model uses it, and it stops when the last
  one closes the model or exits (SIGKILL included).
- ``engine_sharing: per_process``: an engine of this process (:func:`launch.lifecycle.start_ready`), with a
  parent-death signal so that it cannot outlive the process even when ``atexit`` does not run
  (SIGTERM'd serving workers).

Either way the engine's log goes to its file; the output shows the start-up phases, the URL, warnings
and errors (``show_engine_log`` adds every engine line). :func:`stop_all` releases every engine this
process holds.
"""

from __future__ import annotations

import atexit
import threading
from pathlib import Path

from loguru import logger

from launch.lifecycle import start_ready
from launch.process import EngineProcess, new_engine_key
from launch.shared import SharedEngine, join
from model_code.target import Target, show_engine_log

Engine = EngineProcess | SharedEngine
"""What a client holds: both have ``url``, ``api_key``, ``pid``, ``port``, ``log_file`` and ``running``."""

_LIVE: dict[int, Engine] = {}
_LIVE_LOCK = threading.Lock()
STARTS = 0
"""Engines acquired through this module in this process (tests use it to prove logging starts none)."""


def acquire_engine(target: Target) -> Engine:
    """The engine for ``target`` (which has an ``engine`` section), ready to answer."""
    global STARTS
    assert target.engine is not None
    settings = target.settings
    if settings.engine_sharing == "shared":
        engine: Engine = join(target.name, target.engine, log_dir=settings.log_dir, show_log=show_engine_log(settings))
    else:
        engine = start_process_engine(target)
    with _LIVE_LOCK:
        STARTS += 1
        _LIVE[id(engine)] = engine
    return engine


def start_process_engine(target: Target) -> EngineProcess:
    """An engine owned by this process, started with a random API key; stopped on any start-up failure."""
    assert target.engine is not None
    name, settings = target.name, target.settings
    return start_ready(
        name,
        target.engine,
        log_dir=Path(settings.log_dir) if settings.log_dir else None,
        api_key=new_engine_key(),
        on_progress=lambda phase, seconds: logger.info("engine {}: {} ({:.0f}s)", name, phase, seconds),
        echo_level="INFO" if show_engine_log(settings) else None,
    )


def release_engine(engine: Engine) -> None:
    """Stop this process's engine, or stop using the shared one. Never raises (called from ``close()``/atexit)."""
    with _LIVE_LOCK:
        _LIVE.pop(id(engine), None)
    try:
        if isinstance(engine, SharedEngine):
            engine.close()
        else:
            engine.stop()
    except Exception:
        logger.exception("releasing engine {} failed", engine.name)


def live_engines() -> list[Engine]:
    with _LIVE_LOCK:
        return list(_LIVE.values())


def stop_all() -> int:
    """Release every engine this process acquired through ``model_code``; returns how many."""
    engines = live_engines()
    for engine in engines:
        release_engine(engine)
    return len(engines)


atexit.register(stop_all)
