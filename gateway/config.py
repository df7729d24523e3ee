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

from launch.config import ConfigError, DeploymentConfig, format_validation_error

OpenPath = Literal["/health", "/ready", "/metrics"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LimitSettings(_Strict):
    """Per-model admission control: at most ``max_concurrent`` requests upstream, ``max_queue`` waiting."""

    max_concurrent: int | None = Field(None, ge=1, description="Concurrent requests per model (unset: no limit).")
    max_queue: int = Field(0, ge=0, description="Requests that may wait for a slot; 0 answers 429 at once.")
    queue_timeout_s: float = Field(30.0, gt=0, description="How long a queued request waits before 429.")
    retry_after_s: int = Field(1, ge=0, description="Retry-After header sent with 429 and 503.")


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

    @field_validator("api_keys")
    @classmethod
    def _non_empty_keys(cls, value: list[SecretStr]) -> list[SecretStr]:
        if any(not key.get_secret_value().strip() for key in value):
            raise ValueError("API keys must not be empty")
        return value

    def limits_for(self, model: str) -> LimitSettings:
        return self.model_limits.get(model, self.limits)

    def resolved_keys(self, source: str = "config") -> tuple[bytes, ...]:
        """All accepted keys (YAML, env, file) as bytes; ConfigError when a named source is missing."""
        keys = [key.get_secret_value().strip() for key in self.api_keys]
        if self.api_keys_env:
            value = os.environ.get(self.api_keys_env)
            if value is None:
                raise ConfigError(f"{source}: gateway.api_keys_env: environment variable {self.api_keys_env} is not set")
            keys += [part.strip() for part in value.split(",") if part.strip()]
        if self.api_keys_file:
            try:
                text = self.api_keys_file.read_text()
            except OSError as error:
                raise ConfigError(f"{source}: gateway.api_keys_file: cannot read {self.api_keys_file}: {error.strerror}") from None
            keys += [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
            if not keys:
                raise ConfigError(f"{source}: gateway.api_keys_file: {self.api_keys_file} holds no key")
        return tuple(dict.fromkeys(key.encode() for key in keys))


def gateway_settings(deployment: DeploymentConfig, **overrides: object) -> GatewaySettings:
    """Validate ``deployment.gateway`` (plus CLI overrides such as host/port that are not None)."""
    source = str(deployment.source or "config")
    data = dict(deployment.gateway)
    data.update({key: value for key, value in overrides.items() if value is not None})
    if isinstance(data.get("api_keys_file"), str) and deployment.source and not Path(data["api_keys_file"]).is_absolute():
        data["api_keys_file"] = str(Path(deployment.source).parent / data["api_keys_file"])
    try:
        settings = GatewaySettings.model_validate(data)
    except ValidationError as error:
        lines = format_validation_error(source, error).splitlines()
        raise ConfigError("\n".join(line.replace(f"{source}: ", f"{source}: gateway.", 1) for line in lines)) from None
    unknown = sorted(set(settings.model_limits) - set(deployment.models))
    if unknown:
        raise ConfigError(f"{source}: gateway.model_limits.{unknown[0]}: no model with this name")
    settings.resolved_keys(source)
    return settings
