"""One trace from the client to the engine: ``sglang-gateway serve`` with ``gateway.tracing.engines`` starts its
real CPU engine with SGLang's own tracing on, pointed at the same OTLP receiver (:mod:`tests.otlp`); the
engine's spans hang under the gateway's upstream attempt, in the client's trace."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import openai
import pytest
import yaml

from tests.otlp import otlp_receiver
from tests.servers import CLI, server_process

SERVER, CLIENT = 2, 3


@pytest.mark.usefixtures("starts_engine")
def test_the_engines_spans_hang_under_the_gateways_in_the_clients_trace(tiny_model_dir: Path, tmp_path: Path) -> None:
    client_trace, client_span = secrets.token_hex(16), secrets.token_hex(8)
    with otlp_receiver() as otlp:
        config = tmp_path / "traced.yaml"
        engine = {"model_path": str(tiny_model_dir), "device": "cpu", "dtype": "float32", "max_total_tokens": 2048, "skip_server_warmup": True}
        tracing = {"enabled": True, "endpoint": otlp.endpoint, "engines": True, "service_name": "edge-gateway"}
        config.write_text(yaml.safe_dump({"models": {"tiny": {"engine": engine}}, "gateway": {"tracing": tracing}}))
        env = {**os.environ, "SGLANG_OTLP_EXPORTER_SCHEDULE_DELAY_MILLIS": "200"}  # the engine exports within 0.2 s
        with server_process([*CLI, "serve", str(config), "--port", "{port}"], log_path=tmp_path / "serve.log", env=env, ready_path="/ready") as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            answer = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=4, temperature=0,
                extra_headers={"traceparent": f"00-{client_trace}-{client_span}-01"},
            )  # fmt: skip
            otlp.wait_for(
                lambda spans: any(span.trace_id == client_trace and span.service == "sglang-tiny" for span in spans), 60, "the engine's spans"
            )
        spans = otlp.of_trace(client_trace)  # the gateway exported its own when it stopped
    gateway = [span for span in spans if span.service == "edge-gateway"]
    engine = [span for span in spans if span.service == "sglang-tiny"]
    server = next(span for span in gateway if span.kind == SERVER)
    attempt = next(span for span in gateway if span.kind == CLIENT)
    assert server.parent_id == client_span and attempt.parent_id == server.span_id
    assert server.attributes["gen_ai.usage.output_tokens"] == answer.usage.completion_tokens
    # the engine's request span continues the attempt's context; its other spans hang under that one
    roots = [span for span in engine if span.parent_id == attempt.span_id]
    assert roots, [(span.name, span.parent_id) for span in engine]
    assert attempt.start_ns <= roots[0].start_ns, "the engine's request began after the gateway sent it"
