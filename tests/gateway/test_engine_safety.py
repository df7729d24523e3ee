"""Clients must not be able to take a model down or hold it: with the real SGLang CPU engine.

- token ids outside the model's vocabulary crash SGLang's scheduler: the gateway refuses them (the
  shared engine must survive a barrage of them; it is the same engine every other test uses);
- (a client that stops reading a stream gives its concurrency slot back: tests/gateway/test_native_relay.py, against
  a FAKE engine that fills the gateway's buffers at once; the real one filled them only near the end of its answer);
- what the engine says about its own failures does not reach clients; its validation dumps are
  rewritten as ``field: problem``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from launch.model_info import vocab_size
from launch.process import EngineProcess
from tests.gateway.helpers import assert_openai_error
from tests.gateway_server import KEY, GatewayServer, auth, serve

HELLO = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def guarded(tiny_engine: EngineProcess) -> Iterator[GatewayServer]:
    """The shared engine as a managed-style model (vocabulary read from its files), and twice by URL:
    with and without a configured vocabulary size."""
    models = {
        "tiny": {"engine": {"model_path": tiny_engine.config.model_path, "device": "cpu"}},
        "remote": {"url": tiny_engine.url, "served_model_name": "tiny", "vocab_size": vocab_size(tiny_engine.config.model_path)},
        "unknown-vocab": {"url": tiny_engine.url, "served_model_name": "tiny"},
    }
    # "remote" lets clients send raw chat input_ids (an SGLang extension): validated, not refused.
    with serve(models, {"api_keys": [KEY], "extension_fields": {"remote": ["input_ids"]}}, engines={"tiny": tiny_engine}) as gw:
        yield gw


def test_out_of_vocabulary_token_ids_never_reach_the_engine(guarded: GatewayServer, tiny_engine: EngineProcess) -> None:
    vocab = vocab_size(tiny_engine.config.model_path)
    assert vocab == 512
    pid = tiny_engine.pid
    poisons: list[tuple[str, str, Any]] = [
        ("/v1/completions", "prompt", [999_999_999]),
        ("/v1/completions", "prompt", [-1]),
        ("/v1/completions", "prompt", [vocab]),
        ("/v1/completions", "prompt", [[1, 2], [3, vocab]]),
        ("/v1/embeddings", "input", [vocab + 7]),
        ("/v1/embeddings", "input", [[5], [-3]]),
    ]
    with httpx.Client(base_url=guarded.url, headers=auth(), timeout=60) as http:
        for round_ in range(5):  # a barrage: one of these alone used to take the model down for everyone
            for path, field, ids in poisons:
                for model in ("tiny", "remote"):
                    body = {"model": model, field: ids, **({"max_tokens": 2} if field == "prompt" else {})}
                    error = assert_openai_error(http.post(path, json=body), 400, "invalid_token_ids")["error"]
                    assert error["param"] == field and "token id" in error["message"]
            ok = http.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, vocab - 1], "max_tokens": 2})
            assert ok.status_code == 200 and ok.json()["choices"], (round_, ok.text)
        # Without a known vocabulary only negative ids can be refused; the configured size is used when given.
        unknown = http.post("/v1/completions", json={"model": "unknown-vocab", "prompt": [-5], "max_tokens": 2})
        assert assert_openai_error(unknown, 400, "invalid_token_ids")["error"]["param"] == "prompt"
        chat = http.post("/v1/chat/completions", json={"model": "tiny", "messages": HELLO, "max_tokens": 2})
        assert chat.status_code == 200
    assert tiny_engine.running and tiny_engine.pid == pid, "the shared engine died"


def test_engine_internals_and_validation_dumps_do_not_reach_clients(guarded: GatewayServer) -> None:
    with httpx.Client(base_url=guarded.url, headers=auth(), timeout=60) as http:
        # "rid" is SGLang's own request id; a list made the engine answer 500 "unhashable type: 'list'".
        rid = assert_openai_error(http.post("/v1/chat/completions", json={"model": "tiny", "messages": HELLO, "rid": ["a"]}), 400)
        assert rid["error"]["param"] == "rid" and "unhashable" not in rid["error"]["message"]
        # The engine's own validation rejects a priority this large, with a repr of pydantic's errors.
        dump = http.post("/v1/chat/completions", json={"model": "tiny", "messages": HELLO, "max_tokens": 2, "priority": 10**20})
        message = assert_openai_error(dump, 400)["error"]["message"]
        assert message.startswith("priority: ") and "'loc'" not in message and "{" not in message, message


def test_requests_that_crashed_or_froze_the_engine_are_refused_and_the_model_keeps_serving(
    guarded: GatewayServer, tiny_engine: EngineProcess
) -> None:
    """Each of these took SGLang 0.5.23's CPU engine down (crash or frozen scheduler) through the gateway before
    its allowlist: now each is a 400 naming the field, and the shared engine answers throughout."""
    pid = tiny_engine.pid
    vocab = vocab_size(tiny_engine.config.model_path)
    score = {"model": "tiny", "label_token_ids": [1]}
    refused: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/chat/completions", {"model": "tiny", "messages": HELLO, "input_ids": [-1]}, "input_ids"),  # extension off
        ("/v1/chat/completions", {"model": "remote", "messages": HELLO, "input_ids": [-1]}, "input_ids"),  # on: checked
        ("/v1/chat/completions", {"model": "remote", "messages": HELLO, "input_ids": [1, 2, vocab + 99_487]}, "input_ids"),
        ("/v1/chat/completions", {"model": "tiny", "messages": HELLO, "logit_bias": {str(vocab + 5): 1.0}}, "logit_bias"),
        ("/v1/score", {**score, "query": [], "items": [[]]}, "query"),
        ("/v1/score", {**score, "query": [1], "items": [[], []]}, "items"),
        # Found by the same fuzz under a new seed: a text item joined to no query is 0 tokens
        ("/v1/score", {**score, "items": [""]}, "items"),
        ("/v1/score", {**score, "query": None, "items": ["a", ""], "item_first": True}, "items"),
        ("/v1/score", {**score, "query": "q", "items": ["a"] * 20_000}, "items"),
        ("/v1/completions", {"model": "tiny", "prompt": ["a"] * 20_000, "max_tokens": 1}, "prompt"),
        ("/v1/chat/completions", {"model": "tiny", "messages": HELLO, "regex": "x+", "stop_regex": "(x+x+)+y", "max_tokens": 64}, "stop_regex"),
        ("/v1/completions", {"model": "tiny", "prompt": "a", "regex": "|".join(f"w{i:06d}" for i in range(40_000))}, "regex"),
        ("/v1/chat/completions", {"model": "tiny", "messages": HELLO, "rid": "x"}, "rid"),
        # Found by the fuzz generated from the engine's OpenAPI schema: an empty prompt has no token and crashes
        # the forward pass; an Anthropic tool whose type is not a string is a 500.
        ("/v1/completions", {"model": "tiny", "prompt": ["", "x"], "max_tokens": 1}, "prompt"),
        ("/v1/embeddings", {"model": "tiny", "input": ""}, "input"),
        ("/v1/messages", {"model": "tiny", "messages": HELLO, "max_tokens": 2, "tools": [{"name": "f", "type": {"a": 1}}]}, "tools"),
    ]
    with httpx.Client(base_url=guarded.url, headers=auth(), timeout=60) as http:
        for path, body, field in refused:
            response = http.post(path, json=body)
            error = response.json()["error"]  # Anthropic's dialect has no param: the message starts with the field
            named = error.get("param") == field or error["message"].startswith(field)
            assert response.status_code == 400 and named, (path, field, response.text[:300])
        enabled = http.post("/v1/chat/completions", json={"model": "remote", "messages": HELLO, "input_ids": [1, 2, 3], "max_tokens": 2})
        assert enabled.status_code == 200, enabled.text  # enabled and in the vocabulary: served
        bounded = http.post("/v1/chat/completions", json={"model": "tiny", "messages": HELLO, "stop_regex": r"\d{1,3}\.", "max_tokens": 4})
        assert bounded.status_code == 200, bounded.text
        for linear in (r"[.!?]\s*$", r"and|or"):  # SGLang's own stop_regex tests: unbounded, yet searched in linear time
            sentence = http.post("/v1/chat/completions", json={"model": "tiny", "messages": HELLO, "stop_regex": linear, "max_tokens": 4})
            assert sentence.status_code == 200, sentence.text
        ok = http.post("/v1/score", json={**score, "query": "q", "items": ["a", "b"]})
        assert ok.status_code == 200, ok.text
        joined = http.post("/v1/score", json={**score, "query": "q", "items": [""]})  # the prompt scored is "q"
        assert joined.status_code == 200 and len(joined.json()["scores"]) == 1, joined.text
    assert tiny_engine.running and tiny_engine.pid == pid, "the shared engine died"
