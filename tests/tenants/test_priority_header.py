"""The ``x-gateway-priority`` header through real clients (the openai and anthropic SDKs): a named key's holder picks
one of the classes its key allows for one request, and the engine gets it as the request's priority; a class the
key may not use, one that does not exist, and the header from a key that may send none are refused in the route's
dialect, naming the header, the class and the allowed ones. Upstream: a FAKE engine process behind a ``url:`` model
whose server schedules by priority (it answers with the priority it received). The config that names classes is
checked with the entry it comes from."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from gateway.config import gateway_settings
from launch.config import ConfigError, parse_config
from tests.fake_engine import running_fake_engine
from tests.gateway_server import GatewayServer, serve

PROMPT = [{"role": "user", "content": "hi"}]
APP, FIXED, PLAIN = "sk-app-header-0123456789", "sk-fixed-header-0123456789", "sk-plain-header-0123456789"
CLASSES = {"batch": -5, "normal": 0, "interactive": 5, "urgent": 50}
KEYS = [
    {"name": "app", "key": APP, "priority": "normal", "allowed_priorities": ["batch", "interactive", 7]},
    {"name": "fixed", "key": FIXED, "priority": "interactive"},  # a class of its own, none to pick
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_fake_engine(tmp_path_factory.mktemp("fake-engine")) as url:
        yield url


@pytest.fixture(scope="module")
def gateway(engine: str) -> Iterator[GatewayServer]:
    models = {"m": {"url": engine, "enable_priority_scheduling": True}}
    with serve(models, {"priority_classes": CLASSES, "keys": KEYS, "api_keys": [PLAIN]}) as server:
        yield server


def _openai(server: GatewayServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=30)


def _engine_priority(server: GatewayServer, key: str, header: str | None = None, **body: Any) -> Any:
    """The priority the engine received for one chat completion (``header``: the x-gateway-priority sent)."""
    extra = {"x-gateway-priority": header} if header is not None else None
    answer = _openai(server, key).chat.completions.with_raw_response.create(
        model="m", messages=PROMPT, max_tokens=1, extra_headers=extra, extra_body=body or None
    )
    return answer.http_response.json()["fake_priority"]


def test_the_header_picks_one_of_the_keys_classes_for_one_request(gateway: GatewayServer) -> None:
    assert _engine_priority(gateway, APP) == 0  # its own class (normal)
    assert _engine_priority(gateway, APP, "batch") == -5 and _engine_priority(gateway, APP, "interactive") == 5
    assert _engine_priority(gateway, APP, "7") == 7 and _engine_priority(gateway, APP, "-5") == -5  # a number, or its name's
    assert _engine_priority(gateway, APP, "normal", priority=40) == 0  # its own class is always allowed; the body's is replaced
    assert _engine_priority(gateway, APP, "") == 0  # an empty header picks nothing


def test_a_class_the_key_may_not_use_is_refused_naming_the_allowed_ones(gateway: GatewayServer) -> None:
    for asked in ("urgent", "50", "8"):
        with pytest.raises(openai.PermissionDeniedError) as refused:
            _engine_priority(gateway, APP, asked)
        error = refused.value.body
        assert error["code"] == "priority_not_allowed" and error["type"] == "permission_error", error
        assert error["message"] == (
            f"x-gateway-priority: key 'app' may not use priority class '{asked}'; it may use: normal, batch, interactive, 7"
        )


def test_an_unknown_class_is_a_bad_request(gateway: GatewayServer) -> None:
    for asked in ("highest", "1001", "5.0", "Batch"):
        with pytest.raises(openai.BadRequestError) as refused:
            _engine_priority(gateway, APP, asked)
        error = refused.value.body
        assert error["code"] == "unknown_priority", error
        assert error["message"] == (
            f"x-gateway-priority: '{asked}' is no priority class (classes named in gateway.priority_classes: batch, normal, "
            "interactive, urgent); key 'app' may use: normal, batch, interactive, 7"
        )


def test_keys_that_list_no_classes_may_not_send_the_header(gateway: GatewayServer, engine: str) -> None:
    assert _engine_priority(gateway, FIXED) == 5 and _engine_priority(gateway, PLAIN) is None  # without it: as before
    for key, who in ((FIXED, "key 'fixed' has no allowed_priorities"), (PLAIN, "this key is a plain api_keys entry")):
        with pytest.raises(openai.PermissionDeniedError) as refused:
            _engine_priority(gateway, key, "interactive")  # even its own class: the header is not its to send
        assert refused.value.body["message"] == (
            f"x-gateway-priority: only a named key with allowed_priorities may choose its priority class ({who})"
        )
    with serve({"m": {"url": engine, "enable_priority_scheduling": True}}) as open_gateway:
        with pytest.raises(openai.PermissionDeniedError) as refused:
            _engine_priority(open_gateway, "any", "1")
        assert refused.value.body["code"] == "priority_not_allowed"
        assert "(this gateway has no client keys)" in refused.value.body["message"]
        assert _engine_priority(open_gateway, "any", priority=3) == 3


def test_anthropic_clients_get_the_refusal_in_their_own_shape(gateway: GatewayServer) -> None:
    client = anthropic.Anthropic(base_url=gateway.url, api_key=APP, max_retries=0, timeout=30)
    with pytest.raises(anthropic.PermissionDeniedError) as refused:
        client.messages.create(model="m", max_tokens=4, messages=PROMPT, extra_headers={"x-gateway-priority": "urgent"})
    body = refused.value.body
    assert body["type"] == "error" and body["error"]["type"] == "permission_error", body
    assert body["error"]["message"].startswith("x-gateway-priority: key 'app' may not use priority class 'urgent'")
    with pytest.raises(anthropic.BadRequestError) as unknown:
        client.messages.create(model="m", max_tokens=4, messages=PROMPT, extra_headers={"x-gateway-priority": "top"})
    assert unknown.value.body["error"]["type"] == "invalid_request_error"
    assert "'top' is no priority class" in unknown.value.body["error"]["message"]


def _settings_error(gateway: dict[str, Any]) -> str:
    deployment = parse_config({"models": {"a": {"url": "http://127.0.0.1:1"}}, "gateway": gateway}, "deploy.yaml")
    with pytest.raises(ConfigError) as refused:
        gateway_settings(deployment)
    assert len(str(refused.value).splitlines()) == 1, str(refused.value)
    return str(refused.value)


def test_priority_classes_in_the_config_are_checked_with_the_key_they_come_from() -> None:
    classes = {"batch": -1, "normal": 0}
    assert _settings_error({"priority_classes": classes, "keys": [{"name": "t", "key": "k", "allowed_priorities": ["batch", "urgent"]}]}) == (
        "deploy.yaml: gateway.keys (t).allowed_priorities: 'urgent' is no class of gateway.priority_classes (batch, normal)"
    )
    assert _settings_error({"keys": [{"name": "t", "key": "k", "priority": "high"}]}) == (
        "deploy.yaml: gateway.keys (t).priority: 'high' is no class of gateway.priority_classes (none is named)"
    )
    assert _settings_error({"keys": [{"name": "t", "key": "k", "priority": 1001}]}) == (
        "deploy.yaml: gateway.keys.0.priority: a priority class is a number from -1000 to 1000 or a name of "
        "gateway.priority_classes (got 1001)"
    )
    assert _settings_error({"keys": [{"name": "t", "key": "k", "allowed_priorities": [1.5]}]}).endswith(
        "gateway.keys.0.allowed_priorities: a priority class is a number from -1000 to 1000 or a name of gateway.priority_classes (got 1.5)"
    )
    assert "gateway.keys.0.allowed_priorities: list at least one class" in _settings_error(
        {"keys": [{"name": "t", "key": "k", "allowed_priorities": []}]}
    )
    assert _settings_error({"priority_classes": {"2nd": 2}}) == (
        "deploy.yaml: gateway.priority_classes: a class name is 1-32 letters, digits, _ and -, starting with a letter (got '2nd')"
    )
    assert _settings_error({"priority_classes": {"top": 5000}}) == (
        "deploy.yaml: gateway.priority_classes: top: a priority class is a number from -1000 to 1000 (got 5000)"
    )
    fine = parse_config({"models": {"a": {"url": "http://127.0.0.1:1"}}, "gateway": {"priority_classes": classes, "keys": [
        {"name": "t", "key": "k", "priority": "normal", "allowed_priorities": ["batch", 3]}
    ]}}, "deploy.yaml")  # fmt: skip
    assert gateway_settings(fine).keys[0].allowed_priorities == ["batch", 3]


def test_priority_scheduling_belongs_to_a_url_model_or_the_engine_section() -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config({"models": {"a": {"engine": {"model_path": "/m"}, "enable_priority_scheduling": True}}}, "deploy.yaml")
    assert "deploy.yaml: models.a: " in str(refused.value)
    assert "its scheduling engine.enable_priority_scheduling" in str(refused.value)
