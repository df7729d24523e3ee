"""The engine behind every MLflow flavour: started from ``model_config`` (or reached at a URL) and called
with the ``openai`` client.

``model_config`` has the shape of the deployment YAML (``models:`` mapping, optionally ``gateway:``),
plus an optional ``mlflow:`` section for this package (see :class:`ModelCodeSettings`). A bare engine
section (a mapping with ``model_path``) is accepted too and served as ``model``.

Engines are started from one long-lived daemon thread of this module (the parent-death signal fires
when the *thread* that forked the engine exits, and ``load_context`` may run on a short-lived one),
registered, and stopped by :meth:`EngineClient.close`, :func:`stop_all`, or ``atexit``; the
parent-death signal covers the cases where none of these runs (SIGTERM'd serving workers).

While MLflow logs a model it loads it and predicts on the input example two or three times. The
engine is not started then: :func:`in_log_time` detects it (our ``log_model`` sets
``SGLANG_GATEWAY_MLFLOW_NO_ENGINE=1``; a plain ``mlflow.pyfunc.log_model`` / ``save_model`` is
recognised from the call stack) and the flavours answer from :class:`LogTimeClient`, which validates
the request exactly like the real client and returns a placeholder completion.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import os
import queue
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
from loguru import logger
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from launch.config import ConfigError, DeploymentConfig, EngineConfig, format_validation_error, parse_config
from launch.preflight import preflight, require
from launch.process import EngineProcess, new_engine_key
from model_code.errors import BadRequestError, EngineRequestError, EngineUnavailableError, from_openai_error
from model_code.params import build_request

WEIGHTS_ARTIFACT = "llm-model"
"""Key of the local weights in ``context.artifacts`` (same name as the seeds)."""
NO_ENGINE_ENV = "SGLANG_GATEWAY_MLFLOW_NO_ENGINE"
"""Set to ``1`` to load models without starting an engine (log time; also usable by hand)."""
SETTINGS_KEY = "mlflow"
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
    max_retries: int = Field(0, ge=0, description="openai client retries (connection errors, 429, 5xx).")
    api_key_env: str | None = Field(
        None, description="Environment variable holding the API key of a URL target (gateway with auth)."
    )
    keep_port: bool = Field(False, description="Use the engine port of the config instead of a free one.")
    batch_concurrency: int = Field(8, ge=1, description="Concurrent requests of batch_predict.")
    log_dir: str | None = Field(None, description="Directory for engine logs (default: the system temp dir).")


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
    engine = entry.engine
    if engine is not None:
        updates: dict[str, Any] = {}
        weights = (artifacts or {}).get(WEIGHTS_ARTIFACT)
        if weights:
            updates["model_path"] = str(weights)
        if not settings.keep_port:
            updates["port"] = 0  # two load_model calls in one process must not collide
        engine = engine.model_copy(update=updates) if updates else engine
    # the name the engine / upstream expects in "model" (the YAML key unless the config renames it)
    served = (engine.served_model_name if engine is not None else entry.served_model_name) or name
    return Target(name, engine, entry.url, settings, deployment, served, entry.api_key)


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


# ------------------------------------------------------------------------------ engine lifecycle
class _StarterThread:
    """One daemon thread that forks every engine, so the parent-death signal is tied to the process."""

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[Any, concurrent.futures.Future[Any]]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def run(self, fn: Any) -> Any:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="sglang-engine-starter", daemon=True)
                self._thread.start()
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._queue.put((fn, future))
        return future.result()

    def _loop(self) -> None:
        while True:
            fn, future = self._queue.get()
            try:
                future.set_result(fn())
            except BaseException as error:  # handed back to the caller
                future.set_exception(error)


_STARTER = _StarterThread()
_LIVE: dict[int, EngineProcess] = {}
_LIVE_LOCK = threading.Lock()
STARTS = 0
"""Engines started by this module in this process (tests use it to prove logging starts none)."""


def start_engine(name: str, engine: EngineConfig, *, log_dir: str | Path | None = None) -> EngineProcess:
    """Preflight, start (from the starter thread), register, and wait until ``/health`` is 200."""
    global STARTS
    checked = require(preflight(engine), name)
    process = EngineProcess(name, checked, log_dir=log_dir, api_key=new_engine_key())
    _STARTER.run(process.start)
    with _LIVE_LOCK:
        STARTS += 1
        _LIVE[id(process)] = process
    try:
        process.wait_ready()
    except BaseException:
        stop_engine(process)
        raise
    return process


def stop_engine(process: EngineProcess) -> None:
    with _LIVE_LOCK:
        _LIVE.pop(id(process), None)
    try:
        process.stop()
    except Exception:  # stopping must never raise out of close()/atexit
        logger.exception("stopping engine {} failed", process.name)


def live_engines() -> list[EngineProcess]:
    with _LIVE_LOCK:
        return list(_LIVE.values())


def stop_all() -> int:
    """Stop every engine this process started through ``model_code``; returns how many."""
    engines = live_engines()
    for process in engines:
        stop_engine(process)
    return len(engines)


atexit.register(stop_all)


# ------------------------------------------------------------------------------ usage & tracing
def usage_dict(usage: Any) -> dict[str, int] | None:
    if usage is None:
        return None
    data = usage.model_dump() if hasattr(usage, "model_dump") else dict(usage)
    out = {k: int(data[k]) for k in ("prompt_tokens", "completion_tokens", "total_tokens") if data.get(k) is not None}
    return out or None


def record_usage(usage: Mapping[str, int] | None) -> None:
    """Put token usage on the active MLflow span (the trace then reports it)."""
    if not usage:
        return
    try:
        import mlflow
        from mlflow.tracing.constant import SpanAttributeKey

        span = mlflow.get_current_active_span()
        if span is None:
            return
        span.set_attribute(
            SpanAttributeKey.CHAT_USAGE,
            {
                "input_tokens": usage.get("prompt_tokens", 0),
                "output_tokens": usage.get("completion_tokens", 0),
                "total_tokens": usage.get("total_tokens", 0),
            },
        )
    except Exception:  # tracing must never break a prediction
        logger.opt(exception=True).debug("could not record usage on the span")


# ------------------------------------------------------------------------------ clients
@dataclass
class EngineClient:
    """``openai`` client bound to one served model; owns the engine when it started one."""

    base_url: str
    model: str
    settings: ModelCodeSettings = field(default_factory=ModelCodeSettings)
    api_key: str = "EMPTY"
    engine: EngineProcess | None = None
    _client: openai.OpenAI | None = None
    _closed: bool = False

    @classmethod
    def from_model_config(
        cls, model_config: Mapping[str, Any] | None, artifacts: Mapping[str, str] | None = None
    ) -> EngineClient | LogTimeClient:
        """Start the engine (or connect to the URL); a :class:`LogTimeClient` while MLflow logs the model."""
        target = resolve_target(model_config, artifacts)
        if in_log_time():
            logger.info("model {}: loaded by MLflow's log/save step: no engine is started", target.name)
            return LogTimeClient(target.served_name, target.settings)
        api_key = target.api_key or "EMPTY"
        if target.settings.api_key_env:
            api_key = os.environ.get(target.settings.api_key_env, api_key)
        if target.url is not None:
            return cls(_v1(target.url), target.served_name, target.settings, api_key=api_key)
        assert target.engine is not None
        process = start_engine(target.name, target.engine, log_dir=target.settings.log_dir)
        return cls(_v1(process.url), target.served_name, target.settings, api_key=process.api_key or api_key, engine=process)

    @property
    def client(self) -> openai.OpenAI:
        if self._client is None:
            self._client = openai.OpenAI(
                base_url=self.base_url,
                api_key=self.api_key,
                timeout=self.settings.request_timeout_s,
                max_retries=self.settings.max_retries,
            )
        return self._client

    def request(self, params: Mapping[str, Any] | None) -> dict[str, Any]:
        return build_request(params, self.settings.defaults)

    def chat(self, messages: list[dict[str, Any]], params: Mapping[str, Any] | None = None) -> ChatCompletion:
        """One non-streaming completion; typed errors; usage recorded on the active span."""
        kwargs = self.request(params)
        self._check_open()
        try:
            response = self.client.chat.completions.create(model=self.model, messages=messages, **kwargs)
        except openai.OpenAIError as error:
            raise from_openai_error(error) from error
        record_usage(usage_dict(response.usage))
        return response

    def stream(
        self, messages: list[dict[str, Any]], params: Mapping[str, Any] | None = None
    ) -> Iterator[ChatCompletionChunk]:
        """Engine chunks as they arrive (usage in the last one); typed errors, also mid-stream."""
        kwargs = self.request(params)
        self._check_open()
        try:
            stream = self.client.chat.completions.create(
                model=self.model, messages=messages, stream=True, stream_options={"include_usage": True}, **kwargs
            )
            with stream:
                for chunk in stream:
                    if chunk.usage is not None:
                        record_usage(usage_dict(chunk.usage))
                    yield chunk
        except openai.OpenAIError as error:
            raise from_openai_error(error) from error

    def _check_open(self) -> None:
        if self._closed:
            raise EngineUnavailableError(f"model {self.model!r}: the client was closed")
        if self.engine is not None and not self.engine.running:
            raise EngineUnavailableError(
                f"model {self.model!r}: the engine is not running (exit code {self.engine.returncode}; log: {self.engine.log_file})"
            )

    def close(self) -> None:
        """Stop the engine this client started (if any) and close the HTTP client. Idempotent."""
        self._closed = True
        if self._client is not None:
            self._client.close()
            self._client = None
        if self.engine is not None:
            stop_engine(self.engine)


class LogTimeClient:
    """Stands in for the engine while MLflow logs the model: validates requests, answers a placeholder."""

    engine = None

    def __init__(self, model: str, settings: ModelCodeSettings | None = None) -> None:
        self.model = model
        self.settings = settings or ModelCodeSettings()

    def request(self, params: Mapping[str, Any] | None) -> dict[str, Any]:
        return build_request(params, self.settings.defaults)

    def chat(self, messages: list[dict[str, Any]], params: Mapping[str, Any] | None = None) -> ChatCompletion:
        self.request(params)
        _check_messages(messages)
        return ChatCompletion.model_validate(
            {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.model,
                "choices": [
                    {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": LOG_TIME_TEXT}}
                ],
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
            }
        )

    def stream(
        self, messages: list[dict[str, Any]], params: Mapping[str, Any] | None = None
    ) -> Iterator[ChatCompletionChunk]:
        self.request(params)
        _check_messages(messages)
        base = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": self.model,
        }
        yield ChatCompletionChunk.model_validate(
            {
                **base,
                "choices": [
                    {"index": 0, "delta": {"role": "assistant", "content": LOG_TIME_TEXT}, "finish_reason": None}
                ],
            }
        )
        yield ChatCompletionChunk.model_validate(
            {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        )

    def close(self) -> None:
        pass


def _check_messages(messages: list[dict[str, Any]]) -> None:
    if not messages:
        raise BadRequestError("no messages")


def _v1(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


__all__ = [
    "EngineClient",
    "EngineRequestError",
    "LogTimeClient",
    "ModelCodeSettings",
    "NO_ENGINE_ENV",
    "Target",
    "WEIGHTS_ARTIFACT",
    "in_log_time",
    "live_engines",
    "resolve_target",
    "split_model_config",
    "start_engine",
    "stop_all",
]
