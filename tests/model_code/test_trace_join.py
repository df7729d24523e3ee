"""The MLflow wrapper's trace joined to the gateway's: a logged model (URL mode) in front of a gateway with
``gateway.tracing`` on, itself in front of the session's real CPU engine, and a real OTLP receiver
(:mod:`tests.otlp`) in the test process.

A ``predict`` inside a caller's MLflow span sends that span's context: the gateway's server span is its
child in the same trace id. A ``predict_stream`` without a caller starts a trace of its own, and its MLflow
span records the id (``sglang.trace_id``) under which the gateway's spans are found.
"""

from __future__ import annotations

from pathlib import Path

import mlflow

from launch.process import EngineProcess
from model_code import close_model, log_model
from model_code.trace_context import PARENT_SPAN_ATTRIBUTE, TRACE_ID_ATTRIBUTE
from tests.gateway_server import KEY, serve
from tests.otlp import Span, otlp_receiver

SERVER = 2
HELLO = [{"role": "user", "content": "Say something."}]
GREEDY = 0.0  # the tiny model's random weights sample an empty answer now and then; its greedy one is not empty


def _server_span(spans: list[Span]) -> Span:
    [server] = [span for span in spans if span.kind == SERVER and span.service == "sglang-gateway"]
    return server


def _wrapper_span(trace_id: str, name: str) -> mlflow.entities.Span:
    mlflow.flush_trace_async_logging()
    return next(span for span in mlflow.get_trace(trace_id).data.spans if span.name == name)


def test_the_wrappers_requests_join_the_callers_trace_and_its_span_records_the_id(
    tiny_engine: EngineProcess, mlflow_store: Path
) -> None:
    gateway = {"keys": [{"name": "notebook", "key": KEY}], "tracing": {"enabled": True}}
    with otlp_receiver() as otlp:
        gateway["tracing"]["endpoint"] = otlp.endpoint  # type: ignore[index]
        with serve({"tiny": {"url": tiny_engine.url}}, gateway) as gw:
            config = {"models": {"tiny": {"url": gw.url, "api_key": KEY}}, "mlflow": {"defaults": {"max_tokens": 4}}}
            with mlflow.start_run():
                info = log_model(config, flavor="chat_model", flashinfer=None)
            model = mlflow.pyfunc.load_model(info.model_uri)
            try:
                with mlflow.start_span("notebook cell") as cell:
                    answer = model.predict({"messages": HELLO, "temperature": GREEDY})
                    cell_context = cell._span.get_span_context()
                chunks = list(model.predict_stream({"messages": HELLO, "temperature": GREEDY}))
                stream_trace_id = mlflow.get_last_active_trace_id()
            finally:
                close_model(model)
        cell_trace, cell_span = format(cell_context.trace_id, "032x"), format(cell_context.span_id, "016x")
        called = _server_span(otlp.of_trace(cell_trace))
        streamed = _wrapper_span(stream_trace_id, "SGLangChatModel.predict_stream")
        stream_spans = otlp.of_trace(streamed.attributes[TRACE_ID_ATTRIBUTE])

    assert answer["choices"][0]["message"]["content"] and chunks
    # predict in the caller's span: the gateway's server span is that span's child, in its trace
    assert called.parent_id == cell_span and called.attributes["gateway.key_name"] == "notebook"
    assert called.attributes["gateway.stream"] is False
    predict = _wrapper_span(cell.trace_id, "SGLangChatModel.predict")
    assert predict.attributes[TRACE_ID_ATTRIBUTE] == cell_trace and predict.parent_id == cell.span_id

    # predict_stream on its own: a new trace, found from the id its MLflow span records
    streamed_server = _server_span(stream_spans)
    assert streamed.attributes[TRACE_ID_ATTRIBUTE] != cell_trace
    assert streamed_server.parent_id == streamed.attributes[PARENT_SPAN_ATTRIBUTE]
    assert streamed_server.attributes["gateway.stream"] is True
    assert 0 < streamed_server.attributes["gen_ai.usage.output_tokens"] <= 4  # the wrapper asks for the usage
