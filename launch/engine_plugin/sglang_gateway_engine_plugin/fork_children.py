"""A CPU engine forks its scheduler and detokenizer processes instead of spawning them.

SGLang 0.5.23 sets multiprocessing's start method to ``spawn`` (``_set_envs_and_config``), which CUDA needs:
a forked child of a process that touched CUDA cannot use it. Spawn costs a fresh interpreter per child that
imports sglang, torch and transformers again: measured here, 10-13 CPU-seconds per child and two children per
engine, two thirds of the CPU an engine start costs on a CPU box. A CPU engine (``SGLANG_USE_CPU_ENGINE=1``, set
by the launcher for ``device: cpu``) has no CUDA to protect, and at this point its main process has started no
thread, no tokenizer and no event loop, so its children fork (inheriting the imports already done) and start in a
fraction of the time. GPU engines keep SGLang's spawn, and ``SGLANG_GATEWAY_CPU_FORK=0`` (in an engine's ``env:``)
keeps it on a CPU engine too.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Mapping
from typing import Any

TARGET = "sglang.srt.entrypoints.engine._set_envs_and_config"
CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"
OPT_OUT_ENV = "SGLANG_GATEWAY_CPU_FORK"


def wanted(env: Mapping[str, str]) -> bool:
    """Whether an engine with this environment forks its children: a CPU engine that did not opt out."""
    return env.get(CPU_ENGINE_ENV) == "1" and env.get(OPT_OUT_ENV) != "0"


def register() -> None:
    if not wanted(os.environ):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, fork_after_config, HookType.AFTER)


def fork_after_config(result: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER ``_set_envs_and_config`` (which chose ``spawn``): the engine's children fork."""
    multiprocessing.set_start_method("fork", force=True)
    return result
