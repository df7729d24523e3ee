"""What a loaded model serves: ``model_config`` validated into a :class:`Target` (an engine to start, or a
URL to reach) plus the wrapper's own settings (:class:`ModelCodeSettings`, the ``mlflow:`` section).

``model_config`` has the shape of the deployment YAML (``models:`` mapping, optionally ``gateway:``),
plus the optional ``mlflow:`` section. A bare engine section (a mapping with ``model_path``) is accepted
too and served as ``model``. ``replicas: N`` (and ``replica_gpus``) on the served model run N engines of
its engine section (see :mod:`model_code.engine_owner`); ``router:`` is refused (the wrapper balances itself).

While MLflow logs a model it loads it and predicts on the input example two or three times. No engine
is started then: :func:`in_log_time` detects it (our ``log_model`` sets
``SGLANG_GATEWAY_MLFLOW_NO_ENGINE=1``; a plain ``mlflow.pyfunc.log_model`` / ``save_model`` is
recognised from the call stack).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from launch.config import ConfigError, DeploymentConfig, EngineConfig, ModelEntry, format_validation_error, parse_config

WEIGHTS_ARTIFACT = "llm-model"
"""Key of the local weights in ``context.artifacts`` (the name notebooks that log models by hand already use)."""
ADAPTER_ARTIFACT_PREFIX = "lora-"
"""Key prefix of a packed LoRA adapter in ``context.artifacts``: ``lora-<adapter name>``."""
NO_ENGINE_ENV = "SGLANG_GATEWAY_MLFLOW_NO_ENGINE"
"""Set to ``1`` to load models without starting an engine (log time; also usable by hand)."""
SHOW_ENGINE_LOG_ENV = "SGLANG_GATEWAY_SHOW_ENGINE_LOG"
"""Set to ``1`` to print every engine log line whatever ``show_engine_log`` says (debugging a deployment)."""
SETTINGS_KEY = "mlflow"
EngineSharing = Literal["shared", "per_process"]
TracingMode = Literal["on", "off", "sampled"]
LOG_TIME_TEXT = "(placeholder: no engine runs while MLflow logs the model)"


class ModelCodeSettings(BaseModel):
    """The optional ``mlflow:`` section of ``model_config``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(
        None, description="Which entry of 'models' to serve (default: the only one, or the one aliased 'default')."
    )
    defaults: dict[str, Any] = Field(
        default_factory=dict, description="Default generation parameters, e.g. max_tokens."
    )
    request_timeout_s: float = Field(600.0, gt=0, description="Timeout of one engine request.")
    max_retries: int = Field(
        0, ge=0, description="Retries of a call the engine answered 429 or 5xx (never of one the engine failed under)."
    )
    api_key_env: str | None = Field(
        None, description="Environment variable holding the API key of a URL target (gateway with auth)."
    )
    keep_port: bool = Field(False, description="Use the engine port of the config instead of a free one.")
    batch_concurrency: int = Field(8, ge=1, description="Concurrent requests of batch_predict.")
    log_dir: str | None = Field(None, description="Directory for engine logs (default: the system temp dir).")
    engine_sharing: EngineSharing = Field(
        "shared",
        description="shared: every process of this machine that loads the model uses one engine (mlflow models "
        "serve -w N, notebooks); per_process: each loading process starts its own.",
    )
    show_engine_log: bool = Field(
        False,
        description="Also print every engine log line (default: only start-up phases, warnings and errors; "
        f"the environment variable {SHOW_ENGINE_LOG_ENV}=1 turns it on too).",
    )
    tracing: TracingMode = Field(
        "on", description="One MLflow trace per predict / predict_stream: on, off, or sampled (trace_sample_ratio)."
    )
    trace_sample_ratio: float = Field(
        0.1, gt=0.0, le=1.0, description="Share of calls traced when tracing is 'sampled'."
    )


def show_engine_log(settings: ModelCodeSettings) -> bool:
    """Whether every engine log line is printed: the setting, or the environment variable."""
    return settings.show_engine_log or os.environ.get(SHOW_ENGINE_LOG_ENV, "").strip().lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class Target:
    """What one loaded model talks to: an engine to start (``engine``) or a running server (``url``)."""

    name: str
    engine: EngineConfig | None
    url: str | None
    settings: ModelCodeSettings
    deployment: DeploymentConfig
    served_name: str = ""
    api_key: str | None = None
    adapters: tuple[str, ...] | None = None  # the engine's LoRA adapters (None: a URL target, whose server knows its own)

    @property
    def entry(self) -> ModelEntry:
        """The served model's entry with the engine section this target starts (local weights, free port):
        its ``replicas`` and ``replica_gpus`` say how many engines of it to run."""
        return self.deployment.models[self.name].model_copy(update={"engine": self.engine})


def split_model_config(model_config: Mapping[str, Any] | None) -> tuple[dict[str, Any], ModelCodeSettings]:
    """(deployment mapping, settings) from a ``model_config``; a bare engine section becomes ``models.model``."""
    if not model_config:
        raise ConfigError("model_config: empty; give the deployment YAML ('models:' mapping) or an engine section")
    data = dict(model_config)
    raw_settings = data.pop(SETTINGS_KEY, None) or {}
    if "models" not in data and "model_path" in data:
        name = str(data.get("served_model_name") or "model")
        data = {"models": {name: {"engine": data}}}
    try:
        settings = ModelCodeSettings.model_validate(raw_settings)
    except ValidationError as error:
        raise ConfigError(format_validation_error("model_config: mlflow", error)) from None
    return data, settings


def resolve_target(model_config: Mapping[str, Any] | None, artifacts: Mapping[str, str] | None = None) -> Target:
    """Validate ``model_config`` and pick the model; local weights in ``artifacts`` replace ``model_path``."""
    data, settings = split_model_config(model_config)
    deployment = parse_config(data, "model_config")
    name = _pick_model(deployment, settings)
    entry = deployment.models[name]
    if entry.router is not None:
        raise ConfigError(
            f"model_config: models.{name}.router: router is served by `sglang-gateway serve`, not by the MLflow "
            "wrapper (it balances the replicas itself); remove the key"
        )
    engine = entry.engine
    if engine is not None:
        updates: dict[str, Any] = {}
        weights = (artifacts or {}).get(WEIGHTS_ARTIFACT)
        if weights:
            updates["model_path"] = str(weights)
        packed = {name: (artifacts or {}).get(adapter_artifact(name)) for name in engine.lora_paths}
        if any(packed.values()):  # adapters logged with the model: their copies beside the weights
            updates["lora_paths"] = {name: packed[name] or path for name, path in engine.lora_paths.items()}
        if not settings.keep_port:
            updates["port"] = 0  # two load_model calls in one process must not collide
        engine = engine.model_copy(update=updates) if updates else engine
    # the name the engine / upstream expects in "model" (the YAML key unless the config renames it)
    served = (engine.served_model_name if engine is not None else entry.served_model_name) or name
    adapters = tuple(engine.lora_paths) if engine is not None else None
    return Target(name, engine, entry.url, settings, deployment, served, entry.api_key, adapters)


def adapter_artifact(name: str) -> str:
    """The artifact key (and folder name) of the packed adapter ``name``."""
    return f"{ADAPTER_ARTIFACT_PREFIX}{name}"


def _pick_model(deployment: DeploymentConfig, settings: ModelCodeSettings) -> str:
    if settings.model:
        for name, entry in deployment.models.items():
            if settings.model == name or settings.model in entry.aliases:
                return name
        raise ConfigError(
            f"model_config: mlflow.model: no model named {settings.model!r} (models: {', '.join(deployment.models)})"
        )
    if len(deployment.models) == 1:
        return next(iter(deployment.models))
    for name, entry in deployment.models.items():
        if "default" in entry.aliases:
            return name
    raise ConfigError(
        f"model_config: {len(deployment.models)} models and none aliased 'default'; set mlflow.model to one of: "
        + ", ".join(deployment.models)
    )


# ------------------------------------------------------------------------------ log-time detection
# (file suffix, function) of MLflow frames under which a model is loaded only to be validated.
_MLFLOW_LOG_FRAMES = (
    (os.path.join("mlflow", "models", "model.py"), "log"),
    (os.path.join("mlflow", "pyfunc", "__init__.py"), "save_model"),
)


def in_log_time() -> bool:
    """Whether the model is being loaded by MLflow's logging/saving (or the no-engine switch is on)."""
    if os.environ.get(NO_ENGINE_ENV, "").strip().lower() in ("1", "true", "yes"):
        return True
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        for suffix, function in _MLFLOW_LOG_FRAMES:
            if code.co_name == function and code.co_filename.endswith(suffix):
                return True
        frame = frame.f_back
    return False
