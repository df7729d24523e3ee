"""The three flavours through ``mlflow.pyfunc.load_model``, reaching the shared real engine by URL.

Payload shapes are the ones notebooks send: ChatAgent with parameters in ``custom_inputs``, ChatModel with
OpenAI chat fields at the top level, and a batch of prompts with a system prompt and a JSON schema. Random weights: structure is asserted, not content.
"""

from __future__ import annotations

import json

import pytest

from model_code import errors, python_model_of
from tests.model_code.helpers import engine_children, last_trace

MESSAGES = [{"role": "user", "content": "What is Databricks?"}]
GRADE_SCHEMA = {
    "type": "object",
    "properties": {
        "grade": {"type": "string", "enum": ["yes", "no"]},
        "score": {"type": "integer", "enum": [0, 1, 2, 3]},
        "ok": {"type": "boolean"},
    },
    "required": ["grade", "score", "ok"],
    "additionalProperties": False,
}


def _check_grade(text: str) -> None:
    parsed = json.loads(text)
    assert parsed["grade"] in ("yes", "no")
    assert isinstance(parsed["score"], int) and isinstance(parsed["ok"], bool)


# ------------------------------------------------------------------------------------ ChatAgent
def test_chat_agent_predict_seed_shape(url_models):
    _, model = url_models["chat_agent"]
    out = model.predict({"messages": MESSAGES, "custom_inputs": {"temperature": 0.1, "max_tokens": 50}})
    [message] = out["messages"]
    assert message["role"] == "assistant" and isinstance(message["content"], str) and message["id"]
    assert out["finish_reason"] in ("stop", "length")
    assert out["usage"]["completion_tokens"] > 0 and out["usage"]["total_tokens"] > out["usage"]["completion_tokens"]

    trace = last_trace()
    root = trace.data.spans[0]
    assert root.inputs["messages"][0]["content"] == "What is Databricks?"
    assert root.outputs["messages"][0]["content"] == message["content"]
    assert trace.info.token_usage["output_tokens"] == out["usage"]["completion_tokens"]


def test_chat_agent_without_custom_inputs(url_models):
    _, model = url_models["chat_agent"]
    out = model.predict({"messages": MESSAGES})  # defaults from the config: max_tokens 24
    assert out["usage"]["completion_tokens"] <= 24


def test_chat_agent_stream(url_models):
    _, model = url_models["chat_agent"]
    chunks, text = [], ""
    for chunk in model.predict_stream({"messages": MESSAGES, "custom_inputs": {"temperature": 0.0, "max_tokens": 16}}):
        text += chunk["delta"]["content"]  # the loop ChatAgent's documentation writes: every chunk has it
        chunks.append(chunk)
    assert len(chunks) >= 2
    assert all(c["delta"]["role"] == "assistant" for c in chunks)
    assert len({c["delta"]["id"] for c in chunks}) == 1
    finishes = [c for c in chunks if c.get("finish_reason")]
    assert finishes == [chunks[-1]] and finishes[0]["finish_reason"] in ("stop", "length")
    assert chunks[-1]["usage"]["completion_tokens"] > 0  # usage arrives on the final chunk
    assert not any(c.get("usage") for c in chunks[:-1])

    trace = last_trace()
    assert trace.data.spans[0].outputs["messages"][0]["content"] == text
    assert trace.info.token_usage["output_tokens"] == chunks[-1]["usage"]["completion_tokens"]

    # the same request without streaming gives the same text (temperature 0)
    out = model.predict({"messages": MESSAGES, "custom_inputs": {"temperature": 0.0, "max_tokens": 16}})
    assert out["messages"][0]["content"] == text


def test_chat_agent_json_schema(url_models):
    _, model = url_models["chat_agent"]
    for custom in (
        {"temperature": 0.0, "max_tokens": 64, "json_schema": GRADE_SCHEMA},
        {"temperature": 0.0, "max_tokens": 64, "json_schema": json.dumps(GRADE_SCHEMA)},  # as a JSON string
        {
            "temperature": 0.0,
            "max_tokens": 64,
            "response_format": {"type": "json_schema", "json_schema": {"name": "grade", "schema": GRADE_SCHEMA}},
        },
    ):
        out = model.predict({"messages": MESSAGES, "custom_inputs": custom})
        _check_grade(out["messages"][0]["content"])


def test_chat_agent_errors_are_typed(url_models):
    _, model = url_models["chat_agent"]
    with pytest.raises(errors.BadRequestError, match="unknown generation parameter"):
        model.predict({"messages": MESSAGES, "custom_inputs": {"temprature": 0.1}})
    with pytest.raises(errors.BadRequestError):  # the engine refuses: more tokens than the context holds
        model.predict({"messages": MESSAGES, "custom_inputs": {"max_tokens": 10_000_000}})


# ------------------------------------------------------------------------------------ ChatModel
def test_chat_model_predict(url_models):
    _, model = url_models["chat_model"]
    out = model.predict({"messages": MESSAGES, "temperature": 0.1, "max_tokens": 20})
    [choice] = out["choices"]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    assert out["usage"]["completion_tokens"] <= 20
    trace = last_trace()
    assert trace.data.spans[0].outputs["choices"][0]["message"]["content"] == choice["message"]["content"]
    assert trace.info.token_usage["output_tokens"] == out["usage"]["completion_tokens"]


def test_chat_model_n_and_schema(url_models):
    _, model = url_models["chat_model"]
    out = model.predict({"messages": MESSAGES, "temperature": 0.8, "max_tokens": 8, "n": 2})
    assert [c["index"] for c in out["choices"]] == [0, 1]
    out = model.predict(
        {"messages": MESSAGES, "temperature": 0.0, "max_tokens": 64, "custom_inputs": {"json_schema": GRADE_SCHEMA}}
    )
    _check_grade(out["choices"][0]["message"]["content"])


def test_chat_model_stream(url_models):
    _, model = url_models["chat_model"]
    chunks, text = [], ""
    for chunk in model.predict_stream({"messages": MESSAGES, "temperature": 0.0, "max_tokens": 12}):
        text += chunk["choices"][0]["delta"]["content"]  # the notebook loop: no chunk may break it
        chunks.append(chunk)
    assert all(chunk["choices"][0]["delta"]["role"] == "assistant" for chunk in chunks)
    assert [c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c.get("finish_reason")] in (
        ["stop"],
        ["length"],
    )
    assert chunks[-1]["choices"][0]["finish_reason"] and chunks[-1]["usage"]["completion_tokens"] > 0
    trace = last_trace()
    assert trace.info.token_usage["output_tokens"] == chunks[-1]["usage"]["completion_tokens"]
    assert trace.data.spans[0].outputs["choices"][0]["message"]["content"] == text


# ------------------------------------------------------------------------------------ ResponsesAgent
def test_responses_agent_predict(url_models):
    _, model = url_models["responses_agent"]
    out = model.predict({"input": MESSAGES, "temperature": 0.1, "max_output_tokens": 20})
    [item] = out["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    assert isinstance(item["content"][0]["text"], str)
    assert out["usage"]["output_tokens"] <= 20
    assert out["custom_outputs"]["finish_reason"] in ("stop", "length")
    assert last_trace().info.token_usage["output_tokens"] == out["usage"]["output_tokens"]


def test_responses_agent_json_schema_via_text_format(url_models):
    _, model = url_models["responses_agent"]
    out = model.predict(
        {
            "input": MESSAGES,
            "temperature": 0.0,
            "max_output_tokens": 64,
            "text": {"format": {"type": "json_schema", "name": "grade", "schema": GRADE_SCHEMA, "strict": True}},
        }
    )
    _check_grade(out["output"][0]["content"][0]["text"])
    out = model.predict(
        {"input": MESSAGES, "custom_inputs": {"temperature": 0.0, "max_tokens": 64, "json_schema": GRADE_SCHEMA}}
    )
    _check_grade(out["output"][0]["content"][0]["text"])


def test_responses_agent_stream(url_models):
    _, model = url_models["responses_agent"]
    events, text, usage = [], "", None
    for event in model.predict_stream({"input": MESSAGES, "temperature": 0.0, "max_output_tokens": 12}):
        events.append(event)  # the documented loop: dispatch on the event type
        if event["type"] == "response.output_text.delta":
            text += event["delta"]
        elif event["type"] == "response.completed":
            usage = event["response"]["usage"]
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert text and len(done) == 1 and events[-1]["type"] == "response.completed"
    assert done[0]["item"]["content"][0]["text"] == text
    assert usage["output_tokens"] > 0  # usage arrives on the final event
    assert events[-1]["custom_outputs"]["finish_reason"] in ("stop", "length")
    trace = last_trace()
    assert trace.info.token_usage["output_tokens"] == usage["output_tokens"]


# ------------------------------------------------------------------------------------ batch
@pytest.mark.parametrize("flavor", ["chat_agent", "responses_agent"])
def test_batch_of_five_with_schema(url_models, flavor):
    import pandas as pd

    from model_code import batch_predict

    _, model = url_models[flavor]
    prompts = pd.DataFrame(
        {"prompt": [f"Document {i}: Databricks has feature {i}." for i in range(5)], "key": range(5)}
    )
    out = batch_predict(
        model,
        prompts,
        system_prompt="Grade the relevance of the document. Reply with JSON.",
        json_schema=GRADE_SCHEMA,
        params={"temperature": 0.0, "max_tokens": 64},
        max_workers=5,
    )
    assert list(out["key"]) == list(range(5)) and list(out["prompt"]) == list(prompts["prompt"])  # input order
    assert out["error"].isna().all()
    for parsed in out["parsed"]:
        assert parsed["grade"] in ("yes", "no")
    # the same through the flavour instance, as a list: results in input order
    listed = python_model_of(model).batch(
        list(prompts["prompt"]), json_schema=GRADE_SCHEMA, params={"temperature": 0.0, "max_tokens": 64}
    )
    assert [r["prompt"] for r in listed] == list(prompts["prompt"])
    assert all(r["parsed"]["ok"] in (True, False) and r["error"] is None for r in listed)
    assert last_trace().info.token_usage["output_tokens"] > 0


def test_url_mode_started_no_engine(url_models, tiny_engine):
    assert set(engine_children()) <= {tiny_engine.pid}  # only the shared engine of the session
    for _, model in url_models.values():
        assert python_model_of(model).engine_process is None



def test_the_lean_client_and_the_openai_sdk_read_a_recorded_engine_stream_alike(url_models):
    """A stream of the real engine (text, finish and usage chunks), recorded byte for byte and replayed to
    both clients: the same chunks, chunk for chunk, and the same chunks of each flavour. (Two live requests do not
    compare: the engine groups tokens into chunks as its scheduling goes.)"""
    import httpx

    from model_code.flavors.chat_agent import stream_to_chat_agent
    from model_code.flavors.chat_model import stream_to_chat_model
    from model_code.flavors.responses_agent import stream_to_responses
    from model_code.guard import engine_body
    from tests.model_code.test_lean_client import _dump, _replaying

    client = python_model_of(url_models["chat_agent"][1]).client
    messages = [{"role": "user", "content": "Count from one to ten."}]
    body = engine_body(messages, client.request({"max_tokens": 16, "temperature": 0.0}, messages, stream=True), stream=True)
    recorded = httpx.post(client.base_url + "/chat/completions", json=body, timeout=120).content
    assert recorded.count(b"data: {") >= 3 and b'"usage":{' in recorded.replace(b" ", b"")

    replay = _replaying(recorded)
    old = [chunk.model_dump(exclude_unset=True) for chunk in replay.stream(MESSAGES_OF_REPLAY)]
    new = list(replay.stream_json(MESSAGES_OF_REPLAY))
    assert new == old and new[-1]["usage"]["completion_tokens"] == 16
    for convert in (stream_to_chat_agent, stream_to_chat_model, stream_to_responses):
        assert [_dump(c) for c in convert(iter(new))] == [_dump(c) for c in convert(iter(old))]


MESSAGES_OF_REPLAY = [{"role": "user", "content": "replayed"}]
