"""A live engine, measured: start one model's engine as configured, time the start-up phases the launcher parses,
send a 1-token and a 64-token request, stop it; on a GPU with CUDA graphs on, the same again with them off.

FlashInfer's JIT (when a kernel is missing from the pinned JIT cache) and CUDA graph capture both happen inside the
start, so their cost is in the phases' times: "capturing CUDA graphs" is the capture; the time before "weights
loaded" ends holds the imports and any first JIT build.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from launch.config import EngineConfig
from launch.lifecycle import start_ready
from launch.preflight import PreflightError
from launch.process import EngineError, EngineProcess

LONG_TOKENS = 64

# What a failed start's log tail says -> the fix (the known GPU failures of docs/gpu.md#troubleshooting), first match.
KNOWN_FAILURES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"nvcc|CUDA_HOME"), "FlashInfer's JIT could not find nvcc: set CUDA_HOME (engine.env) to a CUDA toolkit of the stack's CUDA"),
    (re.compile(r"[Cc]apture.*graph|cuda graph", re.IGNORECASE), "CUDA graph capture failed: lower cuda_graph_max_bs, or set cuda_graph: false"),
    (re.compile(r"NCCL"), "NCCL failed: give the container a /dev/shm of >= 1 GiB (docker --shm-size=1g)"),
    (re.compile(r"driver version is insufficient|CUDA driver version"), "the NVIDIA driver is too old for the stack's CUDA: see the driver check"),
    (re.compile(r"out of memory|OutOfMemoryError", re.IGNORECASE), "GPU memory ran out: lower mem_fraction_static or context_length, or stop what else holds the GPU"),
)


def fix_for(log_tail: list[str]) -> str:
    """The fix a failed start's log points to, else where to read it."""
    text = "\n".join(log_tail)
    return next((fix for pattern, fix in KNOWN_FAILURES if pattern.search(text)), "read the engine log (docs/gpu.md#troubleshooting)")


@dataclass
class EngineRun:
    model: str
    cuda_graph: bool
    command: list[str] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)  # phase -> seconds since the process started
    ready_s: float | None = None
    one_token_ms: float | None = None  # a 1-token answer, end to end
    long_tokens: int | None = None
    long_s: float | None = None
    tokens_per_s: float | None = None
    jit_lines: int = 0  # log lines that speak of FlashInfer / JIT compilation
    error: str | None = None
    fix: str = ""  # for a failed start: what its log points to


def _chat(engine: EngineProcess, served: str, max_tokens: int) -> tuple[float, dict[str, Any]]:
    body = {"model": served, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    start = time.perf_counter()
    response = httpx.post(f"{engine.url}/v1/chat/completions", json=body, headers=engine.auth_headers(), timeout=600)
    response.raise_for_status()
    return time.perf_counter() - start, response.json()


def probe_engine(model: str, engine: EngineConfig, log_dir: Path) -> EngineRun:
    """One measured start, two requests and a stop; a failure is recorded in the run, never raised."""
    run = EngineRun(model, engine.cuda_graph_enabled)
    started = time.perf_counter()

    def progress(phase: str, seconds: float) -> None:
        if phase == "CUDA graphs captured":  # 0.5.23 captures prefill graphs, then decode graphs: the last end counts
            run.phases[phase] = round(seconds, 2)
        else:
            run.phases.setdefault(phase, round(seconds, 2))

    try:
        process = start_ready(model, engine, log_dir=log_dir, on_progress=progress, echo_level=None, served_model_name=model)
    except (PreflightError, EngineError) as error:
        run.error = str(error).splitlines()[0][:500]
        run.fix = fix_for(getattr(error, "log_tail", None) or str(error).splitlines())
        return run
    try:
        run.ready_s = round(time.perf_counter() - started, 2)
        run.command = list(process.argv)
        seconds, _ = _chat(process, model, 1)
        run.one_token_ms = round(seconds * 1000, 1)
        seconds, answer = _chat(process, model, LONG_TOKENS)
        run.long_s = round(seconds, 3)
        run.long_tokens = int(answer.get("usage", {}).get("completion_tokens", 0))
        run.tokens_per_s = round(run.long_tokens / seconds, 1) if seconds > 0 else None
        log = process.log_file.read_text(errors="replace") if process.log_file else ""
        run.jit_lines = sum(1 for line in log.splitlines() if "flashinfer" in line.lower() and "jit" in line.lower())
    except (httpx.HTTPError, ValueError, OSError) as error:
        run.error = f"{type(error).__name__}: {error}"[:500]
    finally:
        process.stop()
    return run


def probe_model(model: str, engine: EngineConfig, log_dir: Path) -> list[EngineRun]:
    """The engine as configured, then (GPU, graphs on) with CUDA graphs off: what graphs buy and cost."""
    runs = [probe_engine(model, engine, log_dir)]
    if engine.device == "cuda" and engine.cuda_graph_enabled:
        runs.append(probe_engine(model, engine.model_copy(update={"cuda_graph": False, "cuda_graph_max_bs": None}), log_dir))
    return runs
