"""``sglang-gateway serve --model-uri``: serve a logged MLflow model with streaming.

Loads the model (``mlflow.pyfunc.load_model``: starts or joins its engines, or connects to its URL),
then serves the gateway's OpenAI endpoints in front of those engines (balanced over a model's replicas
like the replicas of a YAML model) plus ``POST /invocations`` with the Databricks request shapes,
streaming when the body has ``"stream": true`` (the model balances those requests itself).

The server's settings are the ``gateway:`` section of the deployment (API keys, named keys, limits,
timeouts, CORS...): the logged ``model_config``'s, overridden key by key by the one of ``--gateway-config
FILE``, then by ``--host`` / ``--port``. ``/invocations`` shares the model's concurrency limit with the
OpenAI routes (one engine behind both), and named keys hold on both. An engine logged with
``enable_priority_scheduling`` gets each request's priority class from the OpenAI routes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from loguru import logger
from pydantic import ValidationError

from gateway.app import create_app
from gateway.config import GatewaySettings, gateway_settings
from gateway.core.registry import build_registry, with_url_replicas
from gateway.mlflow.invocations import invocations_router
from launch.config import GATEWAY_KEY_FILE_SETTINGS, ConfigError, format_validation_error, parse_config, read_yaml

GATEWAY_SECTION = "gateway"


def read_gateway_section(path: Path) -> dict[str, Any]:
    """The ``gateway:`` section of a YAML file (a deployment file, or one with only that section).

    ``${VAR}`` is expanded and relative key files are made relative to the file; the section is
    checked now, so a bad key fails before the model (and its engine) is loaded.
    """
    data = read_yaml(path)
    section = data.get(GATEWAY_SECTION) if isinstance(data, dict) else None
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: no '{GATEWAY_SECTION}:' mapping (the server settings: api_keys, limits...)")
    section = _absolute_key_files(section, path.parent)
    try:
        GatewaySettings.model_validate(section)
    except ValidationError as error:
        lines = format_validation_error(str(path), error).splitlines()
        raise ConfigError("\n".join(line.replace(f"{path}: ", f"{path}: gateway.", 1) for line in lines)) from None
    return section


def _absolute_key_files(section: Mapping[str, Any], base: Path) -> dict[str, Any]:
    """Key files named relative to ``base`` (the YAML file's directory; the working directory for a logged config)."""
    out = dict(section)
    for key in GATEWAY_KEY_FILE_SETTINGS:
        value = out.get(key)
        if isinstance(value, str) and not Path(value).is_absolute():
            out[key] = str((base / value).resolve())
    return out


def app_for_served_model(
    served: Any,
    *,
    source: str,
    host: str | None = None,
    port: int | None = None,
    gateway_section: Mapping[str, Any] | None = None,
) -> tuple[FastAPI, GatewaySettings]:
    """The gateway app for a loaded ``model_code.serving.ServedModel``.

    Settings: the model's logged ``gateway:`` section, then ``gateway_section`` over it, then host/port.
    """
    name, upstreams = served.model_name, served.upstreams
    base_url, api_key = upstreams[0]
    entry: dict[str, Any] = {"url": base_url, "aliases": [] if name == "default" else ["default"]}
    if api_key:
        entry["api_key"] = api_key
    if getattr(served, "schedules_by_priority", False):  # the model's engines take each request's priority class
        entry["enable_priority_scheduling"] = True
    logged = _absolute_key_files(getattr(served, "gateway_section", None) or {}, Path.cwd())
    section = {**logged, **(gateway_section or {})}
    deployment = parse_config({"models": {name: entry}, GATEWAY_SECTION: section}, source)
    settings = gateway_settings(deployment, host=host, port=port)
    registry = build_registry(deployment, settings)
    route = registry.route(name)
    if route is not None and len(upstreams) > 1:  # replicas: the gateway balances over the model's own engines
        registry.put(with_url_replicas(route, upstreams))
    app = create_app(settings, registry)
    app.include_router(invocations_router(served, route=lambda: registry.route(name)))
    return app, settings


def run_model_uri(
    model_uri: str,
    host: str | None = None,
    port: int | None = None,
    *,
    verbose: bool = False,
    gateway_config: Path | None = None,
) -> None:
    """Load ``model_uri`` and serve it until SIGTERM / Ctrl-C; the model's engine is released at the end."""
    section = read_gateway_section(gateway_config) if gateway_config is not None else None
    try:
        from model_code.serving import load_for_serving
        from model_code.target import SHOW_ENGINE_LOG_ENV
    except ImportError as error:  # mlflow is an optional extra
        raise RuntimeError(f"--model-uri needs MLflow: pip install 'sglang-gateway[mlflow]' ({error})") from None

    from gateway.server import serve_app

    if verbose:  # -v shows the engine's log, as it does for a CONFIG file
        os.environ.setdefault(SHOW_ENGINE_LOG_ENV, "1")
    logger.info("gateway: loading {} (this starts the model's engine)", model_uri)
    served = load_for_serving(model_uri)
    try:
        app, settings = app_for_served_model(
            served, source=str(gateway_config or model_uri), host=host, port=port, gateway_section=section
        )
        logger.info("gateway: serving {} ({}) as {!r}", model_uri, served.flavor, served.model_name)
        serve_app(app, settings, verbose=verbose)
    finally:
        served.close()
