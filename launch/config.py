"""The deployment YAML, parsed and validated once (pydantic).

One file describes a deployment: ``models`` maps a model name to either an ``engine`` section
(an SGLang server this project launches) or a ``url`` (an SGLang server or router run elsewhere).
A top-level ``gateway`` section belongs to the gateway package; this module keeps it as an opaque
mapping so that ``launch`` never imports ``gateway``.

Every error names the file, the key path and the reason on one line (:class:`ConfigError`).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from launch.tracing import engine_tracing_keys

Device = Literal["cuda", "cpu"]
DType = Literal["auto", "half", "float16", "bfloat16", "float", "float32"]
GrammarBackend = Literal["xgrammar", "outlines", "llguidance", "none"]

# Default KV-cache size on CPU: without it SGLang sizes the cache from free RAM (15 GB, 70 s start).
CPU_DEFAULT_MAX_TOTAL_TOKENS = 8192
# The engine python for every engine whose `python:` is unset (another SGLang version's environment, e.g.
# `make test-sglang-0.5.10.post1` runs tests against the CUDA 12 profile's SGLang on CPU this way).
ENGINE_PYTHON_ENV = "SGLANG_GATEWAY_ENGINE_PYTHON"
_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:]+\]|[^\s:/\[\]]+):\d{1,5}$")  # host:port, [IPv6]:port
_ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")

# The names of the ``gateway:`` settings that code outside the gateway package reads too (the section
# stays opaque here: ``gateway.config.GatewaySettings`` defines and checks them). Written only here.
GATEWAY_KEY_LISTS = ("api_keys", "admin_keys", "keys")
"""The gateway's lists of bearer keys (plain client keys, admin keys, named keys with limits); each can also come
from an ``_env`` variable and a ``_file``."""
GATEWAY_KEY_FILE_SETTINGS = tuple(f"{keys}_file" for keys in GATEWAY_KEY_LISTS)
"""The key-file settings: paths relative to the deployment file."""
GATEWAY_KEY_SETTINGS = tuple(f"{keys}{source}" for keys in GATEWAY_KEY_LISTS for source in ("", "_env", "_file"))
"""Every setting that gives the gateway keys: the lists, their variables and their files."""
GATEWAY_PER_MODEL_SETTINGS = ("model_limits", "swap_policy", "model_balancing", "extension_fields")
"""The settings that map model names to per-model overrides (each name must be a model of the file)."""


class ConfigError(ValueError):
    """A config file that cannot be used; the message is one line: ``file: key: reason``."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True, frozen=True)


class EngineConfig(_Strict):
    """One SGLang server process: every field but the launcher's own maps to ``sglang.launch_server`` flags
    (``launch.argv.ENGINE_FLAGS``; ``launch.argv.NOT_FLAGS`` names the others)."""

    model_path: str = Field(description="Local directory with the weights, or a Hugging Face id.")
    tokenizer_path: str | None = Field(None, description="Tokenizer directory or id (unset: the model's).")
    served_model_name: str | None = Field(
        None, description="Name the engine reports (unset: the model's name in this file)."
    )
    host: str = Field("127.0.0.1", description="Interface the engine binds to.")
    port: int = Field(0, ge=0, le=65535, description="Engine port; 0 picks a free one at launch.")
    tp_size: int = Field(
        1, ge=1, description="Tensor-parallel size: GPUs per replica (checked against the visible GPUs)."
    )
    dp_size: int = Field(1, ge=1, description="Data-parallel replicas.")
    nnodes: int = Field(
        1, ge=1, description="Machines one engine spans, for a model larger than one machine (tp_size counts them all)."
    )
    node_rank: int = Field(
        0, ge=0, description="This machine's rank among nnodes; 0 serves HTTP, the others only compute."
    )
    dist_init_addr: str | None = Field(
        None, description="host:port where rank 0 meets the other machines (required when nnodes > 1)."
    )
    mem_fraction_static: float | None = Field(
        None,
        gt=0.0,
        lt=1.0,
        description="Fraction of GPU memory for weights and KV cache, in (0, 1) (unset: SGLang's).",
    )
    max_total_tokens: int | None = Field(
        None,
        gt=0,
        description=f"KV-cache size in tokens (unset: SGLang's on cuda, {CPU_DEFAULT_MAX_TOTAL_TOKENS} on cpu).",
    )
    context_length: int | None = Field(None, gt=0, description="Context length (unset: the model's).")
    max_running_requests: int | None = Field(
        None, gt=0, description="Concurrent requests in the engine (unset: SGLang's)."
    )
    dtype: DType = Field("auto", description="Weight and activation dtype.")
    quantization: str | None = Field(None, description="SGLang quantization method, e.g. fp8, awq, gptq (unset: none).")
    cuda_graph: bool | None = Field(None, description="Capture CUDA graphs (unset: on for cuda; never on cpu).")
    cuda_graph_max_bs: int | None = Field(
        None, gt=0, description="Largest batch captured in a CUDA graph (unset: SGLang's)."
    )
    chunked_prefill_size: int | None = Field(
        None, description="Prefill chunk size in tokens; -1 disables chunking (unset: SGLang's)."
    )
    grammar_backend: GrammarBackend | None = Field(None, description="Structured-output backend (unset: SGLang's).")
    tool_call_parser: str | None = Field(
        None, description="Tool-call parser, e.g. qwen25, llama3, hermes (unset: none)."
    )
    reasoning_parser: str | None = Field(None, description="Reasoning parser, e.g. deepseek-r1, qwen3 (unset: none).")
    chat_template: str | None = Field(None, description="Chat template name or file (unset: the model's).")
    attention_backend: str | None = Field(
        None, description="Attention kernels (unset: SGLang's choice on cuda, torch_native on cpu)."
    )
    device: Device = Field("cuda", description="Where the engine runs: a GPU, or the CPU (development and tests).")
    trust_remote_code: bool = Field(False, description="Allow custom model code from the model repo.")
    json_disable_any_whitespace: bool = Field(
        False, description="Forbid free whitespace in constrained JSON (helps small models)."
    )
    sleep_on_idle: bool | None = Field(
        None, description="Let the scheduler sleep when idle instead of spinning a core (unset: on for cpu)."
    )
    skip_server_warmup: bool = Field(False, description="Skip SGLang's warm-up request (faster start).")
    enable_response_store: bool = Field(
        False, description="Keep Responses API results in the engine (GET /v1/responses/{id}, previous_response_id)."
    )
    enable_metrics: bool = Field(True, description="Expose the engine's Prometheus /metrics.")
    enable_memory_saver: bool = Field(
        False, description="Let the engine release and take back its GPU memory at run time (set by residency sleep: memory_saver)."
    )
    enable_weights_cpu_backup: bool = Field(
        False, description="Keep a CPU copy of the weights, so that a memory release needs no reload (set with enable_memory_saver)."
    )
    enable_priority_scheduling: bool = Field(
        False, description="Schedule by each request's priority (higher first); the gateway passes a named key's priority."
    )
    random_seed: int | None = Field(None, description="Engine random seed (unset: SGLang picks one).")
    enable_lora: bool = Field(False, description="Serve LoRA adapters on this engine (set by the model's adapters).")
    lora_paths: dict[str, str] = Field(
        default_factory=dict, description="Adapters loaded at start, name -> path (set from models.<name>.adapters)."
    )
    max_lora_rank: int | None = Field(None, gt=0, description="Largest adapter rank (unset: the largest at start).")
    lora_target_modules: list[str] | None = Field(
        None, description="Modules adapters may target, e.g. [q_proj, v_proj] or [all] (unset: those at start)."
    )
    max_loras_per_batch: int | None = Field(None, gt=0, description="Adapters in one batch (unset: SGLang's, 8).")
    max_loaded_loras: int | None = Field(None, gt=0, description="Adapters held in memory at once (unset: no limit).")
    lora_eviction_policy: Literal["lru", "fifo"] | None = Field(
        None, description="Which loaded adapter makes room for another (unset: SGLang's, lru)."
    )
    lora_backend: str | None = Field(None, description="LoRA kernels (unset: SGLang's on cuda, torch_native on cpu).")
    enable_trace: bool = Field(
        False, description="Export the engine's own OpenTelemetry spans (set for every engine by gateway.tracing.engines)."
    )
    otlp_traces_endpoint: str | None = Field(
        None, description="Where the engine sends its spans: host:port (grpc) or a .../v1/traces URL (http/protobuf)."
    )
    otlp_traces_protocol: Literal["grpc", "http/protobuf"] | None = Field(
        None, description="OTLP protocol of the engine's exporter (unset: SGLang's, grpc)."
    )
    otlp_service_name: str | None = Field(None, description="service.name of the engine's spans (unset: sglang).")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment variables for the engine process.")
    python: str | None = Field(
        None,
        description=(
            "Python executable that runs SGLang, e.g. a separate venv with another SGLang version "
            "(unset: $SGLANG_GATEWAY_ENGINE_PYTHON, else this interpreter)."
        ),
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description="Flags passed to SGLang verbatim, after the ones above, for options not named here.",
    )
    startup_timeout_s: float = Field(
        900.0, gt=0, description="Seconds the launcher waits for the engine's /health to answer 200."
    )

    @field_validator("model_path")
    @classmethod
    def _non_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        return value

    @field_validator("chunked_prefill_size")
    @classmethod
    def _chunk(cls, value: int | None) -> int | None:
        if value is not None and value != -1 and value <= 0:
            raise ValueError("must be a positive number of tokens, or -1 to disable chunking")
        return value

    @field_validator("env", mode="before")
    @classmethod
    def _env_strings(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {str(k): v if isinstance(v, str) else _scalar_to_str(k, v) for k, v in value.items()}
        return value

    @field_validator("extra_args")
    @classmethod
    def _extra(cls, value: list[str]) -> list[str]:
        return flags_first(value)

    @model_validator(mode="after")
    def _consistent(self) -> EngineConfig:
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be below nnodes {self.nnodes}")
        if self.lora_paths and not self.enable_lora:
            raise ValueError("lora_paths needs enable_lora: true (models.<name>.adapters sets both)")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("nnodes > 1 needs dist_init_addr (host:port of the machine with node_rank 0)")
        if self.dist_init_addr is not None and not _HOST_PORT.match(self.dist_init_addr):
            raise ValueError(f"dist_init_addr must be host:port, got {self.dist_init_addr!r}")
        if self.device == "cpu":
            if self.cuda_graph:
                raise ValueError("cuda_graph: true needs device: cuda")
            if self.cuda_graph_max_bs is not None:
                raise ValueError("cuda_graph_max_bs needs device: cuda")
        elif self.cuda_graph is False and self.cuda_graph_max_bs is not None:
            raise ValueError("cuda_graph_max_bs is set but cuda_graph is false")
        return self

    @property
    def cuda_graph_enabled(self) -> bool:
        return self.cuda_graph if self.cuda_graph is not None else self.device == "cuda"

    @property
    def python_executable(self) -> str:
        return self.python or os.environ.get(ENGINE_PYTHON_ENV) or sys.executable


def flags_first(args: list[str]) -> list[str]:
    """``extra_args`` passed verbatim to a command line must start with a flag (``--name``)."""
    if args and not args[0].startswith("--"):
        raise ValueError(f"must start with a flag (--name), got {args[0]!r}")
    return args


def _scalar_to_str(key: Any, value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (int, float)):
        return str(value)
    raise ValueError(f"env.{key} must be a string, number or boolean")


class RouterConfig(_Strict):
    """SGLang's own router (PyPI ``sglang-router``) in front of a model's replicas, started by the gateway."""

    policy: Literal["cache_aware", "power_of_two", "round_robin", "random"] = Field(
        "cache_aware", description="How the router picks a replica."
    )
    extra_args: list[str] = Field(default_factory=list, description="Router flags passed verbatim.")
    python: str | None = Field(None, description="Python executable with sglang-router installed (default: this one).")
    startup_timeout_s: float = Field(120.0, gt=0, description="How long to wait for the router's /health.")

    @field_validator("extra_args")
    @classmethod
    def _extra(cls, value: list[str]) -> list[str]:
        return flags_first(value)

    @property
    def python_executable(self) -> str:
        return self.python or sys.executable


class ResidencyConfig(_Strict):
    """When a launched model's engine runs: from boot (the default), or only while it is used."""

    on_demand: bool = Field(False, description="Start the engine at the model's first request instead of at boot.")
    idle_stop_s: float | None = Field(
        None, gt=0, description="Stop the engine after this many seconds without a request (the next request starts it again)."
    )
    group: str | None = Field(
        None,
        description="A group of gateway.residency_groups (models sharing GPUs): at most its max_resident run at once; "
        "the least recently used idle one is stopped to make room.",
    )
    sleep: Literal["stop", "memory_saver"] = Field(
        "stop",
        description="How an idle engine sleeps: stop (its process ends; a wake is a cold start) or memory_saver (GPU only: "
        "the process stays and releases its weights and KV cache through SGLang's API; a wake takes them back in seconds).",
    )


class ModelEntry(_Strict):
    """A model the deployment serves: launched here (``engine``) or reached at ``url``."""

    engine: EngineConfig | None = None
    url: str | None = Field(None, description="Base URL of an SGLang server or router run elsewhere.")
    served_model_name: str | None = Field(
        None, description="Name the external server expects in 'model' (default: this model's name)."
    )
    api_key: str | None = Field(None, description="Bearer key the external server requires (use ${ENV_VAR}).")
    vocab_size: int | None = Field(
        None, gt=0, description="Vocabulary size of the external model: token ids outside it are refused with 400."
    )
    enable_priority_scheduling: bool = Field(
        False,
        description="The external server runs SGLang's priority scheduling (--enable-priority-scheduling): the gateway "
        "sends it each request's priority class as the request's priority, as for an engine with that key.",
    )
    aliases: list[str] = Field(default_factory=list, description="Other names clients may use.")
    replicas: int = Field(1, ge=1, le=64, description="Independent engines of this engine section behind the one name.")
    replica_gpus: list[list[int]] | None = Field(
        None, description="GPU ids per replica (default: consecutive slices of the visible GPUs, tp_size x dp_size each)."
    )
    router: RouterConfig | None = Field(
        None, description="Put SGLang's router in front of the replicas (instead of the gateway's own balancing)."
    )
    residency: ResidencyConfig | None = Field(
        None, description="Start the engine on demand, stop it when idle, share GPUs with a group (docs/residency.md)."
    )
    adapters: dict[str, str] = Field(
        default_factory=dict,
        description="LoRA adapters served by this model's engine, name -> path; each is the model '<name>:<adapter>' (docs/adapters.md).",
    )
    adapter_aliases: dict[str, str] = Field(
        default_factory=dict, description="Other names of adapters, alias -> adapter: the alias is served as '<name>:<adapter>'."
    )

    @model_validator(mode="before")
    @classmethod
    def _adapter_keys(cls, data: Any) -> Any:
        """``adapters`` set the engine keys that load them at start: ``enable_lora`` and ``lora_paths``."""
        if isinstance(data, dict) and data.get("adapters") and isinstance(data.get("engine"), dict):
            engine = data["engine"]
            if "lora_paths" in engine and engine["lora_paths"] != data["adapters"]:  # equal: a dumped config read back
                raise ValueError("give LoRA adapters once: in adapters (served as '<model>:<adapter>'), not also engine.lora_paths")
            if isinstance(data["adapters"], dict):
                data = {**data, "engine": {**engine, "enable_lora": True, "lora_paths": data["adapters"]}}
        return data

    @field_validator("adapters")
    @classmethod
    def _adapter_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name, path in value.items():
            if not _ADAPTER_NAME.match(name):
                raise ValueError(f"adapter name {name!r}: letters, digits, '_', '.' and '-' only (it becomes '<model>:{name}')")
            if not str(path).strip():
                raise ValueError(f"adapter {name!r}: the path is empty")
        return value

    @model_validator(mode="before")
    @classmethod
    def _memory_saver_keys(cls, data: Any) -> Any:
        """``residency.sleep: memory_saver`` sets the engine keys SGLang's memory saver needs (unless given)."""
        if isinstance(data, dict):
            residency, engine = data.get("residency"), data.get("engine")
            if isinstance(residency, dict) and residency.get("sleep") == "memory_saver" and isinstance(engine, dict):
                data = {**data, "engine": {"enable_memory_saver": True, "enable_weights_cpu_backup": True, **engine}}
        return data

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^https?://[^\s/]+", value):
            raise ValueError(f"must be an http(s) URL, got {value!r}")
        return value.rstrip("/") if value else value

    @model_validator(mode="after")
    def _one_source(self) -> ModelEntry:
        if (self.engine is None) == (self.url is None):
            raise ValueError("give exactly one of 'engine' (launched here) or 'url' (run elsewhere)")
        if self.engine is not None and (self.served_model_name or self.api_key or self.vocab_size or self.enable_priority_scheduling):
            raise ValueError(
                "served_model_name, api_key, vocab_size and enable_priority_scheduling belong to a 'url' model "
                "(an engine's name is engine.served_model_name, its scheduling engine.enable_priority_scheduling; "
                "its vocabulary is read from the model's files)"
            )
        if self.engine is None and self.adapters:
            raise ValueError("adapters need an 'engine' section (the gateway loads them into the engine it starts)")
        for alias, adapter in self.adapter_aliases.items():
            if adapter not in self.adapters:
                raise ValueError(f"adapter_aliases.{alias}: no adapter named {adapter!r} (adapters: {', '.join(self.adapters) or 'none'})")
        if self.engine is None and (self.replicas != 1 or self.replica_gpus is not None or self.router is not None):
            raise ValueError("replicas, replica_gpus and router need an 'engine' section (a 'url' model is one upstream)")
        if self.replicas > 1 and self.engine is not None and self.engine.nnodes > 1:
            raise ValueError("replicas run on this machine: an engine spanning machines (nnodes > 1) has none")
        if self.replicas > 1 and self.engine is not None and self.engine.port != 0:
            raise ValueError(f"replicas: {self.replicas} engines cannot share engine.port {self.engine.port}; leave it 0 (free ports)")
        if self.replica_gpus is not None:
            self._check_replica_gpus(self.replica_gpus)
        if self.residency is not None and (self.engine is None or self.router is not None):
            raise ValueError("residency needs an 'engine' section without a router (a 'url' model runs elsewhere)")
        if self.residency is not None and self.residency.sleep == "memory_saver" and self.engine is not None:
            if self.engine.device != "cuda":
                raise ValueError("residency.sleep: memory_saver needs device: cuda (SGLang's memory saver frees GPU memory; on cpu a sleep is a stop)")
            if not (self.engine.enable_memory_saver and self.engine.enable_weights_cpu_backup):
                raise ValueError("residency.sleep: memory_saver needs engine.enable_memory_saver and enable_weights_cpu_backup (leave them unset)")
        return self

    def _check_replica_gpus(self, gpus: list[list[int]]) -> None:
        assert self.engine is not None
        if self.engine.device != "cuda":
            raise ValueError("replica_gpus needs device: cuda")
        if len(gpus) != self.replicas:
            raise ValueError(f"replica_gpus lists {len(gpus)} replica(s), replicas is {self.replicas}")
        per_replica = self.engine.tp_size * self.engine.dp_size
        seen: set[int] = set()
        for index, ids in enumerate(gpus):
            if len(ids) != per_replica:
                raise ValueError(f"replica_gpus[{index}] has {len(ids)} GPU(s); tp_size x dp_size = {per_replica}")
            if any(gpu < 0 for gpu in ids) or seen & set(ids):
                raise ValueError(f"replica_gpus[{index}]: GPU ids must be distinct non-negative numbers, got {ids}")
            seen |= set(ids)


class DeploymentConfig(_Strict):
    """The whole YAML file."""

    models: dict[str, ModelEntry] = Field(min_length=1)
    gateway: dict[str, Any] = Field(default_factory=dict, description="Validated by the gateway package.")
    source: Path | None = Field(None, exclude=True, description="The file this was read from.")

    @model_validator(mode="before")
    @classmethod
    def _engines_traced(cls, data: Any) -> Any:
        """``gateway.tracing.engines``: every managed engine exports its spans to the gateway's collector (an engine
        that says ``enable_trace`` itself keeps its own keys)."""
        if not isinstance(data, dict) or not isinstance(data.get("gateway"), dict) or not isinstance(data.get("models"), dict):
            return data
        models = {}
        for name, entry in data["models"].items():
            engine = entry.get("engine") if isinstance(entry, dict) else None
            keys = engine_tracing_keys(data["gateway"], str(name)) if isinstance(engine, dict) and "enable_trace" not in engine else {}
            models[name] = {**entry, "engine": {**engine, **keys}} if keys else entry
        return {**data, "models": models}

    @field_validator("models")
    @classmethod
    def _names(cls, value: dict[str, ModelEntry]) -> dict[str, ModelEntry]:
        seen: dict[str, str] = {}
        for name, entry in value.items():
            for alias in entry.adapter_aliases:
                if alias in (name, *entry.aliases):
                    raise ValueError(f"adapter alias {alias!r} is a name of model {name!r} itself (its base model)")
            for label in (name, *entry.aliases, *entry.adapter_aliases):
                if not _MODEL_NAME.match(label):
                    raise ValueError(f"{label!r} is not a valid model name")
                if label in seen and seen[label] != name:
                    raise ValueError(f"name {label!r} is used by both {seen[label]!r} and {name!r}")
                seen[label] = name
        return value

    def engine(self, name: str) -> EngineConfig:
        """The engine section of model ``name`` (ConfigError when absent)."""
        entry = self.models.get(name)
        if entry is None:
            known = ", ".join(self.models)
            raise ConfigError(f"{self.source or 'config'}: no model named {name!r} (models: {known})")
        if entry.engine is None:
            raise ConfigError(f"{self.source or 'config'}: model {name!r} has a url, not an engine section")
        return entry.engine

    def managed(self) -> dict[str, EngineConfig]:
        """Models whose engine this deployment launches, by name."""
        return {name: entry.engine for name, entry in self.models.items() if entry.engine is not None}


def _resolve_relative_paths(data: Any, base: Path) -> Any:
    """Make ``./x`` and ``../x`` model, tokenizer, template and adapter paths relative to the YAML file, not the CWD."""
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, dict):
        return data

    def resolved(value: Any) -> Any:
        return str((base / value).resolve()) if isinstance(value, str) and value.startswith(("./", "../")) else value

    for entry in models.values():
        if isinstance(entry, dict) and isinstance(entry.get("adapters"), dict):
            entry["adapters"] = {name: resolved(path) for name, path in entry["adapters"].items()}
        engine = entry.get("engine") if isinstance(entry, dict) else None
        if not isinstance(engine, dict):
            continue
        for key in ("model_path", "tokenizer_path", "chat_template"):
            if key in engine:
                engine[key] = resolved(engine[key])
        if isinstance(engine.get("lora_paths"), dict):
            engine["lora_paths"] = {name: resolved(path) for name, path in engine["lora_paths"].items()}
    return data


def format_validation_error(source: str, error: ValidationError) -> str:
    """One line per problem: ``file: models.tiny.engine.tp_size: Input should be ...``."""
    lines = []
    for problem in error.errors():
        location = ".".join(str(part) for part in problem["loc"]) or "(top level)"
        message = problem["msg"].removeprefix("Value error, ")
        if problem["type"] == "extra_forbidden":
            message = "unknown key"
        elif problem["type"] == "missing":
            message = "required key is missing"
        lines.append(f"{source}: {location}: {message}")
    return "\n".join(lines)


def parse_config(data: Any, source: str | Path = "<config>") -> DeploymentConfig:
    """Validate an already-loaded mapping (used for MLflow ``model_config`` dicts too)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping with a 'models' key, got {type(data).__name__}")
    try:
        config = DeploymentConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(format_validation_error(str(source), error)) from None
    return config.model_copy(update={"source": Path(source)}) if source != "<config>" else config


def load_config(path: str | Path) -> DeploymentConfig:
    """Read, expand ``${VAR}`` / ``${VAR:-default}``, and validate a deployment YAML file."""
    file = Path(path)
    return parse_config(_resolve_relative_paths(read_yaml(file), file.parent), file)


def read_yaml(file: Path) -> Any:
    """A YAML file's data with ``${VAR}`` expanded; ConfigError naming the file (and line) otherwise."""
    try:
        text = file.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{file}: no such file") from None
    except OSError as error:
        raise ConfigError(f"{file}: cannot read: {error.strerror}") from None
    try:
        data = yaml.safe_load(expand_env(text, file))
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"{file}: {where}invalid YAML: {problem}") from None
    return data


_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand_env(text: str, source: str | Path = "<config>") -> str:
    """Replace ``${VAR}`` and ``${VAR:-default}``; an unset variable without default is an error."""

    def replace(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        value = os.environ.get(name)
        if value is not None:
            return value
        if default is not None:
            return default
        raise ConfigError(f"{source}: environment variable {name} is not set (write ${{{name}:-default}})")

    return _ENV_REF.sub(replace, text)
