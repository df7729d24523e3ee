"""The ``gateway:`` section of the deployment YAML, validated here (``launch`` keeps it opaque).

Errors read like every other config error: ``file: gateway.port: reason`` (:class:`ConfigError`).
API keys may come from the YAML, an environment variable or a file; they are resolved once, at load
time, so a missing variable or file fails the start, not the first request.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

from launch.config import (
    GATEWAY_KEY_FILE_SETTINGS,
    GATEWAY_PER_MODEL_SETTINGS,
    ConfigError,
    DeploymentConfig,
    format_validation_error,
)

OpenPath = Literal["/health", "/ready", "/metrics"]
SwapPolicy = Literal["auto", "blue-green", "stop-first", "rolling"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LimitSettings(_Strict):
    """Per-model admission control: at most ``max_concurrent`` requests upstream, ``max_queue`` waiting."""

    max_concurrent: int | None = Field(None, ge=1, description="Concurrent requests per model (unset: no limit).")
    max_queue: int = Field(0, ge=0, description="Requests that may wait for a slot; 0 answers 429 at once.")
    queue_timeout_s: float = Field(30.0, gt=0, description="How long a queued request waits before 429.")
    retry_after_s: int = Field(1, ge=0, description="Retry-After header sent with 429 and 503.")


class WatchdogSettings(_Strict):
    """Supervision of the engines the gateway launched: restart dead or unhealthy ones, with backoff."""

    enabled: bool = Field(True, description="Watch managed engines and restart them.")
    interval_s: float = Field(5.0, gt=0, description="Seconds between two checks of each engine.")
    unhealthy_after: int = Field(3, ge=1, description="Consecutive failed /health probes before a restart.")
    backoff_initial_s: float = Field(1.0, ge=0, description="Delay before the first restart attempt.")
    backoff_max_s: float = Field(60.0, ge=0, description="Longest delay between two restart attempts.")
    max_restarts: int | None = Field(
        None, ge=0, description="Failed restarts in a row before giving up (unset: never give up, retry every backoff_max_s)."
    )
    stable_after_s: float = Field(60.0, ge=0, description="Healthy this long after a restart resets the backoff.")


class BalancingSettings(_Strict):
    """How requests of a model with replicas are spread over them."""

    policy: Literal["least_in_flight", "prefix_affinity"] = Field(
        "least_in_flight", description="least_in_flight, or prefix_affinity: requests sharing a prompt prefix go to one replica."
    )
    prefix_chars: int = Field(2048, ge=16, description="Characters of the prompt's beginning that choose the replica (prefix_affinity).")
    max_imbalance: int = Field(
        4, ge=0, description="prefix_affinity yields to the least busy replica when its own has this many more requests in flight."
    )
    min_ready: int = Field(1, ge=1, description="/ready is 200 while at least this many replicas of the model are healthy.")


class HttpSettings(_Strict):
    """Limits of the HTTP layer, enforced before any route runs (safe for a gateway bound to 0.0.0.0)."""

    max_connections: int = Field(2048, ge=1, description="Open client connections; beyond, new ones get 503 and are closed.")
    max_header_bytes: int = Field(32768, ge=1024, description="Request line plus headers; beyond: 431.")
    max_headers: int = Field(100, ge=1, description="Header fields per request; beyond: 431.")
    max_url_bytes: int = Field(8192, ge=256, description="Request target (path and query); beyond: 414.")
    header_timeout_s: float = Field(10.0, gt=0, description="From a request's first byte to its last header; beyond: 408.")
    keepalive_timeout_s: float = Field(30.0, gt=0, description="An idle connection (new or between requests) is closed after this.")
    body_timeout_s: float = Field(30.0, gt=0, description="Longest silence while a request body arrives; beyond: 408.")
    write_timeout_s: float = Field(30.0, gt=0, description="A client that accepts no response bytes this long is disconnected.")


class GatewaySettings(_Strict):
    """Every key of the ``gateway:`` section."""

    host: str = Field("127.0.0.1", description="Interface to bind (--host overrides).")
    port: int = Field(8000, ge=0, le=65535, description="Port to bind (--port overrides).")
    api_keys: list[SecretStr] = Field(default_factory=list, description="Accepted bearer keys.")
    api_keys_env: str | None = Field(None, description="Environment variable with comma-separated keys.")
    api_keys_file: Path | None = Field(None, description="File with one key per line (# comments).")
    open_paths: list[OpenPath] = Field(
        default_factory=lambda: ["/health", "/ready"], description="Routes reachable without a key."
    )
    limits: LimitSettings = Field(default_factory=LimitSettings, description="Default per-model limits.")
    model_limits: dict[str, LimitSettings] = Field(default_factory=dict, description="Per-model overrides.")
    max_body_bytes: int = Field(10 * 1024 * 1024, ge=1024, description="Largest request body (413 beyond).")
    upstream_connect_timeout_s: float = Field(5.0, gt=0, description="Connect timeout to an engine (504).")
    upstream_read_timeout_s: float = Field(600.0, gt=0, description="Longest wait for the next upstream bytes (504).")
    upstream_max_connections: int = Field(256, ge=1, description="Connection pool size to all engines.")
    health_timeout_s: float = Field(5.0, gt=0, description="Timeout of each /health probe made by /ready.")
    cors_allow_origins: list[str] = Field(default_factory=list, description="CORS origins (empty: CORS off).")
    shutdown_grace_s: float = Field(30.0, ge=0, description="In-flight requests may finish this long on SIGTERM.")
    log_requests: bool = Field(True, description="One structured log line per request.")
    admin_keys: list[SecretStr] = Field(default_factory=list, description="Bearer keys of the /admin API (none: it is off).")
    admin_keys_env: str | None = Field(None, description="Environment variable with comma-separated admin keys.")
    admin_keys_file: Path | None = Field(None, description="File with one admin key per line (# comments).")
    drain_timeout_s: float = Field(60.0, ge=0, description="How long a replaced engine may finish its requests.")
    swap_default: SwapPolicy = Field(
        "auto", description="How engines are replaced when their config changes (auto: blue-green, or rolling for replicas)."
    )
    swap_policy: dict[str, SwapPolicy] = Field(default_factory=dict, description="Per-model swap policy overrides.")
    swap_retry_after_s: int = Field(5, ge=0, description="Retry-After sent while a stop-first swap has a model down.")
    watchdog: WatchdogSettings = Field(default_factory=WatchdogSettings, description="Engine supervision.")
    http: HttpSettings = Field(default_factory=HttpSettings, description="Connection and header limits, timeouts.")
    balancing: BalancingSettings = Field(default_factory=BalancingSettings, description="Spreading requests over replicas.")
    model_balancing: dict[str, BalancingSettings] = Field(default_factory=dict, description="Per-model overrides of balancing.")

    @field_validator("api_keys", "admin_keys")
    @classmethod
    def _non_empty_keys(cls, value: list[SecretStr]) -> list[SecretStr]:
        if any(not key.get_secret_value().strip() for key in value):
            raise ValueError("API keys must not be empty")
        return value

    def limits_for(self, model: str) -> LimitSettings:
        return self.model_limits.get(model, self.limits)

    def balancing_for(self, model: str) -> BalancingSettings:
        return self.model_balancing.get(model, self.balancing)

    def swap_policy_for(self, model: str) -> SwapPolicy:
        return self.swap_policy.get(model, self.swap_default)

    def resolved_keys(self, source: str = "config") -> tuple[bytes, ...]:
        """All accepted client keys (YAML, env, file) as bytes; ConfigError when a named source is missing."""
        return _resolve_keys(self.api_keys, self.api_keys_env, self.api_keys_file, "api_keys", source)

    def resolved_admin_keys(self, source: str = "config") -> tuple[bytes, ...]:
        """The /admin keys, resolved like the client keys; empty means the admin API is off."""
        return _resolve_keys(self.admin_keys, self.admin_keys_env, self.admin_keys_file, "admin_keys", source)


def _resolve_keys(
    listed: list[SecretStr], env: str | None, file: Path | None, field: str, source: str
) -> tuple[bytes, ...]:
    keys = [key.get_secret_value().strip() for key in listed]
    if env:
        value = os.environ.get(env)
        if value is None:
            raise ConfigError(f"{source}: gateway.{field}_env: environment variable {env} is not set")
        keys += [part.strip() for part in value.split(",") if part.strip()]
    if file:
        try:
            text = file.read_text()
        except OSError as error:
            raise ConfigError(f"{source}: gateway.{field}_file: cannot read {file}: {error.strerror}") from None
        keys += [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        if not keys:
            raise ConfigError(f"{source}: gateway.{field}_file: {file} holds no key")
    return tuple(dict.fromkeys(key.encode() for key in keys))


def gateway_settings(deployment: DeploymentConfig, **overrides: object) -> GatewaySettings:
    """Validate ``deployment.gateway`` (plus CLI overrides such as host/port that are not None)."""
    source = str(deployment.source or "config")
    data = dict(deployment.gateway)
    data.update({key: value for key, value in overrides.items() if value is not None})
    for key in GATEWAY_KEY_FILE_SETTINGS:
        if isinstance(data.get(key), str) and deployment.source and not Path(data[key]).is_absolute():
            data[key] = str(Path(deployment.source).parent / data[key])
    try:
        settings = GatewaySettings.model_validate(data)
    except ValidationError as error:
        lines = format_validation_error(source, error).splitlines()
        raise ConfigError("\n".join(line.replace(f"{source}: ", f"{source}: gateway.", 1) for line in lines)) from None
    followers = [name for name, engine in deployment.managed().items() if engine.node_rank > 0]
    if followers:
        raise ConfigError(
            f"{source}: models.{followers[0]}.engine.node_rank: a machine with node_rank > 0 serves no HTTP; "
            "start it with `sglang-gateway launch` and serve the engine from the machine with node_rank 0"
        )
    for key in GATEWAY_PER_MODEL_SETTINGS:
        unknown = sorted(set(getattr(settings, key)) - set(deployment.models))
        if unknown:
            raise ConfigError(f"{source}: gateway.{key}.{unknown[0]}: no model with this name")
    settings.resolved_keys(source)
    admin = settings.resolved_admin_keys(source)
    if set(admin) & set(settings.resolved_keys(source)):
        raise ConfigError(f"{source}: gateway.admin_keys: an admin key must not also be a client key")
    return settings
