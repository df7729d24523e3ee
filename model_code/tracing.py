"""One MLflow trace per ``predict`` / ``predict_stream``, recorded after the call instead of around it.

``@mlflow.trace`` costs the caller more than it must: it binds and serialises the arguments before the
call and, on a generator, serialises every chunk into a span event before handing it over (even with
tracing disabled). Here the call runs untouched; the span is created once the answer is complete,
with the call's real start time (``start_time_ns``), its inputs, the reduced output, the token usage
and, for streams, the time to the first chunk. Nothing is added before the first chunk of a stream.
The span's parent is the caller's active span, so a model called inside a traced function still
nests; within Databricks Model Serving the trace is complete before ``predict`` returns, as the
serving layer expects.

``mode``: ``on`` (default), ``off``, or ``sampled`` (a random share ``sample_ratio`` of the calls).
Exporting the trace is MLflow's work, on its own background thread (or into the serving buffer). Where MLflow
exports synchronously (a Databricks notebook, where its async logging is off unless
``MLFLOW_ENABLE_ASYNC_TRACE_LOGGING`` is set; or that variable set false), a trace of its own (no caller's span)
is built and written by :data:`RECORDER`'s thread instead, after the answer: bounded, and its failures logged.

The engine requests of a call carry the caller's W3C trace context, or a new one for a traced call
(:mod:`model_code.trace_context`); the span records its trace id to be joined with the gateway's.
"""

from __future__ import annotations

import atexit
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import cache, partial
from typing import Any, TypeVar

import mlflow
from loguru import logger
from mlflow.entities import SpanEvent, SpanStatusCode
from mlflow.environment_variables import MLFLOW_ENABLE_ASYNC_TRACE_LOGGING
from mlflow.tracing.constant import SpanAttributeKey

from model_code.target import TracingMode
from model_code.trace_context import TraceLink, link_for, pull, sending

T = TypeVar("T")
Usage = Mapping[str, int]
FIRST_CHUNK_ATTRIBUTE = "sglang.time_to_first_chunk_ms"
_END = object()


class BackgroundRecorder:
    """One thread that records finished calls' traces, so a store written synchronously is not written on the
    caller's thread. Bounded: a full queue drops the trace (logged), and a failure never reaches a call."""

    def __init__(self, size: int = 1000) -> None:
        self._queue: queue.Queue[Callable[[], None]] = queue.Queue(maxsize=size)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="sglang-trace-recorder", daemon=True)
                self._thread.start()
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            logger.warning("the trace queue is full ({} traces): a trace was dropped", self._queue.maxsize)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every submitted trace is recorded (at most ``timeout_s``); whether they all were."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                job()
            except Exception:  # tracing must never break a prediction
                logger.opt(exception=True).debug("could not record a trace")
            finally:
                self._queue.task_done()


RECORDER = BackgroundRecorder()
atexit.register(RECORDER.flush, 10.0)


def flush_traces(timeout_s: float = 30.0) -> bool:
    """Wait for the traces recorded in the background (see the module docstring), then for MLflow's own queue."""
    done = RECORDER.flush(timeout_s)
    mlflow.flush_trace_async_logging()
    return done


def _mlflow_exports_synchronously() -> bool:
    """Whether MLflow writes a finished trace on the thread that ends it (its async logging off), outside Model
    Serving (whose in-memory buffer must hold the trace before ``predict`` returns)."""
    if os.environ.get("IS_IN_DB_MODEL_SERVING_ENV", "").lower() == "true":
        return False
    if MLFLOW_ENABLE_ASYNC_TRACE_LOGGING.is_set():
        return not MLFLOW_ENABLE_ASYNC_TRACE_LOGGING.get()
    return _in_databricks_notebook()  # MLflow keeps its async logging off there by default


@cache
def _in_databricks_notebook() -> bool:
    """MLflow's own test, once per process (it costs about a millisecond: it is asked at every traced call)."""
    try:
        from mlflow.utils.databricks_utils import is_in_databricks_notebook

        return bool(is_in_databricks_notebook())
    except Exception:
        return False


def _record(job: Callable[[], None]) -> None:
    """``job`` (one call's span) now, or on :data:`RECORDER`'s thread when MLflow would write it on this one and
    the span has no caller's span to nest under (a parent must still be open when its child ends)."""
    if _mlflow_exports_synchronously() and mlflow.get_current_active_span() is None:
        RECORDER.submit(job)
    else:
        job()


@dataclass(frozen=True)
class TracePolicy:
    """Whether a call is traced: ``on``, ``off`` or ``sampled`` at ``sample_ratio``."""

    mode: TracingMode = "on"
    sample_ratio: float = 1.0

    def sampled(self) -> bool:
        if self.mode == "on":
            return True
        if self.mode == "off":
            return False
        return random.random() < self.sample_ratio


def traced_call(
    policy: TracePolicy,
    name: str,
    span_type: str,
    inputs: dict[str, Any],
    call: Callable[[], T],
    usage_of: Callable[[T], Usage | None],
) -> T:
    """``call()``, plus one span for it when ``policy`` samples this call."""
    traced = policy.sampled()
    link = link_for(traced)
    if not traced:
        with sending(link):
            return call()
    start = time.time_ns()
    try:
        with sending(link):
            result = call()
    except Exception as error:
        _record(partial(record_span, name, span_type, inputs, start, error=error, link=link))
        raise
    end = time.time_ns()
    _record(partial(_record_call, name, span_type, inputs, start, result, usage_of, link, end))
    return result


def traced_stream(
    policy: TracePolicy,
    name: str,
    span_type: str,
    inputs: dict[str, Any],
    chunks: Iterable[T],
    reduce: Callable[[list[T]], Any],
    usage_of: Callable[[list[T]], Usage | None],
) -> Iterator[T]:
    """The chunks as they come, plus one span for the whole stream (also when the caller stops early)."""
    traced = policy.sampled()
    link = link_for(traced)
    if not traced:
        yield from _sent_with(link, chunks)
        return
    start = time.time_ns()
    first: int | None = None
    received: list[T] = []
    try:
        for chunk in _sent_with(link, chunks):
            if first is None:
                first = time.time_ns()
            received.append(chunk)
            yield chunk
    except GeneratorExit:  # the caller closed the stream: record what it got
        end = time.time_ns()
        _record(partial(_record_stream, name, span_type, inputs, start, first, received, reduce, usage_of, link, end))
        raise
    except Exception as error:
        end = time.time_ns()
        _record(partial(record_span, name, span_type, inputs, start, error=error, first_chunk_ns=first, link=link, end_ns=end))
        raise
    end = time.time_ns()
    _record(partial(_record_stream, name, span_type, inputs, start, first, received, reduce, usage_of, link, end))


def _sent_with(link: TraceLink | None, chunks: Iterable[T]) -> Iterator[T]:
    """``chunks``, each pulled with ``link`` as the outgoing context: the engine request goes out in the first
    pull, and the context is not left set in the caller's between chunks."""
    iterator = iter(chunks)
    try:
        while True:
            chunk = pull(iterator, link, _END)
            if chunk is _END:
                return
            yield chunk  # type: ignore[misc]
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:  # a caller that stops early ends the engine stream now, not at garbage collection
            close()


def _record_stream(
    name: str,
    span_type: str,
    inputs: dict[str, Any],
    start: int,
    first: int | None,
    received: list[Any],
    reduce: Callable[[list[Any]], Any],
    usage_of: Callable[[list[Any]], Usage | None],
    link: TraceLink | None,
    end: int | None = None,
) -> None:
    try:
        outputs, usage = reduce(received), usage_of(received)
    except Exception:  # tracing must never break a prediction
        logger.opt(exception=True).debug("could not reduce the stream for its trace")
        outputs, usage = None, None
    record_span(name, span_type, inputs, start, outputs=outputs, usage=usage, first_chunk_ns=first, link=link, end_ns=end)


def _record_call(
    name: str, span_type: str, inputs: dict[str, Any], start: int, result: T,
    usage_of: Callable[[T], Usage | None], link: TraceLink | None, end: int,
) -> None:
    try:
        usage = usage_of(result)
    except Exception:  # tracing must never break a prediction
        logger.opt(exception=True).debug("could not read the usage for the trace")
        usage = None
    record_span(name, span_type, inputs, start, outputs=result, usage=usage, link=link, end_ns=end)


def record_span(
    name: str,
    span_type: str,
    inputs: dict[str, Any],
    start_ns: int,
    *,
    outputs: Any = None,
    usage: Usage | None = None,
    error: BaseException | None = None,
    first_chunk_ns: int | None = None,
    link: TraceLink | None = None,
    end_ns: int | None = None,
) -> None:
    """One finished span from ``start_ns`` to ``end_ns`` (default: now), child of the caller's active span (if
    any), with the trace id its engine requests carried (``link``)."""
    try:
        attributes: dict[str, Any] = link.attributes() if link is not None else {}
        if usage:
            attributes[SpanAttributeKey.CHAT_USAGE] = chat_usage(usage)
        if first_chunk_ns is not None:
            attributes[FIRST_CHUNK_ATTRIBUTE] = round((first_chunk_ns - start_ns) / 1e6, 3)
        span = mlflow.start_span_no_context(
            name,
            span_type=span_type,
            parent_span=mlflow.get_current_active_span(),
            inputs=inputs,
            attributes=attributes,
            start_time_ns=start_ns,
        )
        if error is not None:
            span.add_event(SpanEvent.from_exception(error))  # type: ignore[arg-type]
            span.end(status=SpanStatusCode.ERROR, end_time_ns=end_ns)
        else:
            span.end(outputs=outputs, end_time_ns=end_ns)
    except Exception:  # tracing must never break a prediction
        logger.opt(exception=True).debug("could not record the trace of {}", name)


def chat_usage(usage: Usage) -> dict[str, int]:
    """Token usage in MLflow's span format (what ``trace.info.token_usage`` reports)."""
    return {
        "input_tokens": usage.get("prompt_tokens", 0),
        "output_tokens": usage.get("completion_tokens", 0),
        "total_tokens": usage.get("total_tokens", 0),
    }


def record_usage(usage: Usage | None) -> None:
    """Put token usage on the active span (for code traced with ``@mlflow.trace``, e.g. ``batch_predict``)."""
    if not usage:
        return
    try:
        span = mlflow.get_current_active_span()
        if span is not None:
            span.set_attribute(SpanAttributeKey.CHAT_USAGE, chat_usage(usage))
    except Exception:  # tracing must never break a prediction
        logger.opt(exception=True).debug("could not record usage on the span")
