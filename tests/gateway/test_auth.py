"""Bearer keys on every route; open routes only where configured; keys from YAML, env or file."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from gateway.config import gateway_settings
from launch.config import ConfigError, parse_config
from launch.process import EngineProcess
from tests.gateway.helpers import assert_openai_error
from tests.gateway_server import KEY, GatewayServer, auth, serve

HELLO = [{"role": "user", "content": "hi"}]
# Each route and one request for it (an authorised embeddings call that succeeds is in test_embeddings.py).
REQUESTS = {
    "/v1/chat/completions": ("POST", {"model": "tiny", "messages": HELLO, "max_tokens": 2}),
    "/v1/completions": ("POST", {"model": "tiny", "prompt": "hi", "max_tokens": 2}),
    "/v1/responses": ("POST", {"model": "tiny", "input": "hi", "max_output_tokens": 2}),
    "/v1/messages": ("POST", {"model": "tiny", "messages": HELLO, "max_tokens": 2}),
    "/v1/messages/count_tokens": ("POST", {"model": "tiny", "messages": HELLO}),
    "/v1/embeddings": ("POST", {"model": "tiny", "input": "hi"}),
    "/v1/tokenize": ("POST", {"model": "tiny", "prompt": "hi"}),
    "/v1/detokenize": ("POST", {"model": "tiny", "tokens": [1, 2]}),
    "/v1/score": ("POST", {"model": "tiny", "query": "q", "items": ["a"], "label_token_ids": [1]}),
    "/v1/rerank": ("POST", {"model": "tiny", "query": "q", "documents": ["a"]}),
    "/v1/classify": ("POST", {"model": "tiny", "input": "hi"}),
    "/v1/responses/{response_id}": ("GET", None),
    "/v1/responses/{response_id}/cancel": ("POST", None),
    "/v1/models": ("GET", None),
    "/v1/models/{model_id:path}": ("GET", None),
    "/health": ("GET", None),
    "/ready": ("GET", None),
    "/metrics": ("GET", None),
    "/openapi.json": ("GET", None),
}
# What an authorised call to a route answers: the route's own answer (the engine's 400 for routes that
# need another kind of model; 404 for a response id nobody created), never an auth error.
AUTHORISED = {"/v1/embeddings": 400, "/v1/rerank": 400, "/v1/classify": 400, "/v1/responses/{response_id}": 404, "/v1/responses/{response_id}/cancel": 404}


def _call(http: httpx.Client, path: str, headers: dict[str, str]) -> httpx.Response:
    method, body = REQUESTS[path]
    url = path.replace("{model_id:path}", "tiny").replace("{response_id}", "resp_unknown")
    return http.request(method, url, json=body, headers=headers)


def test_every_route_needs_a_key(gateway: GatewayServer) -> None:
    from gateway.data.routes import api_routes

    paths = {route.path for route in api_routes.routes} | {gateway.app.openapi_url}
    assert paths == set(REQUESTS), "a route was added: add it to REQUESTS"
    open_paths = {"/health", "/ready"}
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        for path in paths:
            for headers in ({}, auth("wrong"), {"Authorization": KEY}, {"Authorization": "Basic " + KEY}, {"x-api-key": "wrong"}):
                response = _call(http, path, headers)
                if path in open_paths:
                    assert response.status_code == 200, (path, response.text)
                elif path.startswith("/v1/messages"):  # Anthropic's dialect
                    assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error", response.text
                else:
                    assert_openai_error(response, 401)
                    assert response.headers["www-authenticate"] == "Bearer"
            authorised = _call(http, path, auth())
            assert authorised.status_code == AUTHORISED.get(path, 200), (path, authorised.text)
            if path == "/v1/embeddings":  # past the gateway's auth: the engine's own answer
                assert "embedding model" in assert_openai_error(authorised, 400)["error"]["message"]
        assert_openai_error(http.get("/no/such/route"), 401)  # unknown routes do not leak a 404 either


def test_keys_from_env_and_file_all_work_and_open_paths_can_be_closed(
    tiny_engine: EngineProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GW_TEST_KEYS", "env-key-1, env-key-2")
    key_file = tmp_path / "keys.txt"
    key_file.write_text("# one per line\nfile-key\n")
    gateway_cfg = {"api_keys": ["yaml-key"], "api_keys_env": "GW_TEST_KEYS", "api_keys_file": str(key_file), "open_paths": []}
    with serve({"tiny": {"url": tiny_engine.url}}, gateway_cfg) as gw, httpx.Client(base_url=gw.url, timeout=30) as http:
        for key in ("yaml-key", "env-key-1", "env-key-2", "file-key"):
            assert http.get("/v1/models", headers=auth(key)).status_code == 200, key
        assert_openai_error(http.get("/health"), 401)
        assert http.get("/health", headers=auth("file-key")).status_code == 200


def test_missing_key_sources_are_config_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GW_UNSET_VAR", raising=False)
    config = parse_config({"models": {"a": {"url": "http://x"}}, "gateway": {"api_keys_env": "GW_UNSET_VAR"}}, "d.yaml")
    with pytest.raises(ConfigError, match=r"^d.yaml: gateway.api_keys_env: environment variable GW_UNSET_VAR is not set$"):
        gateway_settings(config)
    config = parse_config({"models": {"a": {"url": "http://x"}}, "gateway": {"api_keys_file": str(tmp_path / "none")}}, "d.yaml")
    with pytest.raises(ConfigError, match=r"^d.yaml: gateway.api_keys_file: cannot read"):
        gateway_settings(config)
