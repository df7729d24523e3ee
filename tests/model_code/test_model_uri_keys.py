"""``serve --model-uri`` takes the same ``gateway:`` key section as a YAML: named keys from the logged model_config
and from ``--gateway-config`` (a keys file by hash), with their models, limits and priority classes, on the OpenAI
routes and on ``/invocations`` alike.

The model is a ChatAgent logged in URL mode against a FAKE engine process (tests/fake_engine.py: it answers with
the ``priority`` it received; no SGLang engine starts), loaded with ``load_for_serving`` and served by
``app_for_served_model`` with the section ``read_gateway_section`` reads, as ``run_model_uri`` does (the CLI's own
process start is tests/model_code/test_serving.py's, against the real engine).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.mlflow.model_uri import app_for_served_model, read_gateway_section
from launch.config import ConfigError
from tests.fake_engine import running_fake_engine
from tests.gateway_server import GatewayServer

NOTEBOOKS, OPS, PARKED = "sk-notebooks-uri-0123456789", "sk-ops-uri-0123456789", "sk-parked-uri-0123456789"
KEY_ENV = "SGLANG_GATEWAY_TEST_NOTEBOOKS_KEY"
MESSAGES = [{"role": "user", "content": "hi"}]
NOW = 1_767_225_600.0  # the quotas' clock, held still: a bucket refills only when a test says so


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture(scope="module")
def logged(mlflow_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    """(model URI, loaded model) of a ChatAgent whose logged gateway section names the notebooks key (by variable)."""
    import mlflow

    from model_code import load_for_serving, log_model

    os.environ[KEY_ENV] = NOTEBOOKS
    with running_fake_engine(tmp_path_factory.mktemp("fake-engine"), served_name="tiny") as engine:
        notebooks = {"name": "notebooks", "key_env": KEY_ENV, "priority": 2, "limits": {"requests_per_minute": 3, "tokens_per_minute": 1000}}
        config = {"models": {"tiny": {"url": engine, "enable_priority_scheduling": True}}, "gateway": {"keys": [notebooks]}}
        with mlflow.start_run():
            info = log_model(config, flavor="chat_agent", flashinfer=None)
        served = load_for_serving(info.model_uri)
        try:
            yield info.model_uri, served
        finally:
            served.close()
            os.environ.pop(KEY_ENV, None)


def _gateway_config(directory: Path, tenants: list[dict[str, Any]]) -> Path:
    """A --gateway-config file: named classes, a keys file next to it (hashes), state in ``directory``."""
    import yaml

    (directory / "tenants.yaml").write_text(yaml.safe_dump(tenants))
    section = {"state_dir": str(directory / "state"), "priority_classes": {"low": -3}, "keys_file": "tenants.yaml"}
    path = directory / "gateway.yaml"
    path.write_text(yaml.safe_dump({"gateway": section}))
    return path


@pytest.fixture(scope="module")
def server(logged: tuple[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    directory = tmp_path_factory.mktemp("gateway-config")
    tenants = [
        {"name": "ops", "key_sha256": _sha(OPS), "allowed_priorities": ["low"]},
        {"name": "parked", "key_sha256": _sha(PARKED), "models": []},  # may use no model at all
    ]
    config = _gateway_config(directory, tenants)
    app, settings = app_for_served_model(logged[1], source=str(config), gateway_section=read_gateway_section(config))
    gateway = GatewayServer(app, settings).start()
    app.state.quotas.clock = lambda: NOW
    try:
        yield gateway
    finally:
        gateway.stop()


def _chat(server: GatewayServer, key: str, header: str | None = None) -> Any:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)
    extra = {"x-gateway-priority": header} if header else None
    return client.chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, max_tokens=2, extra_headers=extra)


def _invoke(server: GatewayServer, key: str, header: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}", **({"x-gateway-priority": header} if header else {})}
    body = {"messages": MESSAGES, "custom_inputs": {"max_tokens": 4}}
    return httpx.post(server.url + "/invocations", json=body, headers=headers, timeout=60)


def test_a_logged_named_key_keeps_its_limits_on_both_routes(server: GatewayServer) -> None:
    answer = _chat(server, NOTEBOOKS)
    assert answer.headers["x-ratelimit-limit-requests"] == "3" and answer.headers["x-ratelimit-remaining-requests"] == "2"
    assert answer.http_response.json()["fake_priority"] == 2  # its class reached the model's engine
    used = answer.parse().usage.total_tokens
    invoked = _invoke(server, NOTEBOOKS)
    assert invoked.status_code == 200, invoked.text
    assert invoked.headers["x-ratelimit-remaining-requests"] == "1"
    assert int(invoked.headers["x-ratelimit-remaining-tokens"]) == 1000 - used  # charged when each request ends
    after = _invoke(server, NOTEBOOKS)
    spent = used + invoked.json()["usage"]["total_tokens"]  # the usage /invocations reported is charged too
    assert after.status_code == 200 and int(after.headers["x-ratelimit-remaining-tokens"]) == 1000 - spent
    refused = _invoke(server, NOTEBOOKS)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded", refused.text
    assert _invoke(server, "sk-nobody").status_code == 401


def test_a_key_from_the_gateway_config_that_may_use_no_model(server: GatewayServer) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=PARKED, max_retries=0, timeout=30)
    assert [model.id for model in client.models.list()] == []
    with pytest.raises(openai.NotFoundError):
        _chat(server, PARKED)
    refused = _invoke(server, PARKED)
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found", refused.text
    assert _invoke(server, OPS).status_code == 200  # the other key of that file may


def test_the_priority_header_with_the_named_classes_of_the_gateway_config(server: GatewayServer) -> None:
    assert _chat(server, OPS).http_response.json()["fake_priority"] is None  # a key without a class: as sent
    assert _chat(server, OPS, "low").http_response.json()["fake_priority"] == -3
    assert _invoke(server, OPS, "low").status_code == 200
    unknown = _invoke(server, OPS, "high")
    assert unknown.status_code == 400 and unknown.json()["error"]["code"] == "unknown_priority", unknown.text
    assert _invoke(server, PARKED, "low").status_code == 403  # listing none, it may send none


def test_a_key_naming_a_model_the_served_one_is_not_fails_the_start(logged: tuple[str, Any], tmp_path: Path) -> None:
    config = _gateway_config(tmp_path, [{"name": "lost", "key_sha256": _sha("sk-lost-0123456789"), "models": ["other"]}])
    with pytest.raises(ConfigError) as refused:
        app_for_served_model(logged[1], source=str(config), gateway_section=read_gateway_section(config))
    assert "gateway.keys (lost).models: 'other' is no model or alias of this file" in str(refused.value)
