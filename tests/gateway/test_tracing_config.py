"""``gateway.tracing``: where the collector is (settings, then the standard ``OTEL_*`` variables), the engine keys
``engines: true`` gives every managed engine, and the errors a bad section gets."""

from __future__ import annotations

import pytest
import yaml

from gateway.config import gateway_settings
from launch.argv import build_env, server_args
from launch.config import ConfigError, parse_config
from launch.tracing import traces_endpoint
from tests.docs.readme_blocks import marked_blocks

ENGINE = {"model_path": "/m", "device": "cpu"}


@pytest.mark.parametrize(
    ("endpoint", "protocol", "environ", "expected"),
    [
        ("http://collector:4318", "http/protobuf", {}, "http://collector:4318/v1/traces"),
        ("http://collector:4318/", "http/protobuf", {}, "http://collector:4318/v1/traces"),
        ("https://otlp.example.com/api/traces", "http/protobuf", {}, "https://otlp.example.com/api/traces"),
        ("collector:4318", "http/protobuf", {}, "http://collector:4318/v1/traces"),
        (None, "http/protobuf", {}, "http://localhost:4318/v1/traces"),
        (None, "http/protobuf", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, "http://c:4318/v1/traces"),
        (None, "http/protobuf", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:1/x"}, "http://c:1/x"),
        ("http://collector:4317", "grpc", {}, "collector:4317"),
        ("collector:4317", "grpc", {}, "collector:4317"),
        (None, "grpc", {}, "localhost:4317"),
    ],
)
def test_the_traces_endpoint(endpoint: str | None, protocol: str, environ: dict[str, str], expected: str) -> None:
    assert traces_endpoint(endpoint, protocol, environ) == expected


def test_engines_true_gives_each_managed_engine_the_gateways_collector() -> None:
    tracing = {"enabled": True, "endpoint": "http://collector:4318", "engines": True}
    deployment = parse_config(
        {"models": {"a": {"engine": ENGINE}, "b": {"engine": {**ENGINE, "enable_trace": False}}, "c": {"url": "http://x:1"}}, "gateway": {"tracing": tracing}}
    )
    a = deployment.engine("a")
    assert (a.enable_trace, a.otlp_traces_endpoint, a.otlp_traces_protocol, a.otlp_service_name) == (
        True, "http://collector:4318/v1/traces", "http/protobuf", "sglang-a",
    )  # fmt: skip
    args = server_args(a, port=1)
    assert args[args.index("--otlp-traces-endpoint") + 1] == "http://collector:4318/v1/traces" and "--enable-trace" in args
    assert build_env(a, {}).variables["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"  # SGLang's default is grpc
    assert deployment.engine("b").enable_trace is False  # an engine that says so itself keeps its own keys
    off = parse_config({"models": {"a": {"engine": ENGINE}}, "gateway": {"tracing": {**tracing, "engines": False}}})
    assert off.engine("a").enable_trace is False and "--enable-trace" not in server_args(off.engine("a"), port=1)


@pytest.mark.parametrize(
    ("tracing", "message"),
    [
        ({"enabled": True, "protocol": "thrift"}, "gateway.tracing.protocol: Input should be 'http/protobuf' or 'grpc'"),
        ({"enabled": True, "sample_ratio": 2}, "gateway.tracing.sample_ratio: Input should be less than or equal to 1"),
        ({"enabled": True, "exporter": "x"}, "gateway.tracing.exporter: unknown key"),
    ],
)
def test_a_bad_tracing_section_names_its_key(tracing: dict[str, object], message: str) -> None:
    deployment = parse_config({"models": {"a": {"engine": ENGINE}}, "gateway": {"tracing": tracing}}, "t.yaml")
    with pytest.raises(ConfigError) as error:
        gateway_settings(deployment)
    assert str(error.value) == f"t.yaml: {message}"


def test_the_docs_example_turns_on_the_gateways_and_the_engines_tracing() -> None:
    (block,) = marked_blocks("tracing-config")
    deployment = parse_config(yaml.safe_load(block.code), "docs/tracing.md")
    tracing = gateway_settings(deployment).tracing
    assert tracing.enabled and tracing.engines and tracing.sample_ratio == 0.1
    engine = deployment.engine("llama")
    assert engine.enable_trace and engine.otlp_traces_endpoint == "http://otel-collector:4318/v1/traces"
