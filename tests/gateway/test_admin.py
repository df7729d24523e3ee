"""The admin API and config reloads that need no engine: url models, aliases, limits, keys, drain.

A gateway built from a YAML file (``app_from_config``) runs under a real uvicorn; its url models
point at closed ports, so requests that pass routing answer 503 ``engine_unavailable`` — enough to
tell routing, drain (``model_drained``) and unknown names (404) apart. The ``serve --watch`` test runs
the real command and reloads it with SIGHUP and by editing the file.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.app import app_from_config
from gateway.config import gateway_settings
from launch.config import ConfigError, load_config, parse_config
from tests.chat import post_chat
from tests.gateway.helpers import assert_openai_error, closed_port_url
from tests.gateway_server import KEY, GatewayServer, auth, serve
from tests.servers import CLI, server_process

ADMIN = "admin-key-1"


def _write(path: Path, models: dict[str, Any], gateway: dict[str, Any]) -> None:
    path.write_text(yaml.safe_dump({"models": models, "gateway": gateway}, sort_keys=False))


@pytest.fixture()
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "deploy.yaml"
    _write(path, {"a": {"url": closed_port_url(), "aliases": ["alpha"]}, "b": {"url": closed_port_url()}},
           {"api_keys": [KEY], "admin_keys": [ADMIN]})
    return path


@pytest.fixture()
def gateway(config_file: Path) -> Iterator[GatewayServer]:
    app, settings = app_from_config(load_config(config_file))
    server = GatewayServer(app, settings).start()
    try:
        yield server
    finally:
        server.stop()


def _admin(gw: GatewayServer, method: str, path: str, key: str = ADMIN, **kwargs: Any) -> httpx.Response:
    return httpx.request(method, gw.url + path, headers=auth(key), timeout=60, **kwargs)


def _model_ids(gw: GatewayServer) -> set[str]:
    return {card["id"] for card in httpx.get(gw.url + "/v1/models", headers=auth(KEY), timeout=30).json()["data"]}


def test_admin_api_needs_the_admin_key(gateway: GatewayServer) -> None:
    assert_openai_error(_admin(gateway, "GET", "/admin/models", key=KEY), 401, "invalid_api_key")
    assert_openai_error(httpx.get(gateway.url + "/admin/models"), 401, "missing_api_key")
    assert_openai_error(httpx.get(gateway.url + "/v1/models", headers=auth(ADMIN)), 401, "invalid_api_key")
    listing = _admin(gateway, "GET", "/admin/models")
    assert listing.status_code == 200, listing.text
    models = {m["name"]: m for m in listing.json()["models"]}
    assert set(models) == {"a", "b"}
    assert models["a"]["aliases"] == ["alpha"] and models["a"]["kind"] == "url" and models["a"]["state"] == "ready"
    assert models["a"]["served_model_name"] == "a" and models["a"]["upstream_api_key"] is None
    assert listing.json()["config_file"].endswith("deploy.yaml")


def test_admin_api_is_off_without_admin_keys() -> None:
    with serve({"a": {"url": closed_port_url()}}, {"api_keys": [KEY]}) as gw:
        for key in (KEY, "anything"):
            assert_openai_error(_admin(gw, "GET", "/admin/models", key=key), 403, "admin_api_disabled")
        # An admin key without a config file: listing works, reload says why it cannot.
    with serve({"a": {"url": closed_port_url()}}, {"admin_keys": [ADMIN]}) as gw:
        assert _admin(gw, "GET", "/admin/models").status_code == 200
        assert_openai_error(_admin(gw, "POST", "/admin/reload"), 400, "no_config_file")


def test_reload_applies_aliases_limits_urls_and_keys_at_once(gateway: GatewayServer, config_file: Path) -> None:
    before = _admin(gateway, "GET", "/admin/models").json()
    assert _model_ids(gateway) == {"a", "alpha", "b"}
    _write(
        config_file,
        {
            "a": {"url": before["models"][0]["url"], "aliases": ["alpha2"]},  # alias changed
            "c": {"url": closed_port_url(), "served_model_name": "upstream-c", "api_key": "upstream-secret"},  # added
        },  # b removed
        {"api_keys": [KEY, "new-client-key"], "admin_keys": ["admin-key-2"], "model_limits": {"a": {"max_concurrent": 3}}, "port": 1},
    )
    response = _admin(gateway, "POST", "/admin/reload")
    assert response.status_code == 200, response.text
    report = response.json()
    assert report["ok"] and report["trigger"] == "admin" and report["failed"] == []
    assert report["models"]["a"] == {"action": "route_changed", "changed": ["aliases", "limits"]}
    assert report["models"]["b"]["action"] == "removed" and report["models"]["c"]["action"] == "added"
    assert set(report["settings_changed"]) >= {"api_keys", "admin_keys", "model_limits"}
    assert report["restart_required"] == ["port"]

    assert _model_ids(gateway) == {"a", "alpha2", "c"}
    assert_openai_error(post_chat(gateway.url, "alpha", max_tokens=1, timeout_s=30), 404, "model_not_found")
    assert_openai_error(post_chat(gateway.url, "b", max_tokens=1, timeout_s=30), 404, "model_not_found")
    assert_openai_error(post_chat(gateway.url, "alpha2", max_tokens=1, timeout_s=30), 503, "engine_unavailable")
    assert httpx.get(gateway.url + "/v1/models", headers=auth("new-client-key")).status_code == 200
    assert_openai_error(_admin(gateway, "GET", "/admin/models"), 401, "invalid_api_key")  # old admin key gone
    listing = _admin(gateway, "GET", "/admin/models", key="admin-key-2")
    models = {m["name"]: m for m in listing.json()["models"]}
    assert models["a"]["limits"]["max_concurrent"] == 3
    assert models["c"]["served_model_name"] == "upstream-c" and models["c"]["upstream_api_key"] == "set"
    assert "upstream-secret" not in listing.text
    assert gateway.state.settings.port != 1  # restart-only keys are reported, not applied


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("models:\n  a:\n    urll: http://127.0.0.1:1\n", "deploy.yaml: models.a.urll: unknown key"),
        ("models:\n  a: [\n", "deploy.yaml: line 3: invalid YAML"),
        ("models:\n  a:\n    url: http://127.0.0.1:1\ngateway:\n  swap_policy:\n    zz: stop-first\n", "deploy.yaml: gateway.swap_policy.zz: no model with this name"),
        ("models:\n  a:\n    url: http://127.0.0.1:1\ngateway:\n  admin_keys_env: NO_SUCH_VAR_FOR_TEST\n", "deploy.yaml: gateway.admin_keys_env: environment variable NO_SUCH_VAR_FOR_TEST is not set"),
    ],
)
def test_invalid_reload_changes_nothing(gateway: GatewayServer, config_file: Path, text: str, expected: str) -> None:
    before = _admin(gateway, "GET", "/admin/models").json()["models"]
    config_file.write_text(text)
    body = assert_openai_error(_admin(gateway, "POST", "/admin/reload"), 400, "invalid_config")
    assert expected in body["error"]["message"], body
    assert _admin(gateway, "GET", "/admin/models").json()["models"] == before
    assert _model_ids(gateway) == {"a", "alpha", "b"}
    assert httpx.get(gateway.url + "/v1/models", headers=auth(KEY)).status_code == 200


def test_concurrent_reloads_are_serialized(gateway: GatewayServer, config_file: Path) -> None:
    data = yaml.safe_load(config_file.read_text())
    data["models"]["b"]["aliases"] = ["beta"]
    config_file.write_text(yaml.safe_dump(data))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        reports = [f.result().json() for f in [pool.submit(_admin, gateway, "POST", "/admin/reload") for _ in range(4)]]
    actions = sorted(r["models"]["b"]["action"] for r in reports)
    assert actions == ["route_changed", "unchanged", "unchanged", "unchanged"], reports
    assert _model_ids(gateway) == {"a", "alpha", "b", "beta"}


def test_drain_and_undrain(gateway: GatewayServer) -> None:
    drained = _admin(gateway, "POST", "/admin/models/alpha/drain", params={"wait": "true"})
    assert drained.json() == {"model": "a", "drained": True, "in_flight": 0, "idle": True}
    refused = post_chat(gateway.url, "a", max_tokens=1, timeout_s=30)
    assert_openai_error(refused, 503, "model_drained")
    assert refused.headers["retry-after"]
    assert_openai_error(post_chat(gateway.url, "b", max_tokens=1, timeout_s=30), 503, "engine_unavailable")  # other models untouched
    assert {m["name"]: m["state"] for m in _admin(gateway, "GET", "/admin/models").json()["models"]}["a"] == "drained"
    assert _admin(gateway, "POST", "/admin/models/a/undrain").json()["drained"] is False
    assert_openai_error(post_chat(gateway.url, "a", max_tokens=1, timeout_s=30), 503, "engine_unavailable")
    assert_openai_error(_admin(gateway, "POST", "/admin/models/zz/drain"), 404, "model_not_found")


def test_swap_needs_a_launched_engine(gateway: GatewayServer) -> None:
    assert_openai_error(_admin(gateway, "POST", "/admin/models/a/swap"), 400, "not_managed")
    assert_openai_error(_admin(gateway, "POST", "/admin/models/zz/swap"), 404, "model_not_found")
    assert_openai_error(_admin(gateway, "POST", "/admin/models/a/swap", params={"policy": "sideways"}), 400)


@pytest.mark.parametrize(
    ("gateway_section", "message"),
    [
        ({"admin_keys": [KEY], "api_keys": [KEY]}, "deploy.yaml: gateway.admin_keys: an admin key must not also be a client key"),
        ({"swap_default": "random"}, "deploy.yaml: gateway.swap_default: Input should be 'auto', 'blue-green', 'stop-first' or 'rolling'"),
        ({"watchdog": {"interval_s": 0}}, "deploy.yaml: gateway.watchdog.interval_s: Input should be greater than 0"),
        ({"watchdog": {"restarts": 1}}, "deploy.yaml: gateway.watchdog.restarts: unknown key"),
        ({"drain_timeout_s": -1}, "deploy.yaml: gateway.drain_timeout_s: Input should be greater than or equal to 0"),
    ],
)
def test_new_config_keys_are_validated(gateway_section: dict, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        gateway_settings(parse_config({"models": {"a": {"url": "http://127.0.0.1:1"}}, "gateway": gateway_section}, "deploy.yaml"))
    assert str(caught.value).startswith(message), str(caught.value)


def test_admin_keys_from_env_and_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "admin.keys").write_text("# admins\nfrom-file\n")
    monkeypatch.setenv("TEST_ADMIN_KEYS", "from-env-1, from-env-2")
    deployment = parse_config(
        {"models": {"a": {"url": "http://127.0.0.1:1"}}, "gateway": {"admin_keys_env": "TEST_ADMIN_KEYS", "admin_keys_file": "admin.keys"}},
        tmp_path / "deploy.yaml",
    )
    assert gateway_settings(deployment).resolved_admin_keys() == (b"from-env-1", b"from-env-2", b"from-file")


def test_serve_reloads_on_sighup_and_with_watch(tmp_path: Path) -> None:
    """The real ``serve --watch`` command: SIGHUP reloads, an edited file reloads, a broken one is logged."""
    config = tmp_path / "deploy.yaml"
    url = closed_port_url()
    _write(config, {"a": {"url": url}}, {"api_keys": [KEY]})
    with server_process([*CLI, "serve", str(config), "--port", "{port}", "--watch"], log_path=tmp_path / "serve.log") as server:

        def ids() -> set[str]:
            try:
                return {c["id"] for c in httpx.get(server.url + "/v1/models", headers=auth(KEY), timeout=5).json()["data"]}
            except httpx.HTTPError:
                return set()

        server.wait_until(lambda: ids() == {"a"}, 60, "the gateway serving")
        # SIGHUP (the watcher may see the edit too: the log line proves the signal reloaded, not killed)
        _write(config, {"a": {"url": url, "aliases": ["by-signal"]}}, {"api_keys": [KEY]})
        os.kill(server.pid, signal.SIGHUP)
        server.wait_until(lambda: ids() == {"a", "by-signal"}, 30, "the SIGHUP reload")
        server.wait_log(r"reload \(SIGHUP\)", 10)
        assert server.proc.poll() is None  # SIGHUP's default action (terminate) is replaced

        _write(config, {"a": {"url": url, "aliases": ["by-watch"]}}, {"api_keys": [KEY]})
        server.wait_until(lambda: ids() == {"a", "by-watch"}, 30, "the --watch reload")

        config.write_text("models:\n  a:\n    urll: nope\n")
        server.wait_log("models.a.urll: unknown key", 30)
        assert ids() == {"a", "by-watch"}
        assert server.stop() == 0
