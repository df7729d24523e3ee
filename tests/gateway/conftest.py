"""Gateway fixtures: one gateway (real uvicorn, real socket) in front of the session's tiny engine.

The gateway serves the engine under three names: ``tiny`` (alias ``default``) and ``second``, a
second model entry pointing at the same engine by URL, so routing by name is observable in the
``model`` field the engine echoes back.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from launch.model_info import vocab_size
from launch.process import EngineProcess
from tests.gateway_server import KEY, GatewayServer, serve


@pytest.fixture(scope="session")
def gateway(tiny_engine: EngineProcess) -> Iterator[GatewayServer]:
    vocab = vocab_size(tiny_engine.config.model_path)  # url models: the gateway refuses token ids outside it
    models = {
        "tiny": {"url": tiny_engine.url, "aliases": ["default"], "vocab_size": vocab},
        "second": {"url": tiny_engine.url, "vocab_size": vocab},
    }
    with serve(models, {"api_keys": [KEY], "open_paths": ["/health", "/ready"]}) as server:
        yield server


@pytest.fixture(scope="session")
def client(gateway: GatewayServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
