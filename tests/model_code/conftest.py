"""Fixtures for the MLflow packaging tests: a local sqlite tracking store, models logged in URL mode
against the shared ``tiny_engine``, and helpers that find engine processes started by this process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def mlflow_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """sqlite tracking store and artifact root in a temp dir (never the network, never ./mlruns)."""
    import mlflow

    root = tmp_path_factory.mktemp("mlflow")
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(f"sqlite:///{root}/mlflow.db")
    experiment = mlflow.create_experiment("model_code-tests", artifact_location=str(root / "artifacts"))
    mlflow.set_experiment(experiment_id=experiment)
    yield root
    mlflow.set_tracking_uri(previous)


@pytest.fixture(scope="module")
def url_config(tiny_engine: Any) -> dict[str, Any]:
    """A model_config that reaches the shared engine by URL (loading starts no engine)."""
    return {"models": {"tiny": {"url": tiny_engine.url}}, "mlflow": {"defaults": {"max_tokens": 24}}}


@pytest.fixture(scope="module")
def url_models(url_config: dict[str, Any], mlflow_store: Path) -> Iterator[dict[str, Any]]:
    """The three flavours logged in URL mode and loaded once per module: flavor -> (model_info, pyfunc model)."""
    import mlflow

    from model_code import close_model, log_model

    models = {}
    for flavor in ("chat_agent", "chat_model", "responses_agent"):
        with mlflow.start_run():
            info = log_model(url_config, flavor=flavor, flashinfer=None)
        models[flavor] = (info, mlflow.pyfunc.load_model(info.model_uri))
    yield models
    for _, model in models.values():
        close_model(model)
