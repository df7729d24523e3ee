"""CORS (``gateway.cors_allow_origins``): a browser app on an allowed origin may call the gateway.

The proxied POST routes are served by a fast path ahead of FastAPI; it must carry the same CORS
answer as every other route. Preflight (``OPTIONS``) needs no API key (browsers never send one on
it); the actual request still does, and its errors are readable by the page too.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from launch.process import EngineProcess
from tests.gateway.helpers import assert_openai_error
from tests.gateway_server import KEY, GatewayServer, auth, serve

APP = "https://app.example"
CHAT = "/v1/chat/completions"
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def cors_gateway(tiny_engine: EngineProcess) -> Iterator[GatewayServer]:
    with serve({"tiny": {"url": tiny_engine.url}}, {"api_keys": [KEY], "cors_allow_origins": [APP]}) as server:
        yield server


@pytest.mark.parametrize("path", [CHAT, "/v1/completions", "/v1/embeddings", "/v1/models"])
def test_preflight_from_an_allowed_origin(cors_gateway: GatewayServer, path: str) -> None:
    method = "GET" if path == "/v1/models" else "POST"
    headers = {
        "Origin": APP,
        "Access-Control-Request-Method": method,
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    response = httpx.options(cors_gateway.url + path, headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["access-control-allow-origin"] == APP
    assert method in response.headers["access-control-allow-methods"]
    assert {"authorization", "content-type"} <= {
        h.strip().lower() for h in response.headers["access-control-allow-headers"].split(",")
    }


def test_requests_from_an_allowed_origin_carry_cors_headers(cors_gateway: GatewayServer) -> None:
    with httpx.Client(base_url=cors_gateway.url, headers={"Origin": APP}, timeout=60) as http:
        chat = http.post(CHAT, json=BODY, headers=auth())  # the fast path
        assert chat.status_code == 200, chat.text
        listing = http.get("/v1/models", headers=auth())  # FastAPI's routing
        assert listing.status_code == 200
        for response in (chat, listing):
            assert response.headers["access-control-allow-origin"] == APP
            exposed = {h.strip().lower() for h in response.headers["access-control-expose-headers"].split(",")}
            assert {"x-request-id", "retry-after"} <= exposed
        refused = http.post(CHAT, json=BODY)  # no key: still 401, and the page can read why
        assert_openai_error(refused, 401, "missing_api_key")
        assert refused.headers["access-control-allow-origin"] == APP


def test_other_origins_get_no_cors_headers(cors_gateway: GatewayServer) -> None:
    headers = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    preflight = httpx.options(cors_gateway.url + CHAT, headers=headers, timeout=30)
    assert preflight.status_code == 400 and "access-control-allow-origin" not in preflight.headers
    chat = httpx.post(
        cors_gateway.url + CHAT, json=BODY, headers={**auth(), "Origin": "https://evil.example"}, timeout=60
    )
    assert chat.status_code == 200 and "access-control-allow-origin" not in chat.headers


def test_cors_is_off_by_default(gateway: GatewayServer) -> None:
    headers = {"Origin": APP, "Access-Control-Request-Method": "POST"}
    preflight = httpx.options(gateway.url + CHAT, headers={**headers, **auth()}, timeout=30)
    assert "access-control-allow-origin" not in preflight.headers
    chat = httpx.post(gateway.url + CHAT, json=BODY, headers={**auth(), "Origin": APP}, timeout=60)
    assert chat.status_code == 200 and "access-control-allow-origin" not in chat.headers
