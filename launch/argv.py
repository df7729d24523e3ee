"""Engine config -> ``python -m sglang.launch_server`` argv and environment (and the flags of SGLang's router).

This is the only module that knows SGLang's flag spellings (checked against SGLang's own parser
by ``tests/launch/test_argv_sglang_parser.py``, so a renamed flag fails CI, not a deployment).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import yaml
from loguru import logger

from launch.config import CPU_DEFAULT_MAX_TOTAL_TOKENS, EngineConfig, RouterConfig
from launch.engine_net import socket_env
from launch.reference import default_text, meaning
from launch.sglang_versions import NEWEST, VERSIONS, EngineVersion, engine_version, installed_sglang, same_interpreter
from launch.tracing import PROTOCOL_ENV

SGLANG_MODULE = "sglang.launch_server"
CPU_SHIM_DIR = Path(__file__).resolve().parent / "cpu_shim"


class Passed(StrEnum):
    """How an engine key's value becomes flags."""

    VALUE = "value"  # "--flag VALUE" when set (and not SGLang's own default, ``EngineFlag.omit``)
    SWITCH = "switch"  # a bare "--flag" when true
    OFF = "off"  # "--flag disabled" for each of its flags when false
    LIST = "list"  # "--flag V1 V2 ..." when not empty (a mapping: "--flag K1=V1 K2=V2")


@dataclass(frozen=True)
class EngineFlag:
    """The ``sglang.launch_server`` flag(s) of one engine key."""

    flags: tuple[str, ...]
    passed: Passed = Passed.VALUE
    omit: object = None  # a value left to SGLang (its own default): not spelled out

    @property
    def dests(self) -> tuple[str, ...]:
        """The attributes of SGLang's ``ServerArgs`` these flags set (argparse's dest: dashes to underscores)."""
        return tuple(flag.removeprefix("--").replace("-", "_") for flag in self.flags)

    def argv(self, value: object) -> list[str]:
        if self.passed is Passed.SWITCH:
            return [self.flags[0]] if value else []
        if self.passed is Passed.OFF:
            return [part for flag in self.flags for part in (flag, "disabled")] if value is False else []
        if self.passed is Passed.LIST:
            items = [f"{key}={item}" for key, item in value.items()] if isinstance(value, dict) else list(value or ())
            return [self.flags[0], *map(str, items)] if items else []
        return [] if value is None or value == self.omit else [self.flags[0], str(value)]


def _value(flag: str, omit: object = None) -> EngineFlag:
    return EngineFlag((flag,), Passed.VALUE, omit)


def _switch(flag: str) -> EngineFlag:
    return EngineFlag((flag,), Passed.SWITCH)


def _list(flag: str) -> EngineFlag:
    return EngineFlag((flag,), Passed.LIST)


# Every key of ``EngineConfig`` that becomes flags, in command-line order (a test checks that each key is here
# or in NOT_FLAGS, and feeds every flag through SGLang's own parser). Adding an engine key: its field in
# ``launch.config.EngineConfig``, its line here, and its value in the parser test's FULL engine.
ENGINE_FLAGS: dict[str, EngineFlag] = {
    "model_path": _value("--model-path"),
    "tokenizer_path": _value("--tokenizer-path"),
    "host": _value("--host"),
    "tp_size": _value("--tp-size"),
    "dp_size": _value("--dp-size"),
    "nnodes": _value("--nnodes", omit=1),
    "node_rank": _value("--node-rank", omit=0),
    "dist_init_addr": _value("--dist-init-addr"),
    "mem_fraction_static": _value("--mem-fraction-static"),
    "max_total_tokens": _value("--max-total-tokens"),
    "context_length": _value("--context-length"),
    "max_running_requests": _value("--max-running-requests"),
    "dtype": _value("--dtype", omit="auto"),
    "quantization": _value("--quantization"),
    "chunked_prefill_size": _value("--chunked-prefill-size"),
    "grammar_backend": _value("--grammar-backend"),
    "tool_call_parser": _value("--tool-call-parser"),
    "reasoning_parser": _value("--reasoning-parser"),
    "chat_template": _value("--chat-template"),
    "attention_backend": _value("--attention-backend"),
    "device": _value("--device"),
    "random_seed": _value("--random-seed"),
    "lora_paths": _list("--lora-paths"),
    "max_lora_rank": _value("--max-lora-rank"),
    "lora_target_modules": _list("--lora-target-modules"),
    "max_loras_per_batch": _value("--max-loras-per-batch"),
    "max_loaded_loras": _value("--max-loaded-loras"),
    "lora_eviction_policy": _value("--lora-eviction-policy"),
    "lora_backend": _value("--lora-backend"),
    "otlp_traces_endpoint": _value("--otlp-traces-endpoint"),
    "otlp_service_name": _value("--otlp-service-name"),
    "cuda_graph_max_bs": _value("--cuda-graph-max-bs-decode"),
    "port": _value("--port"),  # the port the launcher picked (``port: 0`` picks a free one)
    "served_model_name": _value("--served-model-name"),  # default: the model's name in the YAML
    "trust_remote_code": _switch("--trust-remote-code"),
    "json_disable_any_whitespace": _switch("--constrained-json-disable-any-whitespace"),
    "skip_server_warmup": _switch("--skip-server-warmup"),
    "enable_metrics": _switch("--enable-metrics"),
    "enable_priority_scheduling": _switch("--enable-priority-scheduling"),
    "enable_memory_saver": _switch("--enable-memory-saver"),
    "enable_weights_cpu_backup": _switch("--enable-weights-cpu-backup"),
    "enable_response_store": _switch("--enable-response-store"),
    "enable_trace": _switch("--enable-trace"),
    "enable_lora": _switch("--enable-lora"),
    "sleep_on_idle": _switch("--sleep-on-idle"),
    # SGLang 0.5.23 deprecates --disable-cuda-graph in favour of per-phase backends (only said on cuda)
    "cuda_graph": EngineFlag(("--cuda-graph-backend-decode", "--cuda-graph-backend-prefill"), Passed.OFF),
}
# The keys of ``EngineConfig`` that are not SGLang flags (the launcher's own: environment, interpreter,
# verbatim flags, start-up wait).
NOT_FLAGS: frozenset[str] = frozenset({"env", "python", "extra_args", "startup_timeout_s", "otlp_traces_protocol"})

CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"
CPU_LORA_ENV = "SGLANG_GATEWAY_CPU_LORA"
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
    if engine.enable_lora and engine.lora_backend is None:
        updates["lora_backend"] = "torch_native"  # SGLang's default kernels need a GPU
    return engine.model_copy(update=updates) if updates else engine


def flag_values(engine: EngineConfig, *, port: int, served_model_name: str | None = None) -> dict[str, object]:
    """The value each key of :data:`ENGINE_FLAGS` is passed with (after the CPU defaults): the port the launcher
    picked, the served name's fallback, and CUDA graphs only spoken of on cuda."""
    engine = effective_engine(engine)
    return {
        **dict(engine),
        "port": port,
        "served_model_name": engine.served_model_name or served_model_name,
        "cuda_graph": engine.cuda_graph_enabled if engine.device == "cuda" else None,
    }


def launch_version(engine: EngineConfig) -> EngineVersion:
    """The table entry of the SGLang installed for the engine's python (:mod:`launch.sglang_versions`); a version
    the table does not know gets the newest's spellings, with a warning (its own parser has the last word)."""
    installed = installed_sglang(engine.python_executable)
    if installed is None or installed in VERSIONS:
        return engine_version(installed or NEWEST)
    logger.warning(f"{engine.python_executable}: SGLang {installed} is not in launch/sglang_versions.py: flags are spelled as for {NEWEST}")
    return engine_version(NEWEST)


def _versioned(version: EngineVersion, key: str, flag: EngineFlag, parts: list[str], device: str) -> list[str]:
    if flag.passed is Passed.OFF and parts and version.cuda_graph_off:
        return list(version.cuda_graph_off)
    return version.translate(flag.flags[0], parts, key, device)


def server_args(
    engine: EngineConfig, *, port: int, served_model_name: str | None = None, version: EngineVersion | None = None
) -> list[str]:
    """The flags after ``-m sglang.launch_server`` (no interpreter), in a stable order, spelled for the engine's
    SGLang ``version`` (default: the one installed for its python). A setting that version lacks raises
    :class:`~launch.sglang_versions.UnsupportedSglang` naming the key and the version."""
    version = version or launch_version(engine)
    grammar_backend = version.grammar_backend(engine.device, engine.grammar_backend)
    if grammar_backend != engine.grammar_backend:
        engine = engine.model_copy(update={"grammar_backend": grammar_backend})
    values = flag_values(engine, port=port, served_model_name=served_model_name)
    args = [part for key, flag in ENGINE_FLAGS.items() for part in _versioned(version, key, flag, flag.argv(values[key]), engine.device)]
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


def engine_reference_table() -> str:
    """The engine section reference of docs/configuration.md: every key, its default, its flags and what it means
    (a test checks that page holds exactly this)."""
    lines = ["| key | default | SGLang flag | meaning |", "|---|---|---|---|"]
    for key, field in EngineConfig.model_fields.items():
        flag = ENGINE_FLAGS.get(key)
        if flag is None:
            spelled = "(not a flag)"
        elif flag.passed is Passed.OFF:
            spelled = " ".join(f"`{name} disabled`" for name in flag.flags) + " when false"
        elif flag.passed is Passed.SWITCH:
            spelled = f"`{flag.flags[0]}` when true"
        elif flag.passed is Passed.LIST:
            spelled = f"`{flag.flags[0]}` followed by each item"
        else:
            spelled = f"`{flag.flags[0]}`"
        lines.append(f"| `{key}` | {default_text(field)} | {spelled} | {meaning(field)} |")
    return "\n".join(lines)


@dataclass(frozen=True)
class EngineEnv:
    """Environment for the engine process, and whether the CPU ``sgl_kernel`` stand-in is on its path."""

    variables: dict[str, str]
    uses_cpu_shim: bool


def build_env(engine: EngineConfig, base: dict[str, str] | None = None) -> EngineEnv:
    """Environment for the engine: the caller's, plus CPU-mode settings, plus ``engine.env``, plus where its
    sockets listen (:func:`launch.engine_net.socket_env`: loopback on one machine)."""
    env = dict(os.environ if base is None else base)
    uses_shim = False
    if engine.device == "cpu":
        env[CPU_ENGINE_ENV] = "1"
        if engine.enable_lora:
            env[CPU_LORA_ENV] = "1"  # the engine plugin's plain memory for SGLang's LoRA layers (cpu_pinned_memory)
        if not real_sgl_kernel_importable(engine.python_executable):
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CPU_SHIM_DIR), env.get("PYTHONPATH", "")) if p)
            uses_shim = True
    if engine.otlp_traces_protocol is not None:
        env[PROTOCOL_ENV] = engine.otlp_traces_protocol  # SGLang's exporter reads only this
    env.update(engine.env)
    env.update(socket_env(engine, env))
    return EngineEnv(env, uses_shim)


def real_sgl_kernel_importable(python: str) -> bool:
    """Whether a real ``sgl_kernel`` imports for ``python`` (then the stand-in must stay off the path).

    PyPI's builds are CUDA-only and fail to import without ``libcuda``; those count as absent.
    """
    if same_interpreter(python) and importlib.util.find_spec("sgl_kernel") is None:
        return False
    try:
        probe = subprocess.run(
            [
                python,
                "-c",
                "import sgl_kernel, sys; sys.exit(1 if getattr(sgl_kernel, 'IS_SGLANG_GATEWAY_CPU_SHIM', False) else 0)",
            ],
            capture_output=True,
            timeout=120,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False  # the launch itself will report a broken interpreter
    return probe.returncode == 0


# ------------------------------------------------------------------------------ SGLang's router
ROUTER_MODULE = "launch.router_main"  # runs sglang_router.launch_router with the secret read from a file


def router_args(router: RouterConfig, *, port: int, metrics_port: int, worker_urls: list[str], tokenizer_path: str) -> list[str]:
    """``sglang_router.launch_router`` flags for a router bound to loopback (its metrics too), in front of
    ``worker_urls``, with a local tokenizer (no hub access). The workers' API key is not here: see
    :mod:`launch.router_main`."""
    args = [
        "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--policy", router.policy, "--tokenizer-path", tokenizer_path,
    ]  # fmt: skip
    if worker_urls:
        args += ["--worker-urls", *worker_urls]
    return args + list(router.extra_args)


ROUTER_API_KEY_FLAG = "--api-key"
ROUTER_ENV = {"HF_HUB_OFFLINE": "1"}  # the router would fetch a tokenizer from the hub otherwise
