"""Engine config -> ``python -m sglang.launch_server`` argv and environment.

This is the only module that knows SGLang's flag spellings (checked against SGLang's own parser
by ``tests/launch/test_argv_sglang_parser.py``, so a renamed flag fails CI, not a deployment).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from launch.config import CPU_DEFAULT_MAX_TOTAL_TOKENS, EngineConfig

SGLANG_MODULE = "sglang.launch_server"
CPU_SHIM_DIR = Path(__file__).resolve().parent / "cpu_shim"

# field name -> flag, for options that are passed as "--flag VALUE" when set.
_VALUE_FLAGS: dict[str, str] = {
    "model_path": "--model-path",
    "tokenizer_path": "--tokenizer-path",
    "host": "--host",
    "tp_size": "--tp-size",
    "dp_size": "--dp-size",
    "mem_fraction_static": "--mem-fraction-static",
    "max_total_tokens": "--max-total-tokens",
    "context_length": "--context-length",
    "max_running_requests": "--max-running-requests",
    "dtype": "--dtype",
    "quantization": "--quantization",
    "chunked_prefill_size": "--chunked-prefill-size",
    "grammar_backend": "--grammar-backend",
    "tool_call_parser": "--tool-call-parser",
    "reasoning_parser": "--reasoning-parser",
    "chat_template": "--chat-template",
    "attention_backend": "--attention-backend",
    "device": "--device",
    "random_seed": "--random-seed",
    "cuda_graph_max_bs": "--cuda-graph-max-bs-decode",
}
# field name -> flag, for booleans passed as a bare "--flag" when true.
_SWITCH_FLAGS: dict[str, str] = {
    "trust_remote_code": "--trust-remote-code",
    "json_disable_any_whitespace": "--constrained-json-disable-any-whitespace",
    "skip_server_warmup": "--skip-server-warmup",
    "enable_metrics": "--enable-metrics",
    "enable_response_store": "--enable-response-store",
}
# SGLang 0.5.23 deprecates --disable-cuda-graph in favour of per-phase backends.
CUDA_GRAPH_OFF_FLAGS = ("--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled")
SLEEP_ON_IDLE_FLAG = "--sleep-on-idle"
PORT_FLAG = "--port"
SERVED_NAME_FLAG = "--served-model-name"
CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"
# Secrets never go on the command line (``/proc/PID/cmdline`` is world-readable): they go in a YAML
# file read by SGLang's ``--config`` (keys are flag names without the leading dashes).
CONFIG_FLAG = "--config"
API_KEY_CONFIG_KEY = "api-key"


def effective_engine(engine: EngineConfig) -> EngineConfig:
    """Fill the CPU defaults that SGLang needs to start quickly and idle quietly on a CPU box."""
    if engine.device != "cpu":
        return engine
    updates: dict[str, object] = {}
    if engine.attention_backend is None:
        updates["attention_backend"] = "torch_native"
    if engine.max_total_tokens is None:
        updates["max_total_tokens"] = CPU_DEFAULT_MAX_TOTAL_TOKENS
    if engine.sleep_on_idle is None:
        updates["sleep_on_idle"] = True
    return engine.model_copy(update=updates) if updates else engine


def server_args(engine: EngineConfig, *, port: int, served_model_name: str | None = None) -> list[str]:
    """The flags after ``-m sglang.launch_server`` (no interpreter), in a stable order."""
    engine = effective_engine(engine)
    args: list[str] = []
    for field, flag in _VALUE_FLAGS.items():
        value = getattr(engine, field)
        if value is None or (field == "dtype" and value == "auto"):
            continue
        args += [flag, str(value)]
    args += [PORT_FLAG, str(port)]
    name = engine.served_model_name or served_model_name
    if name:
        args += [SERVED_NAME_FLAG, name]
    for field, flag in _SWITCH_FLAGS.items():
        if getattr(engine, field):
            args.append(flag)
    if engine.sleep_on_idle:
        args.append(SLEEP_ON_IDLE_FLAG)
    if engine.device == "cuda" and not engine.cuda_graph_enabled:
        args += CUDA_GRAPH_OFF_FLAGS
    return args + list(engine.extra_args)


def build_argv(
    engine: EngineConfig, *, port: int, served_model_name: str | None = None, config_file: str | Path | None = None
) -> list[str]:
    """The full command line that starts the engine (``config_file``: see :func:`secret_config`)."""
    args = server_args(engine, port=port, served_model_name=served_model_name)
    if config_file is not None:
        args = [*_without_config_flag(args), CONFIG_FLAG, str(config_file)]
    return [engine.python_executable, "-m", SGLANG_MODULE, *args]


def secret_config(engine: EngineConfig, *, api_key: str) -> dict[str, object]:
    """Contents of the private ``--config`` file that gives the engine its API key.

    SGLang takes one ``--config`` file; a user's own (in ``extra_args``) is merged into ours.
    """
    data: dict[str, object] = {}
    user_file = _config_flag_value(list(engine.extra_args))
    if user_file is not None:
        loaded = yaml.safe_load(Path(user_file).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"extra_args: {CONFIG_FLAG} {user_file}: expected a mapping of SGLang options")
        data.update(loaded)
    data[API_KEY_CONFIG_KEY] = api_key
    return data


def _config_flag_value(args: list[str]) -> str | None:
    for index, arg in enumerate(args):
        if arg == CONFIG_FLAG and index + 1 < len(args):
            return args[index + 1]
        if arg.startswith(CONFIG_FLAG + "="):
            return arg.split("=", 1)[1]
    return None


def _without_config_flag(args: list[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == CONFIG_FLAG:
            skip = True
        elif not arg.startswith(CONFIG_FLAG + "="):
            out.append(arg)
    return out


@dataclass(frozen=True)
class EngineEnv:
    """Environment for the engine process, and whether the CPU ``sgl_kernel`` stand-in is on its path."""

    variables: dict[str, str]
    uses_cpu_shim: bool


def build_env(engine: EngineConfig, base: dict[str, str] | None = None) -> EngineEnv:
    """Environment for the engine: the caller's, plus CPU-mode settings, plus ``engine.env``."""
    env = dict(os.environ if base is None else base)
    uses_shim = False
    if engine.device == "cpu":
        env[CPU_ENGINE_ENV] = "1"
        if not real_sgl_kernel_importable(engine.python_executable):
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CPU_SHIM_DIR), env.get("PYTHONPATH", "")) if p)
            uses_shim = True
    env.update(engine.env)
    return EngineEnv(env, uses_shim)


def real_sgl_kernel_importable(python: str) -> bool:
    """Whether a real ``sgl_kernel`` imports for ``python`` (then the stand-in must stay off the path).

    PyPI's builds are CUDA-only and fail to import without ``libcuda``; those count as absent.
    """
    if os.path.realpath(python) == os.path.realpath(sys.executable) and importlib.util.find_spec("sgl_kernel") is None:
        return False
    try:
        probe = subprocess.run(
            [python, "-c", "import sgl_kernel, sys; sys.exit(1 if getattr(sgl_kernel, 'IS_SGLANG_GATEWAY_CPU_SHIM', False) else 0)"],
            capture_output=True,
            timeout=120,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False  # the launch itself will report a broken interpreter
    return probe.returncode == 0
