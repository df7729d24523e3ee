"""Fixtures for the MLflow packaging tests: a local sqlite tracking store, models logged in URL mode
against the shared ``tiny_engine``, and helpers that find engine processes started by this process."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def engine_children() -> list[int]:
    """Pids of ``sglang.launch_server`` processes whose parent is this test process."""
    me = os.getpid()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(")") + 2 :].split()[1])
        if ppid == me and b"sglang.launch_server" in cmdline:
            pids.append(int(entry.name))
    return pids


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


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


def last_trace() -> Any:
    import mlflow

    mlflow.flush_trace_async_logging()
    trace_id = mlflow.get_last_active_trace_id()
    assert trace_id is not None
    return mlflow.get_trace(trace_id)


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
