"""Parameter mapping, error mapping, chunk conversion, config handling and the pinned GPU stack: no engine.

Engine chunks with tool calls cannot be produced on demand by the tiny random model, so the tool-call
conversions are fed with hand-built ``openai`` chunk objects (named fakes).
"""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from launch.config import ConfigError
from launch.gpu_profiles import DEFAULT_PROFILE, known_profiles
from model_code import errors, gpu_stack_lines, pip_requirements
from model_code.flavors.chat_agent import completion_to_chat_agent, stream_to_chat_agent
from model_code.flavors.chat_model import chat_model_params, completion_to_chat_model, stream_to_chat_model
from model_code.flavors.responses_agent import completion_to_responses, responses_params, stream_to_responses
from model_code.flavors.table import FLAVORS, flavor_of
from model_code.params import build_request
from model_code.requirements import UnknownGpuProfile
from model_code.serving import normalize_request, wants_stream
from model_code.target import ModelCodeSettings, in_log_time, resolve_target, split_model_config

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


# ------------------------------------------------------------------------------------ params
def test_build_request_splits_openai_and_sglang_params():
    kwargs = build_request(
        {"temperature": 0.1, "max_tokens": 5, "top_k": 3, "stop": "x", "extra_body": {"regex": "a+"}}
    )
    assert kwargs == {"temperature": 0.1, "max_tokens": 5, "stop": ["x"], "extra_body": {"top_k": 3, "regex": "a+"}}


def test_build_request_defaults_and_none():
    assert build_request({"max_tokens": None, "temperature": 0.5}, {"max_tokens": 9}) == {
        "max_tokens": 9,
        "temperature": 0.5,
    }
    assert build_request(None) == {}


@pytest.mark.parametrize("schema", [SCHEMA, json.dumps(SCHEMA)])
def test_json_schema_becomes_response_format(schema):
    kwargs = build_request({"json_schema": schema})
    assert kwargs["response_format"]["type"] == "json_schema"
    assert kwargs["response_format"]["json_schema"]["schema"] == SCHEMA


def test_json_schema_from_pydantic_model():
    from typing import Literal

    from pydantic import BaseModel

    class Grade(BaseModel):
        grade: Literal["yes", "no"]

    fmt = build_request({"json_schema": Grade})["response_format"]
    assert fmt["json_schema"]["name"] == "Grade" and fmt["json_schema"]["schema"]["properties"]["grade"]["enum"] == [
        "yes",
        "no",
    ]


@pytest.mark.parametrize(
    "params, match",
    [
        ({"temprature": 1}, "unknown generation parameter"),
        ({"json_schema": "{not json"}, "not valid JSON"),
        ({"json_schema": SCHEMA, "response_format": {"type": "json_object"}}, "not both"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "schema"),
    ],
)
def test_bad_params_are_bad_requests(params, match):
    with pytest.raises(errors.BadRequestError, match=match):
        build_request(params)


def test_chat_model_params():
    from mlflow.types.llm import ChatParams

    params = ChatParams.from_dict(
        {"temperature": 0.2, "max_tokens": 7, "top_k": 4, "custom_inputs": {"json_schema": SCHEMA}}
    )
    mapped = chat_model_params(params)
    assert mapped == {"temperature": 0.2, "max_tokens": 7, "top_k": 4, "json_schema": SCHEMA}
    assert "n" not in mapped


def test_responses_params():
    from mlflow.types.responses import ResponsesAgentRequest

    request = ResponsesAgentRequest(
        input=[{"role": "user", "content": "hi"}],
        temperature=0.0,
        max_output_tokens=12,
        tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        tool_choice="auto",
        text={"format": {"type": "json_schema", "name": "x", "schema": SCHEMA, "strict": True}},
        custom_inputs={"top_k": 2},
    )
    mapped = responses_params(request)
    assert mapped["max_tokens"] == 12 and mapped["temperature"] == 0.0 and mapped["top_k"] == 2
    assert mapped["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert mapped["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
    }
    build_request(mapped)  # accepted by the request builder


# ------------------------------------------------------------------------------------ errors
def _status_error(status: int, message: str) -> openai.APIStatusError:
    request = httpx.Request("POST", "http://engine/v1/chat/completions")
    response = httpx.Response(status, request=request, json={"error": {"message": message}})
    return openai.APIStatusError(message, response=response, body={"error": {"message": message}})


@pytest.mark.parametrize(
    "status, message, cls, http",
    [
        (400, "bad", errors.BadRequestError, 400),
        (400, "Requested token count exceeds the model's maximum context length", errors.ContextLengthError, 400),
        (401, "no", errors.AuthenticationError, 401),
        (404, "no model", errors.ModelNotFoundError, 404),
        (429, "slow down", errors.OverloadedError, 503),
        (503, "busy", errors.OverloadedError, 503),
        (500, "boom", errors.EngineInternalError, 500),
    ],
)
def test_status_mapping(status, message, cls, http):
    error = errors.from_openai_error(_status_error(status, message))
    assert type(error) is cls and error.engine_status == status and message in str(error)
    assert error.get_http_status_code() == http  # what mlflow models serve answers


def test_an_error_event_in_a_stream_is_typed_by_the_status_it_carries():
    """SGLang refuses some requests only once their stream has begun (a grammar it cannot build): an error event
    under HTTP 200, which the openai client raises as a bare APIError with the event as its body."""
    request = httpx.Request("POST", "http://engine/v1/chat/completions")
    event = {"message": "Failed to build the grammar", "type": "BadRequestError", "param": None, "code": 400}
    refused = errors.from_openai_error(openai.APIError("Failed to build the grammar", request, body=event))
    assert type(refused) is errors.BadRequestError and refused.engine_status == 400 and "build the grammar" in str(refused)
    failed = errors.from_openai_error(openai.APIError("boom", request, body={"message": "boom", "code": 500}))
    assert type(failed) is errors.EngineInternalError
    assert type(errors.from_openai_error(openai.APIError("odd", request, body=None))) is errors.EngineRequestError


def test_connection_errors():
    request = httpx.Request("POST", "http://engine/v1/chat/completions")
    assert isinstance(
        errors.from_openai_error(openai.APIConnectionError(request=request)), errors.EngineUnavailableError
    )
    assert isinstance(errors.from_openai_error(openai.APITimeoutError(request=request)), errors.EngineTimeoutError)


# ------------------------------------------------------------------------------------ conversions (fake engine chunks)
def _chunk(delta=None, finish=None, usage=None, choices=True, index=0):
    data = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "tiny", "choices": []}
    if choices:
        data["choices"] = [{"index": index, "delta": delta or {}, "finish_reason": finish}]
    if usage:
        data["usage"] = usage
    return ChatCompletionChunk.model_validate(data)


USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
TOOL_STREAM = [
    _chunk({"role": "assistant", "content": ""}),
    _chunk(
        {
            "tool_calls": [
                {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_", "arguments": '{"ci'}}
            ]
        }
    ),
    _chunk({"tool_calls": [{"index": 0, "function": {"name": "weather", "arguments": 'ty": "Tokyo"}'}}]}),
    _chunk({}, finish="tool_calls"),
    _chunk(choices=False, usage=USAGE),
]
TEXT_STREAM = [
    _chunk({"role": "assistant", "content": "Hel"}),
    _chunk({"content": "lo"}),
    _chunk({"content": ""}, finish="length"),
    _chunk(choices=False, usage=USAGE),
]
FULL_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'}}


def test_chat_agent_stream_text_and_tools():
    chunks = [c.model_dump(exclude_none=True) for c in stream_to_chat_agent(TEXT_STREAM)]
    assert "".join(c["delta"]["content"] for c in chunks) == "Hello"
    assert [c.get("finish_reason") for c in chunks if c.get("finish_reason")] == ["length"]
    assert chunks[-1]["usage"]["total_tokens"] == 5 and {c["delta"]["role"] for c in chunks} == {"assistant"}

    chunks = [c.model_dump(exclude_none=True) for c in stream_to_chat_agent(TOOL_STREAM)]
    final = next(c for c in chunks if c.get("finish_reason") == "tool_calls")
    assert final["delta"]["tool_calls"] == [FULL_CALL]


def test_chat_model_stream_tools():
    chunks = [c.to_dict() for c in stream_to_chat_model(TOOL_STREAM)]
    calls = [c["delta"]["tool_calls"] for chunk in chunks for c in chunk["choices"] if c["delta"].get("tool_calls")]
    assert calls == [[FULL_CALL]]
    assert chunks[-1]["usage"]["completion_tokens"] == 2


def test_responses_stream_tools_and_text():
    events = [e.model_dump(exclude_none=True) for e in stream_to_responses(TOOL_STREAM)]
    items = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert items == [
        {
            "type": "function_call",
            "id": "call_1",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Tokyo"}',
        }
    ]
    assert events[-1]["response"]["usage"]["total_tokens"] == 5

    events = [e.model_dump(exclude_none=True) for e in stream_to_responses(TEXT_STREAM)]
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == ["Hel", "lo"]
    assert events[-1]["response"]["status"] == "incomplete" and events[-1]["custom_outputs"] == {
        "finish_reason": "length"
    }


MULTI_STREAM = [  # n=2: both choices interleave, then one usage chunk
    _chunk({"role": "assistant", "content": "a"}, index=0),
    _chunk({"role": "assistant", "content": "b"}, index=1),
    _chunk({"content": ""}, finish="stop", index=0),
    _chunk({"content": "c"}, finish="length", index=1),
    _chunk(choices=False, usage=USAGE),
]


@pytest.mark.parametrize("stream", [TEXT_STREAM, TOOL_STREAM, MULTI_STREAM], ids=["text", "tools", "n=2"])
def test_chat_model_stream_every_chunk_has_a_content_delta(stream):
    chunks = [c.to_dict() for c in stream_to_chat_model(stream)]
    assert chunks and all(isinstance(chunk["choices"][0]["delta"]["content"], str) for chunk in chunks)
    assert chunks[-1]["usage"] == USAGE and not any("usage" in chunk for chunk in chunks[:-1])
    assert chunks[-1]["choices"][0]["finish_reason"]


@pytest.mark.parametrize("stream", [TEXT_STREAM, TOOL_STREAM], ids=["text", "tools"])
def test_chat_agent_stream_every_chunk_has_content(stream):
    chunks = [c.model_dump(exclude_none=True) for c in stream_to_chat_agent(stream)]
    assert chunks and all(isinstance(chunk["delta"]["content"], str) for chunk in chunks)
    assert chunks[-1]["finish_reason"] and chunks[-1]["usage"]["total_tokens"] == 5
    assert not any("usage" in chunk for chunk in chunks[:-1])


def test_usage_without_finish_chunk_still_has_a_choice():
    chunks = [c.to_dict() for c in stream_to_chat_model([_chunk({"content": "x"}), _chunk(choices=False, usage=USAGE)])]
    assert [chunk["choices"][0]["delta"]["content"] for chunk in chunks] == ["x", ""]
    assert chunks[-1]["usage"] == USAGE


def test_completions_with_tool_calls():
    completion = ChatCompletion.model_validate(
        {
            "id": "chatcmpl-2",
            "object": "chat.completion",
            "created": 1,
            "model": "tiny",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "tool_calls",
                    "message": {"role": "assistant", "content": None, "tool_calls": [FULL_CALL]},
                }
            ],
            "usage": USAGE,
        }
    )
    agent = completion_to_chat_agent(completion).model_dump(exclude_none=True)
    assert agent["messages"][0]["tool_calls"] == [FULL_CALL] and agent["finish_reason"] == "tool_calls"
    chat = completion_to_chat_model(completion).to_dict()
    assert chat["choices"][0]["message"]["tool_calls"] == [FULL_CALL]
    responses = completion_to_responses(completion).model_dump(exclude_none=True)
    assert responses["output"][0]["type"] == "function_call" and responses["usage"]["input_tokens"] == 3


# ------------------------------------------------------------------------------------ flavour modules
@pytest.mark.parametrize("flavor", list(FLAVORS))
def test_a_flavour_module_sets_the_model_only_when_mlflow_executes_it(flavor, monkeypatch):
    """The module is its own models-from-code file: MLflow's loader gets the model, a package import sets none."""
    import importlib.util

    import mlflow.models.model
    from mlflow.models.utils import _load_model_code_path

    spec = FLAVORS[flavor]
    monkeypatch.setattr(mlflow.models.model, "__mlflow_model__", None)
    as_package = importlib.util.spec_from_file_location(f"model_code.flavors._{flavor}_probe", spec.path)
    as_package.loader.exec_module(importlib.util.module_from_spec(as_package))
    assert mlflow.models.model.__mlflow_model__ is None

    model = _load_model_code_path(str(spec.path), None)
    assert isinstance(model, getattr(mlflow.pyfunc, spec.mlflow_class)) and model.client is None  # nothing started
    assert type(model).__module__.startswith("code_model_")
    assert flavor_of(model) == flavor


# ------------------------------------------------------------------------------------ config
def test_bare_engine_section_and_settings(tiny_model_dir):
    data, settings = split_model_config(
        {"model_path": str(tiny_model_dir), "device": "cpu", "mlflow": {"request_timeout_s": 5}}
    )
    assert list(data["models"]) == ["model"] and settings.request_timeout_s == 5
    target = resolve_target({"model_path": "/x", "device": "cpu", "port": 31000}, {"llm-model": str(tiny_model_dir)})
    assert target.engine.model_path == str(tiny_model_dir) and target.engine.port == 0  # free port at each load


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            {"engine_sharing": "per_host"},
            "model_config: mlflow: engine_sharing: Input should be 'shared' or 'per_process'",
        ),
        ({"tracing": "some"}, "model_config: mlflow: tracing: Input should be 'on', 'off' or 'sampled'"),
        ({"trace_sample_ratio": 0}, "model_config: mlflow: trace_sample_ratio: Input should be greater than 0"),
    ],
)
def test_sharing_and_tracing_settings_are_checked(settings, message):
    with pytest.raises(ConfigError) as error:
        split_model_config({"models": {"a": {"url": "http://h:1"}}, "mlflow": settings})
    assert str(error.value) == message
    _, defaults = split_model_config({"models": {"a": {"url": "http://h:1"}}})
    assert (defaults.engine_sharing, defaults.tracing, defaults.show_engine_log) == ("shared", "on", False)


def test_model_choice():
    config = {"models": {"a": {"url": "http://h:1"}, "b": {"url": "http://h:2", "aliases": ["default"]}}}
    assert resolve_target(config).name == "b"
    assert resolve_target({**config, "mlflow": {"model": "a"}}).url == "http://h:1"
    with pytest.raises(ConfigError, match="no model named"):
        resolve_target({**config, "mlflow": {"model": "c"}})
    with pytest.raises(ConfigError, match="unknown key"):
        resolve_target({**config, "mlflow": {"modle": "a"}})
    with pytest.raises(ConfigError):
        resolve_target({"models": {"a": {"engine": {"model_path": "/x", "tp_size": 0}}}})
    assert ModelCodeSettings().batch_concurrency == 8
    renamed = resolve_target({"models": {"a": {"url": "http://h:1", "served_model_name": "up", "api_key": "k"}}})
    assert (renamed.served_name, renamed.api_key) == ("up", "k")
    engine = resolve_target({"models": {"a": {"engine": {"model_path": "/x", "served_model_name": "e"}}}})
    assert engine.served_name == "e"


def test_log_time_switch(monkeypatch):
    assert not in_log_time()
    monkeypatch.setenv("SGLANG_GATEWAY_MLFLOW_NO_ENGINE", "1")
    assert in_log_time()


# ------------------------------------------------------------------------------------ serving bodies
def test_serving_bodies():
    body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
    assert wants_stream(body) and normalize_request(body) == {"messages": body["messages"]}
    assert normalize_request({"inputs": {"input": [1]}, "params": {"temperature": 0}}) == {
        "input": [1],
        "temperature": 0,
    }
    assert normalize_request({"dataframe_records": [{"messages": []}]}) == {"messages": []}
    assert wants_stream({"inputs": {"stream": True}}) and not wants_stream({"messages": []})


# ------------------------------------------------------------------------------------ pinned GPU stack
def test_gpu_target_pins_the_whole_profile():
    lines = pip_requirements("auto", python=DEFAULT_PROFILE.pythons[0])
    for line in DEFAULT_PROFILE.requirements():  # torch, sglang-kernel, sglang, FlashInfer wheel URLs
        assert line in lines
    assert any(line.startswith("mlflow==") for line in lines)
    assert "openai" in lines and not any(line.startswith("openai==") for line in lines)  # SGLang's pin decides
    assert not any(line.startswith("-") for line in lines)  # no extra index: the rest comes from the registry
    assert pip_requirements("auto", cuda=DEFAULT_PROFILE.cuda, python=DEFAULT_PROFILE.pythons[0]) == lines
    assert pip_requirements("auto", profile=DEFAULT_PROFILE.name, python=DEFAULT_PROFILE.pythons[0]) == lines


def test_cpu_target_pins_sglang_alone():
    lines = pip_requirements("auto", python=DEFAULT_PROFILE.pythons[0], gpu=False)
    assert f"sglang=={DEFAULT_PROFILE.sglang}" in lines
    assert not any(name in line for line in lines for name in ("torch", "sglang-kernel", "flashinfer"))


def test_flashinfer_override_and_none():
    assert gpu_stack_lines(DEFAULT_PROFILE, None) == DEFAULT_PROFILE.pins()
    assert gpu_stack_lines(DEFAULT_PROFILE, "https://example.org/x.whl") == [
        *DEFAULT_PROFILE.pins(),
        "https://example.org/x.whl",
    ]
    with pytest.raises(ValueError, match="direct wheel URLs"):
        gpu_stack_lines(DEFAULT_PROFILE, "flashinfer-python==0.7.2")


@pytest.mark.parametrize("kwargs", [{"cuda": "12.4"}, {"cuda": "11.8"}, {"profile": "cu128"}, {"python": "3.13"}, {"driver": "11.8"}, {"profile": "sglang-0.5.23-cu130", "driver": "12.4"}])
@pytest.mark.parametrize("gpu", [True, False])
def test_impossible_targets_are_refused_listing_the_profiles(kwargs, gpu):
    with pytest.raises(UnknownGpuProfile, match=f"Profiles: {re.escape(known_profiles())}$"):
        pip_requirements("auto", gpu=gpu, **{"python": DEFAULT_PROFILE.pythons[0], **kwargs})
