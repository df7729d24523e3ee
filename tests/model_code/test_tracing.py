"""Traces recorded after the call (``model_code.tracing``), against a local sqlite tracking store: no engine.

The traced functions here are plain callables (the flavours' use of them is covered with the real
engine in ``test_flavors_url.py``): what is checked is the span each produces, and when, and the trace
context the calls' engine requests would carry (the gateway's spans joined to them: ``test_trace_join.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import mlflow
import pytest
from mlflow.entities import SpanType

from model_code import trace_context, tracing
from model_code.tracing import TracePolicy, traced_call, traced_stream

USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def _trace_count(experiment_id: str) -> int:
    mlflow.flush_trace_async_logging()
    return len(mlflow.search_traces(locations=[experiment_id], return_type="list"))


@pytest.fixture
def experiment(mlflow_store) -> str:
    name = f"tracing-{time.time_ns()}"  # its traces' artifacts under the store's root: by default they go to ./mlruns
    experiment_id = mlflow.create_experiment(name, artifact_location=str(mlflow_store / "artifacts" / name))
    mlflow.set_experiment(experiment_id=experiment_id)
    return experiment_id


def _last_trace():
    mlflow.flush_trace_async_logging()
    return mlflow.get_trace(mlflow.get_last_active_trace_id())


def test_a_call_is_one_span_with_its_real_start_usage_and_output(experiment):
    before = time.time_ns()

    def call() -> dict:
        time.sleep(0.05)
        return {"answer": "hi"}

    out = traced_call(TracePolicy(), "predict", SpanType.AGENT, {"question": "q"}, call, lambda _: USAGE)
    assert out == {"answer": "hi"}
    trace = _last_trace()
    [span] = trace.data.spans
    assert span.name == "predict" and span.inputs == {"question": "q"} and span.outputs == {"answer": "hi"}
    assert before <= span.start_time_ns and span.end_time_ns - span.start_time_ns >= 50_000_000
    assert trace.info.token_usage == {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5}


def test_an_error_is_traced_and_raised(experiment):
    def call() -> None:
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        traced_call(TracePolicy(), "predict", SpanType.AGENT, {}, call, lambda _: None)
    [span] = _last_trace().data.spans
    assert span.status.status_code == "ERROR" and "bad input" in str(span.events[0].attributes)


def test_a_stream_is_traced_after_its_last_chunk_and_not_before_its_first(experiment, monkeypatch):
    started: list[str] = []
    real = mlflow.start_span_no_context
    monkeypatch.setattr(mlflow, "start_span_no_context", lambda *a, **k: started.append("span") or real(*a, **k))

    def chunks():
        time.sleep(0.05)  # the first chunk takes 50 ms, the second 200 ms more
        yield {"text": "a"}
        time.sleep(0.2)
        yield {"text": "b", "usage": USAGE}

    stream = traced_stream(
        TracePolicy(), "predict_stream", SpanType.AGENT, {"q": 1}, chunks(), lambda cs: len(cs), lambda cs: USAGE
    )
    assert next(stream) == {"text": "a"} and started == []  # the caller has its first chunk: no tracing work yet
    assert list(stream) == [{"text": "b", "usage": USAGE}] and started == ["span"]
    trace = _last_trace()
    [span] = trace.data.spans
    assert span.outputs == 2 and trace.info.token_usage["total_tokens"] == 5
    first_ms, span_ms = span.attributes[tracing.FIRST_CHUNK_ATTRIBUTE], (span.end_time_ns - span.start_time_ns) / 1e6
    assert 50 <= first_ms <= span_ms - 200, (first_ms, span_ms)  # the first chunk's time, not the last one's


def test_a_stream_closed_early_keeps_what_the_caller_got(experiment):
    stream = traced_stream(
        TracePolicy(), "predict_stream", SpanType.AGENT, {}, iter(range(10)), lambda cs: list(cs), lambda cs: None
    )
    assert next(stream) == 0
    stream.close()
    [span] = _last_trace().data.spans
    assert span.outputs == [0]


def test_off_and_sampled(experiment, monkeypatch):
    count = _trace_count(experiment)
    traced_call(TracePolicy("off"), "predict", SpanType.AGENT, {}, lambda: 1, lambda _: None)
    assert list(traced_stream(TracePolicy("off"), "s", SpanType.AGENT, {}, iter([1, 2]), list, lambda _: None)) == [
        1,
        2,
    ]
    assert _trace_count(experiment) == count

    draws = iter([0.05, 0.5, 0.09, 0.99])  # a ratio of 0.1 traces the draws below it
    monkeypatch.setattr(tracing.random, "random", lambda: next(draws))
    sampled = TracePolicy("sampled", 0.1)
    for _ in range(4):
        traced_call(sampled, "predict", SpanType.AGENT, {}, lambda: 1, lambda _: None)
    assert _trace_count(experiment) == count + 2


def _traceparent(headers: dict[str, str] | None) -> tuple[str, str, str]:
    assert headers is not None, "the call sent no trace context"
    version, trace_id, span_id, flags = headers["traceparent"].split("-")
    assert version == "00" and len(trace_id) == 32 and len(span_id) == 16
    return trace_id, span_id, flags


def test_engine_requests_carry_the_callers_mlflow_span_and_the_span_records_it(experiment):
    with mlflow.start_span("notebook cell") as cell:
        sent = traced_call(TracePolicy(), "predict", SpanType.AGENT, {}, trace_context.outgoing_headers, lambda _: None)
        otel = cell._span.get_span_context()
    trace_id, span_id, flags = _traceparent(sent)
    assert (trace_id, span_id, flags) == (format(otel.trace_id, "032x"), format(otel.span_id, "016x"), "01")
    assert trace_context.outgoing_headers() is None  # set around the call only
    predict = next(span for span in _last_trace().data.spans if span.name == "predict")
    assert predict.attributes[trace_context.TRACE_ID_ATTRIBUTE] == trace_id
    assert predict.attributes[trace_context.PARENT_SPAN_ATTRIBUTE] == span_id


def test_a_traced_call_without_a_caller_starts_a_trace_and_an_untraced_one_sends_nothing(experiment):
    def pulled() -> Iterator[dict[str, str] | None]:  # what an engine stream sends: read when first pulled
        yield trace_context.outgoing_headers()
        yield trace_context.outgoing_headers()

    first, second = traced_stream(TracePolicy(), "predict_stream", SpanType.AGENT, {}, pulled(), len, lambda _: None)
    assert first == second and trace_context.outgoing_headers() is None  # not left set in the caller between chunks
    trace_id, span_id, flags = _traceparent(first)
    assert flags == "01"
    [span] = _last_trace().data.spans
    assert span.attributes[trace_context.TRACE_ID_ATTRIBUTE] == trace_id
    assert span.attributes[trace_context.PARENT_SPAN_ATTRIBUTE] == span_id
    again = traced_call(TracePolicy(), "predict", SpanType.AGENT, {}, trace_context.outgoing_headers, lambda _: None)
    assert _traceparent(again)[0] != trace_id  # each call its own trace

    off = traced_call(TracePolicy("off"), "predict", SpanType.AGENT, {}, trace_context.outgoing_headers, lambda _: None)
    assert off is None


def test_an_opentelemetry_callers_context_is_continued_when_mlflow_has_none(experiment):
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("app")
    with tracer.start_as_current_span("app request") as app_span:
        context = app_span.get_span_context()
        sent = traced_call(TracePolicy("off"), "predict", SpanType.AGENT, {}, trace_context.outgoing_headers, lambda _: None)
    assert _traceparent(sent) == (format(context.trace_id, "032x"), format(context.span_id, "016x"), "01")


def test_where_mlflow_writes_the_store_synchronously_the_trace_is_written_after_the_answer_off_the_callers_thread(
    experiment, monkeypatch
):
    """A Databricks notebook's MLflow writes a finished trace on the thread that ends it (its async logging is off
    there by default; MLFLOW_ENABLE_ASYNC_TRACE_LOGGING=false does the same anywhere): the wrapper's own thread
    writes it instead, after the answer, and a failure there never reaches the call."""
    monkeypatch.setenv("MLFLOW_ENABLE_ASYNC_TRACE_LOGGING", "false")
    release = threading.Event()
    reduced_on: list[str] = []

    def reduce(chunks):
        release.wait(10)  # held until the caller has its answer
        reduced_on.append(threading.current_thread().name)
        return "".join(chunks)

    chunks = list(traced_stream(TracePolicy(), "predict_stream", SpanType.AGENT, {"q": 1}, iter("ab"), reduce, lambda cs: USAGE))
    assert chunks == ["a", "b"] and reduced_on == []  # the caller is done: its trace is not written yet
    release.set()
    assert tracing.flush_traces(10)
    assert reduced_on == ["sglang-trace-recorder"]
    [trace] = mlflow.search_traces(locations=[experiment], return_type="list")  # read back from the store
    [span] = trace.data.spans
    assert span.name == "predict_stream" and span.outputs == "ab" and trace.info.token_usage["total_tokens"] == 5

    def broken(chunks):
        raise RuntimeError("the store is down")

    assert list(traced_stream(TracePolicy(), "s", SpanType.AGENT, {}, iter("c"), broken, lambda cs: None)) == ["c"]
    assert traced_call(TracePolicy(), "p", SpanType.AGENT, {}, lambda: 7, lambda out: 1 / 0) == 7
    assert tracing.flush_traces(10) and _trace_count(experiment) == 3  # written without outputs or usage


def test_the_background_recorder_is_bounded():
    recorder = tracing.BackgroundRecorder(size=1)
    release = threading.Event()
    ran: list[int] = []
    recorder.submit(lambda: release.wait(10) and ran.append(1))
    while recorder._queue.qsize():  # the worker has taken the first job: one place left
        time.sleep(0.001)
    recorder.submit(lambda: ran.append(2))
    recorder.submit(lambda: ran.append(3))  # full: dropped, not raised
    assert not recorder.flush(0.05)
    release.set()
    assert recorder.flush(10) and ran == [1, 2]
