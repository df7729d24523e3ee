"""Shared fixtures: the tiny model and one real SGLang CPU engine per test session.

SGLang takes ~30 s to start on CPU, so engines are session-scoped and started only by the tests
that ask for them. Every engine started here is stopped (process group, /dev/shm files) at the end.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from launch.config import DeploymentConfig, EngineConfig, load_config
from launch.process import EngineProcess

REPO = Path(__file__).resolve().parent.parent
TINY_CONFIG = REPO / "configs" / "tiny-cpu.yaml"
TINY_MODEL = Path(os.environ.get("SGLANG_GATEWAY_TINY_MODEL", REPO / ".cache" / "tiny-model"))


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny offline model (built by `make test`; built here too if missing)."""
    from launch.tiny_model import build_tiny_model

    return build_tiny_model(TINY_MODEL)


@pytest.fixture(scope="session")
def tiny_deployment(tiny_model_dir: Path) -> DeploymentConfig:
    """configs/tiny-cpu.yaml, pointing at the tiny model."""
    os.environ.setdefault("SGLANG_GATEWAY_TINY_MODEL", str(tiny_model_dir))
    return load_config(TINY_CONFIG)


@pytest.fixture(scope="session")
def tiny_engine_config(tiny_deployment: DeploymentConfig) -> EngineConfig:
    return tiny_deployment.engine("tiny")


@pytest.fixture(scope="session")
def tiny_engine(tiny_engine_config: EngineConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """One real SGLang engine on CPU serving the tiny model as `tiny`, shared by the whole session.

    Tests must not stop or kill it; tests that break an engine start their own.
    """
    engine = EngineProcess("tiny", tiny_engine_config, log_dir=tmp_path_factory.mktemp("engine-logs"))
    with engine:
        yield engine
