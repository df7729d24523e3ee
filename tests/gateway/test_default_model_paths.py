"""Correctness you can see, on the real default model (SmolLM2-135M-Instruct), greedy: every path gives the engine's
own answer.

One English, one Japanese and one French-with-emoji prompt. For each, the engine asked directly is the reference
(text and usage); then the gateway's plain answer, its stream through the Python relay and through the native relay
(the thread relayed it: checked), the Responses and Messages routes, a batch line, and each MLflow flavour's
``predict`` (tests/model_code/test_tools_mlflow.py) must give the same text and completion tokens. Multi-byte characters cross event boundaries in the
streams: a broken UTF-8 sequence would show as U+FFFD or a text that differs. Stop strings and a ``json_schema``
answer that holds the right fact close the tour.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from launch.process import EngineProcess
from tests.batches.helpers import results, upload, wait_ended
from tests.gateway_server import GatewayServer, serve
from tests.waiting import wait_until

pytestmark = pytest.mark.real_model

PROMPTS = {
    "english": "Name three colors of the rainbow.",
    "japanese": "日本の首都はどこですか？日本語で答えてください。",
    "french": "Écris une phrase joyeuse sur la mer avec un emoji 🌊.",
}
MAX_TOKENS = 24
KEY = "sk-paths"


@pytest.fixture(scope="module")
def gateways(smollm2_engine: EngineProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[bool, GatewayServer]]:
    """Two gateways in front of the same engine: the Python relay (False) and the native relay (True)."""
    settings = {"keys": [{"name": "paths", "key": KEY}], "state_dir": str(tmp_path_factory.mktemp("paths-state"))}
    model = {"smollm2": {"url": smollm2_engine.url, "aliases": ["default"]}}
    with serve(model, {**settings, "relay_native": False}) as python, serve(model, {**settings, "relay_native": True}) as native:
        yield {False: python, True: native}


def _body(prompt: str) -> dict[str, Any]:
    return {"model": "default", "messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": MAX_TOKENS}


@pytest.fixture(scope="module")
def reference(smollm2_engine: EngineProcess) -> dict[str, tuple[str, int]]:
    """(text, completion tokens) of each prompt, from the engine itself."""
    out = {}
    for name, prompt in PROMPTS.items():
        answer = httpx.post(smollm2_engine.url + "/v1/chat/completions", json=_body(prompt), timeout=300).json()
        out[name] = (answer["choices"][0]["message"]["content"], answer["usage"]["completion_tokens"])
        # the engine's own: a character cut by max_tokens ends the text as U+FFFD (SGLang's detokenizer), nowhere else
        assert out[name][0] and "\ufffd" not in out[name][0].rstrip("\ufffd"), out[name]
    return out


def _client(gateway: GatewayServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_the_gateway_gives_the_engines_answer_plain_and_streamed_through_either_relay(
    name: str, gateways: dict[bool, GatewayServer], reference: dict[str, tuple[str, int]]
) -> None:
    expected = reference[name]
    plain = _client(gateways[False]).chat.completions.create(**_body(PROMPTS[name]))
    assert (plain.choices[0].message.content, plain.usage.completion_tokens) == expected
    for native, gateway in gateways.items():
        chunks = list(_client(gateway).chat.completions.create(**_body(PROMPTS[name]), stream=True, stream_options={"include_usage": True}))
        text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        assert (text, chunks[-1].usage.completion_tokens) == expected, (native, text)
    streams = gateways[True].state.proxy.streams
    wait_until(lambda: (streams.native_stats() or {}).get("streams", 0) == 0, "the native relay let the stream go", 10, 0.01)
    assert streams.native_stats()["events"] > 0  # at ~20 tokens/s the stream outlives the 10 ms before it goes native


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_responses_and_messages_give_the_engines_answer(
    name: str, gateways: dict[bool, GatewayServer], reference: dict[str, tuple[str, int]], smollm2_engine: EngineProcess
) -> None:
    gateway, prompt = gateways[False], PROMPTS[name]
    request = {"model": "default", "input": [{"role": "user", "content": prompt}], "temperature": 0, "max_output_tokens": MAX_TOKENS, "store": False}
    response = _client(gateway).responses.create(**request)
    # SGLang 0.5.23's Responses route stops two tokens short of max_output_tokens (its chat route does not): its own
    # answer on that route is the reference, and its text is the chat answer's beginning
    direct = httpx.post(smollm2_engine.url + "/v1/responses", json={**request, "model": "smollm2"}, timeout=300).json()
    direct_text = "".join(part["text"] for item in direct["output"] if item["type"] == "message" for part in item["content"])
    assert (response.output_text, response.usage.output_tokens) == (direct_text, direct["usage"]["output_tokens"])
    assert reference[name][0].startswith(direct_text.rstrip("\ufffd"))
    messages = anthropic.Anthropic(base_url=gateway.url, api_key=KEY, max_retries=0, timeout=300)
    with messages.messages.stream(model="default", max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": prompt}],
                                  extra_body={"temperature": 0}) as stream:  # fmt: skip
        message = stream.get_final_message()
    assert ("".join(b.text for b in message.content if b.type == "text"), message.usage.output_tokens) == reference[name]


def test_a_batch_line_gives_the_engines_answer(gateways: dict[bool, GatewayServer], reference: dict[str, tuple[str, int]]) -> None:
    client = _client(gateways[False])
    lines = [{"custom_id": name, "method": "POST", "url": "/v1/chat/completions", "body": _body(prompt)} for name, prompt in PROMPTS.items()]
    batch = client.batches.create(input_file_id=upload(client, lines), endpoint="/v1/chat/completions", completion_window="24h")
    ended = wait_ended(client, batch.id, timeout_s=600)
    assert ended.status == "completed", ended
    for line in results(client, ended.output_file_id):
        body = line["response"]["body"]
        assert (body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"]) == reference[line["custom_id"]]


def test_a_stop_string_ends_the_answer_where_the_engine_ends_it(gateways: dict[bool, GatewayServer], reference: dict[str, tuple[str, int]]) -> None:
    full = reference["english"][0]
    word = full.split()[2]  # a word from inside the greedy answer
    body = {**_body(PROMPTS["english"]), "stop": [word]}
    for native, gateway in gateways.items():
        chunks = list(_client(gateway).chat.completions.create(**body, stream=True))
        text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        assert text == full[: full.index(word)] and chunks[-1].choices[0].finish_reason == "stop", (native, text)


def test_a_json_schema_answer_holds_the_right_fact(gateways: dict[bool, GatewayServer]) -> None:
    schema = {"type": "object", "properties": {"capital": {"type": "string", "enum": ["Paris", "London", "Berlin", "Madrid"]}},
              "required": ["capital"], "additionalProperties": False}  # fmt: skip
    answer = _client(gateways[False]).chat.completions.create(
        model="default", messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}], temperature=0,
        max_tokens=32, response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}},
    )  # fmt: skip
    assert json.loads(answer.choices[0].message.content) == {"capital": "Paris"}
