"""Who owns the engines a loaded model uses: one, or one per replica (``replicas: N``).

- ``engine_sharing: shared`` (default): the machine's one engine for this configuration
  (:func:`launch.shared.join`); every process that loads the model uses it, and it stops when the last
  one closes the model or exits (SIGKILL included).
- ``engine_sharing: per_process``: an engine of this process (:func:`launch.lifecycle.start_ready`), with a
  parent-death signal so that it cannot outlive the process even when ``atexit`` does not run
  (SIGTERM'd serving workers).

A model with replicas gets one engine per replica, each with its replica's engine config
(:func:`launch.replicas.replica_engines`: its GPUs on a GPU machine), started side by side; if one
cannot start, the others are given up and nothing is left running. In ``shared`` mode each replica is
its own shared engine: replica ``i > 0`` is named ``<model>-<i>`` (as the gateway names it), and the name
is part of the shared-engine key, so two replicas of one config never land on one engine while two
processes loading the same model meet on the same N engines.

Either way the engine's log goes to its file; the output shows the start-up phases, the URL, warnings
and errors (``show_engine_log`` adds every engine line). :func:`stop_all` releases every engine this
process holds.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

from loguru import logger

from launch.config import EngineConfig
from launch.lifecycle import start_ready
from launch.preflight import visible_gpu_count
from launch.process import EngineProcess, EngineStartCancelled, new_engine_key
from launch.replicas import replica_engines, visible_gpu_ids
from launch.served import EngineServer
from launch.shared import SharedEngine, join
from model_code.target import ModelCodeSettings, Target, show_engine_log

Engine = EngineServer
"""What a client holds: an :class:`EngineProcess` or a :class:`SharedEngine`, used only as an engine server."""

_LIVE: dict[int, Engine] = {}
_LIVE_LOCK = threading.Lock()
STARTS = 0
"""Engines acquired through this module in this process (tests use it to prove logging starts none)."""


def replica_specs(target: Target) -> list[tuple[str, EngineConfig]]:
    """(engine name, engine config) of each replica of ``target`` (which has an ``engine`` section).

    One replica is the model's own engine under the model's name: the same shared engine as ever. Replica
    ``i > 0`` of several is named ``<model>-<i>`` and serves the model's name. ConfigError when the
    replicas do not fit the visible GPUs.
    """
    engine, entry = target.engine, target.entry
    assert engine is not None
    several = entry.replicas > 1 or entry.replica_gpus is not None
    visible = visible_gpu_ids(visible_gpu_count()) if several and engine.device == "cuda" else []
    specs = []
    for index, config in enumerate(replica_engines(entry, visible)):
        if index:
            specs.append(
                (f"{target.name}-{index}", config.model_copy(update={"served_model_name": target.served_name}))
            )
        else:
            specs.append((target.name, config))
    return specs


def acquire_engines(target: Target) -> list[Engine]:
    """The engines of every replica of ``target``, ready to answer, in replica order.

    Several are started concurrently (one thread each): the first that fails makes the others give up,
    every engine already started is released, and that first error is raised.
    """
    specs = replica_specs(target)
    if len(specs) == 1:
        return [acquire_engine(target.settings, *specs[0])]
    give_up = threading.Event()

    def start(name: str, config: EngineConfig) -> Engine:
        try:
            return acquire_engine(target.settings, name, config, stop_when=give_up.is_set)
        except BaseException:
            give_up.set()
            raise

    pool = ThreadPoolExecutor(max_workers=len(specs), thread_name_prefix="sglang-replica-start")
    futures = [pool.submit(start, name, config) for name, config in specs]
    try:
        wait(futures)
    except BaseException:  # interrupted while waiting (Ctrl-C in a notebook): the starts give up too
        give_up.set()
        raise
    finally:
        pool.shutdown(wait=True)  # every start has ended: ready, failed, or given up within a poll
        started = [future.result() for future in futures if future.exception() is None]
        if give_up.is_set():
            for engine in started:
                release_engine(engine)
    errors = [error for future in futures if (error := future.exception()) is not None]
    if errors:
        raise next((error for error in errors if not isinstance(error, EngineStartCancelled)), errors[0])
    return started


def acquire_engine(
    settings: ModelCodeSettings, name: str, config: EngineConfig, *, stop_when: Callable[[], bool] | None = None
) -> Engine:
    """The engine ``name`` of ``config``, ready to answer (``stop_when()`` true: the start is given up)."""
    global STARTS
    if settings.engine_sharing == "shared":
        engine: Engine = join(
            name, config, log_dir=settings.log_dir, show_log=show_engine_log(settings), stop_when=stop_when
        )
    else:
        engine = start_process_engine(settings, name, config, stop_when=stop_when)
    with _LIVE_LOCK:
        STARTS += 1
        _LIVE[id(engine)] = engine
    return engine


def start_process_engine(
    settings: ModelCodeSettings, name: str, config: EngineConfig, *, stop_when: Callable[[], bool] | None = None
) -> EngineProcess:
    """An engine owned by this process, started with a random API key; stopped on any start-up failure."""
    return start_ready(
        name,
        config,
        log_dir=Path(settings.log_dir) if settings.log_dir else None,
        api_key=new_engine_key(),
        on_progress=lambda phase, seconds: logger.info("engine {}: {} ({:.0f}s)", name, phase, seconds),
        echo_level="INFO" if show_engine_log(settings) else None,
        stop_when=stop_when,
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
