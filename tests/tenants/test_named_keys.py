"""Named keys through real clients (the openai and anthropic SDKs, raw HTTP) against the FAKE upstream of the
benchmarks (it answers at once, with the usage SGLang reports): the models a key may use, its per-minute limits
with the headers its SDK reads, its budgets over a moved clock, its concurrency, and the config that names them.
"""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from benchmarks import processes
from gateway.config import gateway_settings
from launch.config import ConfigError, parse_config
from tests.fake_upstreams import fake_stalled_upstream
from tests.gateway_server import GatewayServer, serve

PROMPT = [{"role": "user", "content": "hi"}]
BATCH, CHAT, OTHER = "sk-batch-0123456789", "sk-chat-0123456789", "sk-plain-0123456789"


class Clock:
    """The quotas' clock, moved by the test (wall-clock seconds: budgets follow the UTC calendar)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with processes.fake_upstream("starlette", tmp_path_factory.mktemp("fake-upstream")) as (url, _):
        yield url


def _serve(upstream: str, keys: list[dict[str, Any]], **gateway: Any) -> Any:
    models = {"a": {"url": upstream, "aliases": ["default"]}, "b": {"url": upstream}}
    return serve(models, {"keys": keys, "api_keys": [OTHER], **gateway})


def _clock(server: GatewayServer, now: float = 1_767_225_600.0) -> Clock:  # 2026-01-01T00:00:00Z
    clock = server.app.state.quotas.clock = Clock(now)
    return clock


def _sdk(server: GatewayServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=30)


def _chat(client: openai.OpenAI, model: str = "a", tokens: int = 4) -> Any:
    return client.chat.completions.with_raw_response.create(model=model, messages=PROMPT, max_tokens=tokens)


def test_a_key_limited_to_one_model_does_not_see_the_others(upstream: str) -> None:
    with _serve(upstream, [{"name": "chat", "key": CHAT, "models": ["a"]}]) as server:
        limited, plain = _sdk(server, CHAT), _sdk(server, OTHER)
        assert [model.id for model in limited.models.list()] == ["a", "default"]  # a model and its alias
        assert {model.id for model in plain.models.list()} == {"a", "default", "b"}
        assert _chat(limited, "default").parse().model == "a"  # an alias of a model it may use
        with pytest.raises(openai.NotFoundError) as refused:
            _chat(limited, "b")
        assert refused.value.body["code"] == "model_not_found" and "'b' does not exist" in refused.value.body["message"]
        with pytest.raises(openai.NotFoundError):
            limited.models.retrieve("b")
        assert _chat(plain, "b").parse().model == "b"


def test_the_log_line_names_the_key_never_the_key_itself(upstream: str) -> None:
    from loguru import logger

    lines: list[str] = []
    sink = logger.add(lambda message: lines.append(str(message)), level="INFO", format="{message}")
    try:
        with _serve(upstream, [{"name": "chat", "key": CHAT}]) as server:
            _chat(_sdk(server, CHAT))
            _chat(_sdk(server, OTHER))
    finally:
        logger.remove(sink)
    requests = [line for line in lines if line.startswith("request ") and "/v1/chat/completions" in line]
    assert len(requests) == 2 and " key=chat " in requests[0] and " key=" not in requests[1], requests
    assert not any(CHAT in line or OTHER in line for line in lines)


def test_requests_per_minute_with_the_headers_openai_clients_read(upstream: str) -> None:
    with _serve(upstream, [{"name": "batch", "key": BATCH, "limits": {"requests_per_minute": 3}}]) as server:
        clock = _clock(server)
        client = _sdk(server, BATCH)
        remaining = []
        for _ in range(3):
            answer = _chat(client)
            assert answer.headers["x-ratelimit-limit-requests"] == "3"
            remaining.append(answer.headers["x-ratelimit-remaining-requests"])
        assert remaining == ["2", "1", "0"]
        assert answer.headers["x-ratelimit-reset-requests"] == "1m0s"  # 3 used: full again in 60 s
        with pytest.raises(openai.RateLimitError) as refused:
            _chat(client)
        error = refused.value
        assert error.status_code == 429 and error.body["code"] == "rate_limit_exceeded" and error.body["type"] == "rate_limit_error"
        assert error.response.headers["retry-after"] == "20" and error.response.headers["x-ratelimit-remaining-requests"] == "0"
        assert "3 requests per minute" in error.body["message"]
        assert _chat(_sdk(server, OTHER)).http_response.status_code == 200  # a plain key has no limit
        clock.now += 20  # one request back
        answer = _chat(client)
        assert answer.http_response.status_code == 200 and answer.headers["x-ratelimit-remaining-requests"] == "0"


def test_tokens_per_minute_are_charged_from_the_usage_the_engine_reported(upstream: str) -> None:
    with _serve(upstream, [{"name": "batch", "key": BATCH, "limits": {"tokens_per_minute": 60}}]) as server:
        clock = _clock(server)
        client = _sdk(server, BATCH)
        first = _chat(client, tokens=40)
        usage = first.parse().usage
        assert first.headers["x-ratelimit-remaining-tokens"] == "60"  # charged when it ends, not before
        second = _chat(client, tokens=40)
        assert int(second.headers["x-ratelimit-remaining-tokens"]) == 60 - usage.total_tokens
        with pytest.raises(openai.RateLimitError) as refused:  # two answers took the bucket below zero
            _chat(client)
        debt = 2 * usage.total_tokens - 60
        assert refused.value.response.headers["retry-after"] == str(-(-(debt + 1) // 1))  # 1 token a second
        clock.now += debt + 1
        assert _chat(client).http_response.status_code == 200


def test_a_stream_is_charged_its_usage_too(upstream: str) -> None:
    with _serve(upstream, [{"name": "batch", "key": BATCH, "limits": {"tokens_per_minute": 1000}}]) as server:
        _clock(server)
        client = _sdk(server, BATCH)
        chunks = list(client.chat.completions.create(model="a", messages=PROMPT, max_tokens=8, stream=True, stream_options={"include_usage": True}))
        used = chunks[-1].usage.total_tokens
        assert int(_chat(client).headers["x-ratelimit-remaining-tokens"]) == 1000 - used


def test_every_answer_to_a_limited_key_carries_its_headers_once(upstream: str) -> None:
    """A stream and an error answered inside the app (an unknown model) carry the headers too, each header once."""
    with _serve(upstream, [{"name": "batch", "key": BATCH, "limits": {"requests_per_minute": 5}}]) as server:
        _clock(server)
        auth = {"authorization": f"Bearer {BATCH}"}
        body = {"model": "a", "messages": PROMPT, "max_tokens": 4, "stream": True}
        with httpx.stream("POST", server.url + "/v1/chat/completions", headers=auth, json=body, timeout=30) as stream:
            assert stream.status_code == 200 and "[DONE]" in stream.read().decode()
            assert stream.headers.get_list("x-ratelimit-remaining-requests") == ["4"]
            assert stream.headers.get_list("x-request-id") and len(stream.headers.get_list("x-ratelimit-limit-requests")) == 1
        missing = httpx.post(server.url + "/v1/chat/completions", headers=auth, json={**body, "model": "nope"}, timeout=30)
        assert missing.status_code == 404 and missing.headers.get_list("x-ratelimit-remaining-requests") == ["3"]
        plain = httpx.post(server.url + "/v1/chat/completions", headers={"authorization": f"Bearer {OTHER}"}, json=body, timeout=30)
        assert plain.status_code == 200 and "x-ratelimit-limit-requests" not in plain.headers


def test_the_quota_layer_alone_adds_its_headers_itself() -> None:
    """Without the request-id layer around it (an embedder's own stack), the quota layer writes the headers."""
    from gateway.config import KeyLimits
    from gateway.edge.quota import QuotaMiddleware
    from gateway.tenants.keys import TENANT_SCOPE_KEY, Tenant
    from gateway.tenants.quotas import Quotas

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    tenant = Tenant(name="batch", owner="tenant:batch", limits=KeyLimits(requests_per_minute=3))
    layer = QuotaMiddleware(app, Quotas(clock=lambda: 1_767_225_600.0))
    asyncio.run(layer({"type": "http", "path": "/v1/chat/completions", TENANT_SCOPE_KEY: tenant}, None, send))  # type: ignore[arg-type]
    headers = dict(sent[0]["headers"])
    assert headers[b"x-ratelimit-limit-requests"] == b"3" and headers[b"x-ratelimit-remaining-requests"] == b"2"
    assert sent[1]["body"] == b"ok"


def test_a_daily_budget_is_spent_then_starts_again_the_next_utc_day(upstream: str) -> None:
    with _serve(upstream, [{"name": "batch", "key": BATCH, "limits": {"tokens_per_day": 30, "tokens_per_month": 10_000}}]) as server:
        clock = _clock(server, 1_767_225_600.0 + 23 * 3600)  # 2026-01-01T23:00:00Z
        client = _sdk(server, BATCH)
        _chat(client, tokens=40)
        with pytest.raises(openai.RateLimitError) as refused:
            _chat(client)
        assert refused.value.body["code"] == "insufficient_quota" and "30 tokens per day" in refused.value.body["message"]
        assert refused.value.response.headers["retry-after"] == "3600"  # at midnight UTC
        clock.now += 3600
        assert _chat(client).http_response.status_code == 200


def test_a_monthly_budget_rolls_over_at_the_new_year(upstream: str) -> None:
    with _serve(upstream, [{"name": "batch", "key": BATCH, "limits": {"tokens_per_month": 30}}]) as server:
        clock = _clock(server, 1_767_225_600.0 - 60)  # 2025-12-31T23:59:00Z
        client = _sdk(server, BATCH)
        _chat(client, tokens=40)
        with pytest.raises(openai.RateLimitError) as refused:
            _chat(client)
        assert refused.value.response.headers["retry-after"] == "60"
        clock.now += 60
        assert _chat(client).http_response.status_code == 200


def test_concurrent_requests_of_one_key(upstream: str) -> None:
    with fake_stalled_upstream() as stalled:
        models = {"a": {"url": upstream}, "stalled": {"url": stalled}}
        keys = [{"name": "chat", "key": CHAT, "limits": {"max_concurrent": 1}}]
        with serve(models, {"keys": keys, "upstream_read_timeout_s": 2}) as server:
            held = threading.Thread(target=lambda: httpx.post(
                server.url + "/v1/chat/completions", headers={"authorization": f"Bearer {CHAT}"}, timeout=30,
                json={"model": "stalled", "messages": PROMPT},
            ))  # fmt: skip
            held.start()
            quotas = server.app.state.quotas
            for _ in range(200):
                if quotas.of("chat", server.state.settings.keys[0].limits).in_flight == 1:
                    break
                threading.Event().wait(0.01)
            with pytest.raises(openai.RateLimitError) as refused:
                _chat(_sdk(server, CHAT))
            assert refused.value.body["code"] == "too_many_concurrent_requests"
            held.join(30)  # the stalled upstream times out (504): the slot is given back
            assert _chat(_sdk(server, CHAT)).http_response.status_code == 200


def test_a_budget_held_by_a_request_in_flight_is_not_spent(upstream: str) -> None:
    """300 tokens a day, one request in flight holding more than that (alone, it runs): another
    request meanwhile gets 429 rate_limit_exceeded with Retry-After 1 (the budget is held), not insufficient_quota
    until midnight; once the hold is given back (504: nothing used) the same request is served."""
    with fake_stalled_upstream() as stalled:
        models = {"a": {"url": upstream}, "stalled": {"url": stalled}}
        keys = [{"name": "batch", "key": BATCH, "limits": {"tokens_per_day": 300}}]
        with serve(models, {"keys": keys, "upstream_read_timeout_s": 3}) as server:
            held = threading.Thread(target=lambda: httpx.post(
                server.url + "/v1/chat/completions", headers={"authorization": f"Bearer {BATCH}"}, timeout=30,
                json={"model": "stalled", "messages": PROMPT, "max_tokens": 500},
            ))  # fmt: skip
            held.start()
            quota = server.app.state.quotas.of("batch", server.state.settings.keys[0].limits)
            for _ in range(500):
                if quota.reserved > 300:
                    break
                threading.Event().wait(0.01)
            with pytest.raises(openai.RateLimitError) as refused:
                _chat(_sdk(server, BATCH), tokens=2)
            assert refused.value.body["code"] == "rate_limit_exceeded" and "held by requests in flight" in refused.value.body["message"]
            assert refused.value.response.headers["retry-after"] == "1"
            held.join(30)
            assert _chat(_sdk(server, BATCH), tokens=2).http_response.status_code == 200


def test_anthropic_clients_get_their_own_rate_limit_headers(upstream: str) -> None:
    with _serve(upstream, [{"name": "chat", "key": CHAT, "limits": {"requests_per_minute": 2}}]) as server:
        _clock(server)
        client = anthropic.Anthropic(base_url=server.url, api_key=CHAT, max_retries=0, timeout=30)
        answer = client.messages.with_raw_response.create(model="a", max_tokens=4, messages=PROMPT)
        assert answer.headers["anthropic-ratelimit-requests-limit"] == "2"
        assert answer.headers["anthropic-ratelimit-requests-remaining"] == "1"
        assert answer.headers["anthropic-ratelimit-requests-reset"] == "2026-01-01T00:00:30Z"
        assert "x-ratelimit-limit-requests" not in answer.headers
        client.messages.create(model="a", max_tokens=4, messages=PROMPT)
        with pytest.raises(anthropic.RateLimitError) as refused:
            client.messages.create(model="a", max_tokens=4, messages=PROMPT)
        assert refused.value.body["type"] == "error" and refused.value.body["error"]["type"] == "rate_limit_error"
        assert refused.value.response.headers["retry-after"] == "30"


def test_a_key_given_by_its_hash_in_a_keys_file(upstream: str, tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"- name: hashed\n  key_sha256: {hashlib.sha256(BATCH.encode()).hexdigest()}\n  models: [b]\n")
    with serve({"a": {"url": upstream}, "b": {"url": upstream}}, {"keys_file": str(keys)}) as server:
        client = _sdk(server, BATCH)
        assert [model.id for model in client.models.list()] == ["b"]
        with pytest.raises(openai.AuthenticationError):
            _chat(_sdk(server, BATCH + "x"), "b")


def _settings_error(gateway: dict[str, Any]) -> str:
    deployment = parse_config({"models": {"a": {"url": "http://127.0.0.1:1", "aliases": ["x"]}}, "gateway": gateway}, "deploy.yaml")
    with pytest.raises(ConfigError) as refused:
        gateway_settings(deployment)
    return str(refused.value)


def test_named_keys_are_checked_with_the_entry_they_come_from(tmp_path: Path) -> None:
    assert _settings_error({"keys": [{"name": "t", "key": "k", "models": ["a", "nope"]}]}) == (
        "deploy.yaml: gateway.keys (t).models: 'nope' is no model or alias of this file"
    )
    assert "give exactly one of key, key_env, key_sha256 (got key, key_sha256)" in _settings_error(
        {"keys": [{"name": "t", "key": "k", "key_sha256": "0" * 64}]}
    )
    assert "'t' names another key too" in _settings_error({"keys": [{"name": "t", "key": "k1"}, {"name": "t", "key": "k2"}]})
    assert "its key is also in gateway.api_keys" in _settings_error({"api_keys": ["k"], "keys": [{"name": "t", "key": "k"}]})
    assert "requests_per_minute: Input should be greater than or equal to 1" in _settings_error(
        {"keys": [{"name": "t", "key": "k", "limits": {"requests_per_minute": 0}}]}
    )
    assert "a key name is 1-64 letters" in _settings_error({"keys": [{"name": "a b", "key": "k"}]})
    plain = tmp_path / "plain.yaml"
    plain.write_text("- {name: t, key: sk-in-clear}\n")
    assert "a keys file holds hashes, not keys: give key_sha256" in _settings_error({"keys_file": str(plain)})
    assert "gateway.keys_env: environment variable NO_SUCH_KEYS_VAR is not set" in _settings_error({"keys_env": "NO_SUCH_KEYS_VAR"})


def test_hash_key_prints_what_a_keys_file_holds() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "hash-key"], input=BATCH + "\n", capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == hashlib.sha256(BATCH.encode()).hexdigest()
    empty = subprocess.run([sys.executable, "-m", "gateway.cli", "hash-key"], input="", capture_output=True, text=True, timeout=60)
    assert empty.returncode == 2 and "no key on stdin" in empty.stderr
