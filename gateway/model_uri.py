"""``sglang-gateway serve --model-uri``: serve a logged MLflow model with streaming.

Loads the model (``mlflow.pyfunc.load_model``: starts its engine, or connects to its URL), then
serves the gateway's OpenAI endpoints in front of that engine plus ``POST /invocations`` with the
Databricks request shapes, streaming when the body has ``"stream": true``.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from loguru import logger

from gateway.app import create_app
from gateway.config import GatewaySettings, gateway_settings
from gateway.invocations import invocations_router
from gateway.registry import build_registry
from launch.config import parse_config


def app_for_served_model(
    served: Any, *, source: str, host: str | None = None, port: int | None = None
) -> tuple[FastAPI, GatewaySettings]:
    """The gateway app for a loaded ``model_code.serving.ServedModel``."""
    base_url, name, api_key = served.upstream
    entry: dict[str, Any] = {"url": base_url, "aliases": [] if name == "default" else ["default"]}
    if api_key:
        entry["api_key"] = api_key
    deployment = parse_config({"models": {name: entry}}, source)
    settings = gateway_settings(deployment, host=host, port=port)
    app = create_app(settings, build_registry(deployment, settings))
    app.include_router(invocations_router(served))
    return app, settings


def run_model_uri(model_uri: str, host: str | None = None, port: int | None = None, *, verbose: bool = False) -> None:
    """Load ``model_uri`` and serve it until SIGTERM / Ctrl-C; the model's engine is stopped at the end."""
    try:
        from model_code.serving import load_for_serving
    except ImportError as error:  # mlflow is an optional extra
        raise RuntimeError(f"--model-uri needs MLflow: pip install 'sglang-gateway[mlflow]' ({error})") from None

    from gateway.server import serve_app

    logger.info("gateway: loading {} (this starts the model's engine)", model_uri)
    served = load_for_serving(model_uri)
    try:
        app, settings = app_for_served_model(served, source=model_uri, host=host, port=port)
        logger.info("gateway: serving {} ({}) as {!r}", model_uri, served.flavor, served.model_name)
        serve_app(app, settings, verbose=verbose)
    finally:
        served.close()
