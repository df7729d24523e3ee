"""``/v1/embeddings`` end to end: the tiny model started as an embedding model (SGLang's ``--is-embedding``,
passed through ``extra_args``) behind a gateway with keys, called with the ``openai`` SDK."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai.types import CreateEmbeddingResponse

from launch.config import EngineConfig
from launch.process import EngineProcess
from tests.admin_client import prometheus_value
from tests.gateway.helpers import assert_openai_error
from tests.gateway_server import KEY, GatewayServer, serve
from tests.leaks import leaves_nothing
from tests.sdk_models import assert_sdk_valid


@pytest.fixture(scope="module")
def embedding_gateway(
    starts_engine: None, tiny_engine_config: EngineConfig, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayServer]:
    config = tiny_engine_config.model_copy(update={"extra_args": ["--is-embedding"], "skip_server_warmup": True})
    engine = EngineProcess("embed", config, log_dir=tmp_path_factory.mktemp("embed-logs"))
    with leaves_nothing() as check, engine:
        check.watch(engine.pid)
        with serve({"embed": {"url": engine.url}}, {"api_keys": [KEY]}) as gateway:
            yield gateway


def test_embeddings_through_the_sdk(embedding_gateway: GatewayServer, tiny_model_dir: Path) -> None:
    width = json.loads((tiny_model_dir / "config.json").read_text())["hidden_size"]
    client = openai.OpenAI(base_url=embedding_gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    texts = ["Databricks is built on Apache Spark.", "hello"]
    result = client.embeddings.create(model="embed", input=texts)
    assert [item.index for item in result.data] == [0, 1]
    vectors = [item.embedding for item in result.data]
    assert all(len(vector) == width and all(isinstance(x, float) for x in vector) for vector in vectors)
    assert vectors[0] != vectors[1]
    assert result.usage.prompt_tokens > 0
    assert result.model == "embed"  # SGLang answers with the weights' path: never shown to clients
    again = client.embeddings.create(model="embed", input="hello")  # one string; the same text, the same vector
    assert again.data[0].embedding == pytest.approx(vectors[1], abs=1e-5)


def test_embeddings_validate_against_the_sdk_model(embedding_gateway: GatewayServer) -> None:
    """The answer as ``CreateEmbeddingResponse`` takes it, strictly (tests/sdk_models.py), for a list and a string."""
    for text in (["Databricks is built on Apache Spark.", "hello"], "hello"):
        response = httpx.post(
            embedding_gateway.url + "/v1/embeddings", json={"model": "embed", "input": text},
            headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
        )  # fmt: skip
        assert response.status_code == 200, response.text
        assert_sdk_valid(CreateEmbeddingResponse, response.json())


def test_embeddings_need_a_key_and_are_counted(embedding_gateway: GatewayServer) -> None:
    labels = {"model": "embed", "route": "/v1/embeddings", "status": "200"}

    def answered() -> float:
        text = httpx.get(
            embedding_gateway.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30
        ).text
        return prometheus_value(text, "gateway_requests_total", labels) or 0.0

    before = answered()
    body = {"model": "embed", "input": "hi"}
    assert_openai_error(
        httpx.post(embedding_gateway.url + "/v1/embeddings", json=body, timeout=60), 401, "missing_api_key"
    )
    ok = httpx.post(
        embedding_gateway.url + "/v1/embeddings", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    )
    assert ok.status_code == 200 and ok.json()["object"] == "list", ok.text
    assert answered() == before + 1
