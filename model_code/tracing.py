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
Exporting the trace is MLflow's work, on its own background thread (or into the serving buffer).

The engine requests of a call carry the caller's W3C trace context, or a new one for a traced call
(:mod:`model_code.trace_context`); the span records its trace id to be joined with the gateway's.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import mlflow
from loguru import logger
from mlflow.entities import SpanEvent, SpanStatusCode
from mlflow.tracing.constant import SpanAttributeKey

from model_code.target import TracingMode
from model_code.trace_context import TraceLink, link_for, pull, sending

T = TypeVar("T")
Usage = Mapping[str, int]
FIRST_CHUNK_ATTRIBUTE = "sglang.time_to_first_chunk_ms"
_END = object()


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
        record_span(name, span_type, inputs, start, error=error, link=link)
        raise
    record_span(name, span_type, inputs, start, outputs=result, usage=usage_of(result), link=link)
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
        _record_stream(name, span_type, inputs, start, first, received, reduce, usage_of, link)
        raise
    except Exception as error:
        record_span(name, span_type, inputs, start, error=error, first_chunk_ns=first, link=link)
        raise
    _record_stream(name, span_type, inputs, start, first, received, reduce, usage_of, link)


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
) -> None:
    try:
        outputs, usage = reduce(received), usage_of(received)
    except Exception:  # tracing must never break a prediction
        logger.opt(exception=True).debug("could not reduce the stream for its trace")
        outputs, usage = None, None
    record_span(name, span_type, inputs, start, outputs=outputs, usage=usage, first_chunk_ns=first, link=link)


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
) -> None:
    """One finished span from ``start_ns`` to now, child of the caller's active span (if any), with the
    trace id its engine requests carried (``link``)."""
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
            span.end(status=SpanStatusCode.ERROR)
        else:
            span.end(outputs=outputs)
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
