"""The W3C trace context the wrapper sends with its engine requests, so that the gateway's and the engine's
spans (``gateway.tracing``, the engines' ``enable_trace``) join the caller's trace.

The caller's context is MLflow's active span (MLflow keeps a context of its own, apart from
OpenTelemetry's global one), else OpenTelemetry's current span: the requests go out as its children, with
its sampling decision. A call the wrapper traces without either starts a trace of its own, and its MLflow
span records that trace's id (``sglang.trace_id``): the MLflow trace and the gateway/engine trace can be
joined on it. An untraced call without a caller sends nothing (the gateway samples on its own).

The context travels in a ContextVar set around the call (:func:`sending`) and read by
:class:`model_code.client.EngineClient` when it sends (:func:`outgoing_headers`).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TypeVar

import mlflow
from loguru import logger
from opentelemetry import trace

TRACE_ID_ATTRIBUTE = "sglang.trace_id"
PARENT_SPAN_ATTRIBUTE = "sglang.parent_span_id"
T = TypeVar("T")
_OUTGOING: ContextVar[dict[str, str] | None] = ContextVar("sglang_outgoing_trace", default=None)


@dataclass(frozen=True)
class TraceLink:
    """The trace a call's engine requests belong to and the span they hang under (lowercase hex ids)."""

    trace_id: str
    span_id: str
    sampled: bool
    state: str = ""

    def headers(self) -> dict[str, str]:
        headers = {"traceparent": f"00-{self.trace_id}-{self.span_id}-{'01' if self.sampled else '00'}"}
        if self.state:
            headers["tracestate"] = self.state
        return headers

    def attributes(self) -> dict[str, str]:
        """What the wrapper's MLflow span records to be joined with the gateway's and engine's spans."""
        return {TRACE_ID_ATTRIBUTE: self.trace_id, PARENT_SPAN_ATTRIBUTE: self.span_id}


def caller_link() -> TraceLink | None:
    """The caller's active span (MLflow's, else OpenTelemetry's), or None."""
    try:
        active = mlflow.get_current_active_span()
        span = active._span if active is not None else trace.get_current_span()  # the OTel span under MLflow's
        context = span.get_span_context()
    except Exception:  # tracing must never break a prediction
        logger.opt(exception=True).debug("could not read the caller's trace context")
        return None
    if not context.is_valid:
        return None
    return TraceLink(
        format(context.trace_id, "032x"),
        format(context.span_id, "016x"),
        context.trace_flags.sampled,
        context.trace_state.to_header(),
    )


def link_for(traced: bool) -> TraceLink | None:
    """The context a call sends: the caller's; else a new sampled trace when the wrapper traces the call."""
    link = caller_link()
    if link is None and traced:
        link = TraceLink(secrets.token_hex(16), secrets.token_hex(8), sampled=True)
    return link


@contextmanager
def sending(link: TraceLink | None) -> Iterator[None]:
    """Engine requests sent inside the block carry ``link``'s headers."""
    token = _OUTGOING.set(link.headers() if link is not None else None)
    try:
        yield
    finally:
        _OUTGOING.reset(token)


def pull(iterator: Iterator[T], link: TraceLink | None, end: object) -> T | object:
    """``next(iterator, end)`` with ``link``'s headers on the engine requests it sends: :func:`sending` without a
    context manager's cost (it runs once per streamed chunk)."""
    token = _OUTGOING.set(link.headers() if link is not None else None)
    try:
        return next(iterator, end)
    finally:
        _OUTGOING.reset(token)


def outgoing_headers() -> dict[str, str] | None:
    """The trace headers for an engine request sent now, or None."""
    return _OUTGOING.get()
