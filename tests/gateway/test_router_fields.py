"""What reaches a worker when a ``url:`` model is SGLang's router: the router re-serialises request bodies.

Chain: client -> gateway (``url:`` the router) -> sglang-router 0.3.2 (real process) -> a FAKE recording worker.
The fake stands in for the engine because the real one cannot report the body it received; it answers the
router's start-up probes and records every POST. What this module asserts is what docs/scaling.md ("Past one machine")
lists (fields kept, renamed, dropped; routes the router answers itself or does not serve). No engine starts.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks import processes
from tests.gateway.helpers import assert_openai_error
from tests.gateway_server import KEY, GatewayServer, auth, serve

HELLO = [{"role": "user", "content": "hi"}]
CHAT_ANSWER = {
    "id": "chatcmpl-fake", "object": "chat.completion", "created": 0, "model": "tiny",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}  # fmt: skip


@dataclass
class RecordingWorker:
    """A FAKE SGLang worker: answers the router's probes, records each POST body, answers with a chat completion."""

    model_path: str
    received: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        worker = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _json(self, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.send_header("connection", "close")  # no kept connection outlives stop()
                self.end_headers()
                self.wfile.write(data)
                self.close_connection = True

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                info = {
                    "model_path": worker.model_path, "tokenizer_path": worker.model_path, "served_model_name": "tiny",
                    "is_generation": True,
                }  # fmt: skip
                self._json(info if "info" in self.path else {"object": "list", "data": []})

            def do_POST(self) -> None:  # noqa: N802
                raw = self.rfile.read(int(self.headers.get("content-length", 0)))
                worker.received.append((self.path, json.loads(raw)))
                self._json(CHAT_ANSWER)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    stopped: bool = False

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.stopped = True


@dataclass
class Chain:
    gateway: GatewayServer
    worker: RecordingWorker
    router_url: str

    def send(self, path: str, body: dict[str, Any]) -> tuple[httpx.Response, dict[str, Any] | None]:
        """POST through the gateway; what the worker received (None: nothing reached it)."""
        before = len(self.worker.received)
        response = httpx.post(self.gateway.url + path, json=body, headers=auth(), timeout=30)
        received = self.worker.received[before:]
        return response, (received[-1][1] if received else None)


@contextmanager
def running_chain(model_dir: Path, logs: Path) -> Iterator[Chain]:
    """A recording worker, a router in front of it and a gateway in front of the router, all stopped after."""
    worker = RecordingWorker(str(model_dir))
    try:
        with processes.router([worker.url], logs) as (router_url, _):
            with serve({"tiny": {"url": router_url}}, {"api_keys": [KEY]}) as gateway:
                yield Chain(gateway, worker, router_url)
    finally:
        if not worker.stopped:
            worker.stop()


@pytest.fixture(scope="module")
def chain(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chain]:
    """The module's chain; no test may stop its worker (one that does builds its own: ``running_chain``)."""
    with running_chain(tiny_model_dir, tmp_path_factory.mktemp("router-fields")) as built:
        yield built


def test_chat_fields_kept_renamed_and_dropped(chain: Chain) -> None:
    kept = {
        "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "n": 2, "stop": ["x"], "seed": 3,
        "logprobs": True, "top_logprobs": 2, "presence_penalty": 0.1, "frequency_penalty": 0.2,
        "repetition_penalty": 1.1, "min_tokens": 1, "ignore_eos": True, "skip_special_tokens": False,
        "stop_token_ids": [1], "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": "auto", "chat_template_kwargs": {"enable_thinking": False},
        "separate_reasoning": False,
    }  # fmt: skip
    # user: dropped by the router; metadata: by the gateway (OpenAI's stored-completion tag). Unknown fields and
    # SGLang's engine-control fields (rid...) never get that far: the gateway's allowlist refuses them.
    dropped = {"user": "u", "metadata": {"k": "v"}}
    response, got = chain.send(
        "/v1/chat/completions", {"model": "tiny", "messages": HELLO, "max_tokens": 5, **kept, **dropped}
    )
    assert response.status_code == 200 and got is not None, response.text
    assert {key: got.get(key) for key in kept} == kept
    assert not set(dropped) & set(got), got
    assert got["max_completion_tokens"] == 5 and "max_tokens" not in got  # renamed; SGLang reads either
    assert got["messages"] == HELLO and got["model"] == "tiny"

    structured = [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
        {"response_format": {"type": "json_object"}},
        {"ebnf": 'root ::= "a"'},
        {"regex": "[a-z]+"},
    ]
    for extra in structured:
        response, got = chain.send("/v1/chat/completions", {"model": "tiny", "messages": HELLO, **extra})
        assert response.status_code == 200 and got is not None and {k: got[k] for k in extra} == extra, (extra, got)

    options = {"include_usage": True, "continuous_usage_stats": True}
    response, got = chain.send(
        "/v1/chat/completions", {"model": "tiny", "messages": HELLO, "stream": True, "stream_options": options}
    )
    assert got is not None and got["stream_options"] == {"include_usage": True}  # SGLang's per-chunk usage is lost


def test_requests_the_router_refuses_that_sglang_accepts(chain: Chain) -> None:
    """The router validates bodies by its own rules: these never reach the worker, and answer 400 / 422 (the
    router's status) without addresses."""
    refused = [
        ("/v1/chat/completions", {"model": "tiny", "messages": HELLO, "stream_options": {"include_usage": True}}),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": HELLO, "regex": "a", "response_format": {"type": "json_object"}},
        ),
        ("/v1/completions", {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}),  # token ids as the prompt
    ]
    for path, body in refused:
        response, got = chain.send(path, body)
        assert got is None and response.status_code in (400, 422), (body, got, response.text)
        error = assert_openai_error(response, response.status_code)
        assert "127.0.0.1" not in response.text and "http://" not in response.text, error


def test_other_routes(chain: Chain) -> None:
    body = {
        "model": "tiny", "prompt": "hi", "max_tokens": 5, "echo": True, "suffix": "s", "logprobs": 2, "best_of": 2,
        "regex": "[a-z]+", "user": "u",
    }  # fmt: skip
    response, got = chain.send("/v1/completions", body)
    assert response.status_code == 200 and got is not None and {k: got[k] for k in body} == body  # passed through

    body = {
        "model": "tiny",
        "input": "hi",
        "instructions": "be short",
        "max_output_tokens": 5,
        "store": True,
    }
    response, got = chain.send("/v1/responses", body)
    assert (
        got is not None
        and {k: got[k] for k in body} == body
    )
    assert got["temperature"] == 1.0  # a default the router adds (SGLang would take the model's generation config)

    body = {"model": "tiny", "input": "hi", "dimensions": 8, "encoding_format": "float"}
    response, got = chain.send("/v1/embeddings", body)
    assert got is not None and got["dimensions"] == 8

    for path, body in (
        ("/v1/tokenize", {"model": "tiny", "prompt": "hello world"}),
        ("/v1/detokenize", {"model": "tiny", "tokens": [5, 6]}),
    ):
        response, got = chain.send(path, body)
        assert response.status_code == 200 and got is None, response.text  # the router's own tokenizer answers

    for path, body in (
        ("/v1/messages", {"model": "tiny", "messages": HELLO, "max_tokens": 4}),
        ("/v1/messages/count_tokens", {"model": "tiny", "messages": HELLO}),
        ("/v1/score", {"model": "tiny", "query": "q", "items": ["a"], "label_token_ids": [1]}),
    ):
        response, got = chain.send(path, body)
        assert response.status_code == 404 and got is None, (path, response.text)  # not a route of the router


def test_a_dead_worker_is_answered_without_its_address(tiny_model_dir: Path, tmp_path: Path) -> None:
    """With its only worker gone, the router answers 500 naming the worker's URL; the client sees neither.
    (A chain of its own: the module's worker must stay up for the other tests, whatever their order.)"""
    with running_chain(tiny_model_dir, tmp_path) as chain:
        _dead_worker_is_answered_without_its_address(chain)


def _dead_worker_is_answered_without_its_address(chain: Chain) -> None:
    chain.worker.stop()
    for _ in range(2):
        response = httpx.post(
            chain.gateway.url + "/v1/chat/completions",
            json={"model": "tiny", "messages": HELLO},
            headers=auth(),
            timeout=60,
        )
        assert response.status_code in (502, 503), response.text
        assert chain.worker.url.split("//")[1] not in response.text and "127.0.0.1" not in response.text, response.text
    direct = httpx.post(
        chain.router_url + "/v1/chat/completions", json={"model": "tiny", "messages": HELLO}, timeout=60
    )
    assert direct.status_code in (500, 503), direct.text  # what the gateway re-shaped


@pytest.mark.parametrize(
    ("extra_args", "failed_expected"),
    [((), True), (("--cb-failure-threshold", "3"), False)],
    ids=["default-circuit-breaker", "circuit-breaker-below-retries"],
)
def test_cache_aware_failover_needs_a_circuit_breaker_below_the_retries(
    tiny_model_dir: Path, tmp_path: Path, extra_args: tuple[str, ...], failed_expected: bool
) -> None:
    """Under ``cache_aware`` a prompt sticks to one worker. When that worker dies, the router retries a request
    (5 times) on the same worker until its circuit breaker opens: with the default threshold (10 failures) the first
    requests fail; with a threshold below the retries the same request moves on to the other worker."""
    workers = [RecordingWorker(str(tiny_model_dir)) for _ in range(2)]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "the same question every time"}]}
    try:
        with processes.router([w.url for w in workers], tmp_path, "cache_aware", extra_args) as (router_url, _):
            with serve({"tiny": {"url": router_url}}, {"api_keys": [KEY]}) as gateway:
                ask = lambda: httpx.post(gateway.url + "/v1/chat/completions", json=body, headers=auth(), timeout=60)  # noqa: E731
                assert all(ask().status_code == 200 for _ in range(4))
                (sticky,) = [w for w in workers if w.received]  # one prompt, one worker
                sticky.stop()
                statuses = [ask().status_code for _ in range(6)]
    finally:
        for worker in workers:
            if not worker.stopped:
                worker.stop()
    failed = [status for status in statuses if status != 200]
    assert bool(failed) is failed_expected, statuses
    assert set(failed) <= {502} and statuses[-1] == 200, statuses  # the router's 500 becomes the gateway's 502
