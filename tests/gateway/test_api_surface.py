"""Every model-serving route of SGLang through the gateway, driven by the clients people use with them.

The OpenAI SDK's Responses API, the Anthropic SDK's Messages API (with ``x-api-key`` and with a bearer
token, and its typed exceptions), and SGLang's tokenize / detokenize / score routes, all against the real
CPU engine behind the shared gateway (models ``tiny`` / alias ``default`` and ``second``).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.core.endpoints import PROXIED, endpoint_table
from tests.admin_client import prometheus_value
from tests.gateway_server import KEY, GatewayServer, auth
from tests.waiting import wait_until

pytestmark = pytest.mark.engine
ENDPOINTS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "serving.md"  # holds the endpoint table


@pytest.fixture(scope="module")
def claude(gateway: GatewayServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.url, api_key=KEY, max_retries=0, timeout=60)


# ------------------------------------------------------------------ OpenAI Responses API
RESPONSES_OK = ("gateway_requests_total", {"model": "tiny", "route": "/v1/responses", "status": "200"})
COMPLETION_TOKENS = ("gateway_tokens_total", {"model": "tiny", "kind": "completion"})


def counters(gateway: GatewayServer) -> tuple[float, float]:
    """(answered /v1/responses requests of ``tiny``, completion tokens of ``tiny``) in the gateway's /metrics."""
    text = httpx.get(gateway.url + "/metrics", headers=auth(), timeout=10).text
    return prometheus_value(text, *RESPONSES_OK) or 0.0, prometheus_value(text, *COMPLETION_TOKENS) or 0.0


def test_responses_create_plain_and_streamed(client: openai.OpenAI, gateway: GatewayServer) -> None:
    answered, tokens = counters(gateway)  # the session's gateway: other tests count on it too
    reply = client.responses.create(model="default", input="Hello!", max_output_tokens=8, temperature=0)
    assert reply.id.startswith("resp_") and reply.model == "tiny" and reply.status in ("completed", "incomplete")
    assert reply.usage is not None and reply.usage.input_tokens > 0 and 0 < reply.usage.output_tokens <= 8
    assert isinstance(reply.output_text, str)

    events = list(client.responses.create(model="tiny", input="Hello!", max_output_tokens=8, temperature=0, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    assert "response.output_text.delta" in kinds and kinds.index("response.output_text.done") < len(kinds) - 1
    assert [event.sequence_number for event in events] == list(range(len(events)))  # nothing lost or reordered
    final = events[-1].response
    assert final.usage is not None and final.usage.output_tokens > 0
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == final.output_text

    # Both answers counted once each, with the tokens each reported (recorded once the last byte went out).
    expected = (answered + 2, tokens + reply.usage.output_tokens + final.usage.output_tokens)
    wait_until(
        lambda: counters(gateway) == expected,
        lambda: f"(requests, completion tokens) moved from {(answered, tokens)} to {counters(gateway)}, not to {expected}", 10, every_s=0.05,
    )  # fmt: skip


def test_stored_responses_by_id(client: openai.OpenAI) -> None:
    first = client.responses.create(model="tiny", input="Remember this.", max_output_tokens=4, temperature=0)
    again = client.responses.retrieve(first.id)
    assert again.id == first.id and again.output_text == first.output_text
    follow = client.responses.create(model="tiny", input="And then?", previous_response_id=first.id, max_output_tokens=4)
    assert follow.previous_response_id == first.id
    with pytest.raises(openai.BadRequestError) as wrong_model:  # the state lives with model "tiny"
        client.responses.create(model="second", input="x", previous_response_id=first.id, max_output_tokens=2)
    assert wrong_model.value.body["param"] == "previous_response_id"
    for call in (lambda: client.responses.retrieve("resp_nope"), lambda: client.responses.cancel("resp_nope")):
        with pytest.raises(openai.NotFoundError) as missing:
            call()
        assert missing.value.body["code"] == "response_not_found"


# ------------------------------------------------------------------ Anthropic Messages API
def test_messages_with_the_anthropic_sdk(claude: anthropic.Anthropic, gateway: GatewayServer) -> None:
    # temperature 0: the tiny random model sampling at 1.0 may end at its first token (no text delta: a
    # make test-random run, seed 776389820, failed there)
    message = claude.messages.create(model="tiny", max_tokens=8, extra_body={"temperature": 0}, messages=[{"role": "user", "content": "Hello!"}])
    assert message.type == "message" and message.role == "assistant" and message.model == "tiny"
    assert message.usage.input_tokens > 0 and 0 < message.usage.output_tokens <= 8
    assert message.content and message.content[0].type == "text"

    with claude.messages.stream(model="default", max_tokens=8, extra_body={"temperature": 0}, messages=[{"role": "user", "content": "Hello!"}]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
    assert "content_block_delta" in kinds and final.usage.output_tokens > 0

    counted = claude.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "Hello!"}])
    assert counted.input_tokens == message.usage.input_tokens

    bearer = anthropic.Anthropic(base_url=gateway.url, auth_token=KEY, api_key=None, max_retries=0, timeout=60)
    assert bearer.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}]).type == "message"
    # what Anthropic clients (Claude Code) send: x-api-key, anthropic-version
    raw = httpx.post(
        gateway.url + "/v1/messages",
        headers={"x-api-key": KEY, "anthropic-version": "2023-06-01", "anthropic-beta": "whatever-2025"},
        json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
        timeout=60,
    )
    assert raw.status_code == 200 and raw.json()["type"] == "message"
    metrics = httpx.get(gateway.url + "/metrics", headers=auth()).text
    assert prometheus_value(metrics, "gateway_requests_total", {"route": "/v1/messages", "status": "200"}) >= 4
    assert prometheus_value(metrics, "gateway_requests_total", {"route": "/v1/messages/count_tokens", "status": "200"}) >= 1


def _anthropic_error(response: httpx.Response, status: int, kind: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"], body
    assert "Traceback" not in response.text and ".py" not in response.text
    return body


def test_anthropic_errors_raise_the_sdks_typed_exceptions(gateway: GatewayServer, claude: anthropic.Anthropic) -> None:
    hello = [{"role": "user", "content": "hi"}]
    wrong = anthropic.Anthropic(base_url=gateway.url, api_key="wrong-key", max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(model="tiny", max_tokens=2, messages=hello)
    assert caught.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude.messages.create(model="no-such-model", max_tokens=2, messages=hello)
    assert caught.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model="tiny", max_tokens=-3, messages=hello)
    assert caught.value.body["error"]["type"] == "invalid_request_error" and "max_tokens" in caught.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):  # the engine's own refusal, re-shaped in Anthropic's dialect
        claude.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}])
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        _anthropic_error(http.post("/v1/messages", json={}), 401, "authentication_error")
        _anthropic_error(http.post("/v1/messages", content=b"{not json", headers={"x-api-key": KEY}), 400, "invalid_request_error")
        _anthropic_error(http.post("/v1/messages/nope", json={}, headers={"x-api-key": KEY}), 404, "not_found_error")
        # x-api-key is Anthropic's header: the OpenAI routes still want a bearer token
        assert http.post("/v1/chat/completions", json={}, headers={"x-api-key": KEY}).json()["error"]["code"] == "missing_api_key"


# ------------------------------------------------------------------ SGLang's own model routes
def test_tokenize_detokenize_round_trip_and_score(gateway: GatewayServer) -> None:
    with httpx.Client(base_url=gateway.url, headers=auth(), timeout=60) as http:
        tokens = http.post("/v1/tokenize", json={"model": "tiny", "prompt": "hello world"}).json()
        assert tokens["count"] == len(tokens["tokens"]) > 0
        text = http.post("/v1/detokenize", json={"model": "tiny", "tokens": tokens["tokens"]}).json()["text"]
        assert "hello world" in text
        unnamed = http.post("/v1/tokenize", json={"prompt": "hello world"})  # no model: the default model answers
        assert unnamed.status_code == 200 and unnamed.json()["tokens"] == tokens["tokens"]
        refused = http.post("/v1/detokenize", json={"model": "tiny", "tokens": [-1]})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_token_ids"
        score = http.post("/v1/score", json={"model": "default", "query": "Is it?", "items": ["yes", "no"], "label_token_ids": [1, 2]})
        assert score.status_code == 200, score.text
        assert len(score.json()["scores"]) == 2 and all(len(row) == 2 for row in score.json()["scores"])
        poison = http.post("/v1/score", json={"model": "tiny", "query": [1, 999_999], "items": [[1]], "label_token_ids": [1]})
        assert poison.status_code == 400 and poison.json()["error"]["param"] == "query"
        # routes that need another kind of model answer the engine's 400, not a 5xx
        rerank = http.post("/v1/rerank", json={"model": "tiny", "query": "q", "documents": ["a", "b"]})
        assert rerank.status_code == 400 and "embedding" in rerank.json()["error"]["message"]


# ------------------------------------------------------------------ one table for all of it
def test_docs_list_exactly_the_route_table() -> None:
    assert endpoint_table() in ENDPOINTS_PAGE.read_text(), (
        "docs/serving.md's endpoint table differs from gateway.core.endpoints: paste endpoint_table()"
    )


def test_openapi_lists_every_proxied_route(gateway: GatewayServer) -> None:
    paths = httpx.get(gateway.url + "/openapi.json", headers=auth(), timeout=30).json()["paths"]
    assert {route.path for route in PROXIED} <= set(paths)
    assert json.dumps(paths).count("/admin") == 0


def _engine_routes() -> list[tuple[str, str]]:
    """Every (method, path) the installed SGLang's HTTP server registers (read in a subprocess)."""
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("sglang_routes.py"))], capture_output=True, text=True, timeout=300, check=False
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("ROUTES ")), None)
    assert line, f"could not list SGLang's routes:\n{proc.stderr[-3000:]}"
    return [(method, path) for method, path in json.loads(line.removeprefix("ROUTES "))]


def test_nothing_of_the_engines_control_surface_is_reachable(gateway: GatewayServer) -> None:
    served = {route.path for route in PROXIED} | {"/v1/models", "/v1/models/{model:path}", "/health", "/ready", "/metrics",
                                                  "/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel", "/openapi.json",
                                                  "/"}  # fmt: skip  # "/": the gateway's own status page (tests/gateway/test_status_page.py)
    engine_routes = [(method, path) for method, path in _engine_routes() if method != "HEAD"]
    control = [(method, path) for method, path in engine_routes if path not in served]
    assert len(control) > 40 and ("POST", "/generate") in control and ("POST", "/abort_request") in control  # the check is real
    with httpx.Client(base_url=gateway.url, headers=auth(), timeout=30) as http:
        for method, path in control:
            url = re.sub(r"\{[^}]+\}", "x", path)
            response = http.request(method, url, json={"model": "tiny", "text": "hi"} if method in ("POST", "PUT") else None)
            assert response.status_code in (404, 405), (method, path, response.status_code, response.text[:200])
            assert "error" in response.json(), (method, path)
