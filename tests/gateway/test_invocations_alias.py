"""``POST /invocations`` of a gateway serving a YAML: chat completions of the default model, whatever the
body's ``model`` says (Databricks custom LLM serving forwards the endpoint's OpenAI body there).

A gateway in front of the session's tiny engine under two names, ``tiny`` (alias ``default``) and
``second``: the ``model`` the engine echoes back tells which route a request took. The container-level
run of the same path (the logged entrypoint command) is tests/model_code/test_entrypoint_container.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import APIRouter

from gateway.app import create_app
from gateway.config import gateway_settings
from gateway.core.registry import build_registry
from launch.config import parse_config
from launch.process import EngineProcess
from tests.gateway.helpers import assert_openai_error
from tests.gateway_server import GatewayServer

pytestmark = pytest.mark.engine

HELLO = [{"role": "user", "content": "Hello!"}]


def _serve(models: dict[str, Any], *, invocations: bool, router: APIRouter | None = None) -> GatewayServer:
    deployment = parse_config({"models": models})
    settings = gateway_settings(deployment)
    app = create_app(settings, build_registry(deployment, settings), invocations=invocations)
    if router is not None:
        app.include_router(router)
    return GatewayServer(app, settings).start()


@pytest.fixture(scope="module")
def aliased(tiny_engine: EngineProcess) -> Iterator[GatewayServer]:
    server = _serve(
        {"second": {"url": tiny_engine.url}, "tiny": {"url": tiny_engine.url, "aliases": ["default"]}}, invocations=True
    )
    yield server
    server.stop()


@pytest.mark.parametrize("model", [None, "second", "my-serving-endpoint", 7])
def test_the_default_model_answers_whatever_the_body_names(aliased: GatewayServer, model: Any) -> None:
    body = {"messages": HELLO, "max_tokens": 4, "temperature": 0, **({"model": model} if model is not None else {})}
    response = httpx.post(aliased.url + "/invocations", json=body, timeout=60)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["object"] == "chat.completion" and answer["model"] == "tiny"  # "second" would echo "second"
    assert answer["choices"][0]["message"]["role"] == "assistant"
    assert 0 < answer["usage"]["completion_tokens"] <= 4


def test_streams_with_usage(aliased: GatewayServer) -> None:
    body = {
        "model": "second",
        "messages": HELLO,
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.Client(timeout=60) as http, http.stream("POST", aliased.url + "/invocations", json=body) as response:
        raw = b"".join(response.iter_raw())
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = raw.strip().split(b"\n\n")
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(event.removeprefix(b"data: ")) for event in events[:-1]]
    assert {chunk["model"] for chunk in chunks} == {"tiny"}
    assert chunks[-1]["choices"] == [] and 0 < chunks[-1]["usage"]["completion_tokens"] <= 5


@pytest.mark.parametrize(
    ("body", "param"),
    [({"max_tokens": 4}, "messages"), ({"messages": HELLO, "max_tokens": -1}, "max_tokens"), ([1, 2], None)],
)
def test_a_bad_body_is_a_400_naming_the_field(aliased: GatewayServer, body: Any, param: str | None) -> None:
    error = assert_openai_error(httpx.post(aliased.url + "/invocations", json=body, timeout=30), 400)
    assert error["error"]["param"] == param


def test_only_post(aliased: GatewayServer) -> None:
    assert_openai_error(httpx.get(aliased.url + "/invocations", timeout=30), 405)


def test_the_only_model_is_the_default_and_several_need_an_alias(tiny_engine: EngineProcess) -> None:
    body = {"messages": HELLO, "max_tokens": 2}
    only = _serve({"solo": {"url": tiny_engine.url}}, invocations=True)
    try:
        assert httpx.post(only.url + "/invocations", json=body, timeout=60).json()["model"] == "solo"
    finally:
        only.stop()
    two = _serve({"a": {"url": tiny_engine.url}, "b": {"url": tiny_engine.url}}, invocations=True)
    try:
        error = assert_openai_error(httpx.post(two.url + "/invocations", json=body, timeout=30), 404, "model_not_found")
        assert "aliased 'default'" in error["error"]["message"]
    finally:
        two.stop()


def test_without_the_alias_invocations_stays_free_for_another_route(tiny_engine: EngineProcess) -> None:
    """``serve --model-uri`` mounts its own ``POST /invocations`` (Databricks request shapes): the alias must
    not shadow it, so an app built without ``invocations`` leaves the path to the app's own routes."""
    own = APIRouter()

    @own.post("/invocations")
    async def own_invocations() -> dict[str, str]:
        return {"answered_by": "own route"}

    server = _serve({"tiny": {"url": tiny_engine.url}}, invocations=False, router=own)
    try:
        response = httpx.post(server.url + "/invocations", json={"messages": HELLO}, timeout=30)
        assert response.json() == {"answered_by": "own route"}
    finally:
        server.stop()
