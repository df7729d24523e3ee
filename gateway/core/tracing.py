"""OpenTelemetry spans of each request, built once it is over from what it noted on the way.

The hot path only notes a few clock readings in the request's :class:`~gateway.core.context.RequestTrace` (the wait for a slot, each
upstream attempt's start, first and last byte); the spans (the server span, its queue wait, one client span per
upstream attempt, with the OpenTelemetry GenAI attributes) are built after the request ended and handed to the
SDK's batch processor, which exports them over OTLP from its own thread. With tracing off, ``info.trace`` is None
and none of this runs.

Context propagation is W3C trace context: a client's ``traceparent`` is continued (its sampling decision too),
and each upstream attempt sends its own span's context to the engine, whose spans (SGLang ``--enable-trace``)
then hang under it.
"""

from __future__ import annotations

import os
import re
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import trace as trace_api
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.config import TracingSettings
from gateway.core.call import NO_NOTES, TraceNotes
from gateway.core.context import Attempt, RequestInfo, RequestTrace
from gateway.core.endpoints import CHAT_COMPLETIONS, MESSAGES, route_label
from launch.config import ConfigError
from launch.tracing import resolved_protocol, traces_endpoint

DEFAULT_SERVICE_NAME = "sglang-gateway"
CANCELLED = "client disconnected"  # RequestInfo.error of a request whose client went away

# gen_ai.operation.name by route (OpenTelemetry GenAI semantic conventions); other routes are plain HTTP spans.
OPERATIONS = {
    CHAT_COMPLETIONS: "chat",
    MESSAGES: "chat",
    "/v1/responses": "chat",
    "/invocations": "chat",
    "/v1/completions": "text_completion",
    "/generate": "text_completion",
    "/v1/embeddings": "embeddings",
}
# Request fields recorded as gen_ai.request.* attributes (the first of each tuple that the body has).
REQUEST_PARAMS: dict[str, tuple[str, ...]] = {
    "gen_ai.request.max_tokens": ("max_tokens", "max_completion_tokens", "max_output_tokens"),
    "gen_ai.request.temperature": ("temperature",),
    "gen_ai.request.top_p": ("top_p",),
    "gen_ai.request.top_k": ("top_k",),
    "gen_ai.request.seed": ("seed",),
    "gen_ai.request.frequency_penalty": ("frequency_penalty",),
    "gen_ai.request.presence_penalty": ("presence_penalty",),
}


class Tracing:
    """The gateway's tracer: decides sampling at a request's start, exports its spans at its end."""

    def __init__(self, settings: TracingSettings, exporter: SpanExporter | None = None) -> None:
        ratio = settings.sample_ratio
        if ratio is None:
            ratio = _env_ratio()
        self.sampler = ParentBased(TraceIdRatioBased(ratio))
        name = settings.service_name or os.environ.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME
        self.resource = Resource.create({SERVICE_NAME: name})  # plus OTEL_RESOURCE_ATTRIBUTES
        self.scope = InstrumentationScope("sglang-gateway", _version())
        self.processor = BatchSpanProcessor(exporter if exporter is not None else otlp_exporter(settings))
        self.ids = RandomIdGenerator()
        self.propagator = TraceContextTextMapPropagator()

    # ------------------------------------------------------------------ on the request's way
    def begin(self, traceparent: str | None, tracestate: str | None, started: float) -> RequestTrace:
        """The request's trace: a client's context continued, else a new trace sampled at the configured ratio."""
        context = None
        parent: SpanContext | None = None
        if traceparent:
            carrier = {"traceparent": traceparent, **({"tracestate": tracestate} if tracestate else {})}
            context = self.propagator.extract(carrier)
            found = trace_api.get_current_span(context).get_span_context()
            parent = found if found.is_valid else None
        trace_id = parent.trace_id if parent is not None else self.ids.generate_trace_id()
        sampled = self.sampler.should_sample(
            context if parent is not None else None, trace_id, "request"
        ).decision.is_sampled()
        state = tracestate if parent is not None else None
        now = time.time_ns() - int((time.perf_counter() - started) * 1e9)
        return RequestTrace(trace_id, self.ids.generate_span_id(), parent, sampled, state, now, started)

    def notes(self, trace: RequestTrace | None) -> TraceNotes:
        """The hook a request's stages note their moments in: into ``trace``, or nowhere when it has none."""
        return NO_NOTES if trace is None else _TracedNotes(self, trace)

    def attempt(self, trace: RequestTrace, model: str, url: str, replica: int | None) -> dict[str, str]:
        """Note an upstream attempt starting now; the headers that give the engine its span's context."""
        span_id = self.ids.generate_span_id()
        trace.attempts.append(Attempt(span_id, model, url, replica, time.perf_counter()))
        headers = {"traceparent": f"00-{trace.trace_id:032x}-{span_id:016x}-{'01' if trace.sampled else '00'}"}
        if trace.tracestate:
            headers["tracestate"] = trace.tracestate
        return headers

    # ------------------------------------------------------------------ once it is over
    def finish(self, info: RequestInfo, ended: float) -> None:
        """Build the request's spans and queue them for export (nothing when it was not sampled)."""
        trace = info.trace
        if trace is None or not trace.sampled:
            return
        for span in request_spans(info, trace, ended, self.resource, self.scope, self.ids):
            self.processor.on_end(span)

    def shutdown(self) -> None:
        """Export what is queued (bounded by the processor's own timeout), then stop its thread."""
        self.processor.shutdown()


class _TracedNotes(TraceNotes):
    """The stages' moments, noted in one request's :class:`RequestTrace` (its spans are built from it at the end)."""

    __slots__ = ("tracing", "trace")

    def __init__(self, tracing: Tracing, trace: RequestTrace) -> None:
        self.tracing, self.trace = tracing, trace

    def request(self, body: dict[str, Any]) -> None:
        self.trace.params = request_params(body)

    def queued(self, since: float) -> None:
        self.trace.queued = (since, time.perf_counter())

    def attempt(self, model: str, url: str, replica: int | None) -> dict[str, str]:
        return self.tracing.attempt(self.trace, model, url, replica)

    def attempt_failed(self, error: BaseException) -> None:
        if self.trace.attempts:
            self.trace.attempts[-1].ended, self.trace.attempts[-1].error = time.perf_counter(), type(error).__name__

    def answered(self, content: bytes | None, streamed: bool) -> None:
        if self.trace.attempts:
            attempt = self.trace.attempts[-1]
            attempt.first_byte = time.perf_counter()  # a plain answer's head comes with its body; a stream's at once
            if not streamed:
                attempt.ended = attempt.first_byte
                self.trace.finish_reasons = finish_reasons(content or b"")


def request_spans(
    info: RequestInfo,
    trace: RequestTrace,
    ended: float,
    resource: Resource,
    scope: InstrumentationScope,
    ids: IdGenerator,
) -> list[ReadableSpan]:
    """The server span, its queue wait and one client span per upstream attempt."""
    flags = TraceFlags(TraceFlags.SAMPLED)
    state = TraceState.from_header([trace.tracestate]) if trace.tracestate else None
    server = SpanContext(trace.trace_id, trace.span_id, False, flags, state)
    route = route_label(info.path)
    operation = OPERATIONS.get(route)
    attributes = _server_attributes(info, trace, route, operation)
    events: list[Event] = []
    span_status = Status(StatusCode.UNSET)
    status = info.status or 0
    if info.error == CANCELLED or status == 499:
        attributes["error.type"] = "cancelled"
        attributes["gateway.cancelled"] = True
        events.append(Event("cancelled", {"reason": CANCELLED}, trace.ns(ended)))
        span_status = Status(StatusCode.ERROR, CANCELLED)
    elif status >= 400 or info.error is not None:
        attributes["error.type"] = info.error_code or str(status)
        if status >= 500 or status == 200:  # a 4xx is the client's; a stream that failed after its 200 is ours
            span_status = Status(StatusCode.ERROR, (info.error or "")[:300])
    spans = [
        ReadableSpan(
            f"{info.method} {route}", server, trace.parent, resource, attributes, events, kind=SpanKind.SERVER,
            status=span_status, start_time=trace.wall_ns, end_time=trace.ns(ended), instrumentation_scope=scope,
        )
    ]  # fmt: skip
    if trace.queued is not None:
        start, end = trace.queued
        queue = SpanContext(trace.trace_id, ids.generate_span_id(), False, flags, state)
        spans.append(
            ReadableSpan(
                "gateway.queue", queue, server, resource, {"gen_ai.request.model": info.model or ""}, (),
                kind=SpanKind.INTERNAL, start_time=trace.ns(start), end_time=trace.ns(end), instrumentation_scope=scope,
            )
        )  # fmt: skip
    for index, attempt in enumerate(trace.attempts):
        spans.append(_attempt_span(attempt, index, info, trace, server, ended, operation, resource, scope, flags, state))
    return spans


def _server_attributes(info: RequestInfo, trace: RequestTrace, route: str, operation: str | None) -> dict[str, Any]:
    """The server span's attributes: HTTP's, then the GenAI ones the request has (its model, usage, parameters)."""
    attributes: dict[str, Any] = {
        "http.request.method": info.method,
        "http.route": route,
        "url.path": info.path,
        "http.response.status_code": info.status or 0,
        "gateway.request_id": info.request_id,
    }
    if operation is not None:
        attributes["gen_ai.operation.name"] = operation
        attributes["gen_ai.provider.name"] = "sglang"
    optional = {
        "gen_ai.request.model": info.model,
        "gen_ai.usage.input_tokens": info.prompt_tokens,
        "gen_ai.usage.output_tokens": info.completion_tokens,
        "gen_ai.usage.cache_read.input_tokens": info.cached_tokens,
        "gen_ai.server.time_to_first_token": info.ttft_s,
        "gateway.key_name": info.key_name,
        "gateway.replica": info.replica,
        **trace.params,
    }
    attributes.update({key: value for key, value in optional.items() if value is not None})
    if info.model is not None:
        attributes["gateway.stream"] = info.stream
    if trace.finish_reasons:
        attributes["gen_ai.response.finish_reasons"] = list(trace.finish_reasons)
    return attributes


def _attempt_span(
    attempt: Attempt,
    index: int,
    info: RequestInfo,
    trace: RequestTrace,
    server: SpanContext,
    ended: float,
    operation: str | None,
    resource: Resource,
    scope: InstrumentationScope,
    flags: TraceFlags,
    state: TraceState | None,
) -> ReadableSpan:
    address = urlsplit(attempt.url)
    attributes: dict[str, Any] = {
        "gen_ai.request.model": attempt.model,
        "server.address": address.hostname or "",
        "gateway.attempt": index,
    }
    if address.port is not None:
        attributes["server.port"] = address.port
    if operation is not None:
        attributes["gen_ai.operation.name"] = operation
        attributes["gen_ai.provider.name"] = "sglang"
    if attempt.replica is not None:
        attributes["gateway.replica"] = attempt.replica
    last = index == len(trace.attempts) - 1
    events = [Event("first_byte", {}, trace.ns(attempt.first_byte))] if attempt.first_byte is not None else []
    status = Status(StatusCode.UNSET)
    if attempt.error is not None:
        attributes["error.type"] = attempt.error
        status = Status(StatusCode.ERROR, attempt.error)
    elif last and info.error is not None:
        attributes["error.type"] = "cancelled" if info.error == CANCELLED else info.error_code or "error"
        status = Status(StatusCode.ERROR, info.error[:300])
    end = attempt.ended if attempt.ended is not None else ended
    name = f"{operation} {attempt.model}" if operation is not None else f"POST {attempt.model}"
    context = SpanContext(trace.trace_id, attempt.span_id, False, flags, state)
    return ReadableSpan(
        name,
        context,
        server,
        resource,
        attributes,
        events,
        kind=SpanKind.CLIENT,
        status=status,
        start_time=trace.ns(attempt.started),
        end_time=trace.ns(end),
        instrumentation_scope=scope,
    )


_FINISH = re.compile(rb'"(?:finish_reason|stop_reason)":\s*"([A-Za-z_]{1,32})"')


def finish_reasons(content: bytes) -> tuple[str, ...]:
    """The finish reasons an answer (or a stream's last events) names: OpenAI's ``finish_reason``, Anthropic's
    ``stop_reason``; a byte scan, not a parse (a plain answer may be megabytes)."""
    return tuple(reason.decode() for reason in _FINISH.findall(content))


def request_params(body: dict[str, Any]) -> dict[str, Any]:
    """The gen_ai.request.* attributes of a request body (numbers only: a client may send anything)."""
    found: dict[str, Any] = {}
    for attribute, names in REQUEST_PARAMS.items():
        for name in names:
            value = body.get(name)
            if isinstance(value, int | float) and not isinstance(value, bool):
                found[attribute] = value
                break
    return found


def otlp_exporter(settings: TracingSettings) -> SpanExporter:
    """The OTLP exporter the settings name (gRPC or HTTP/protobuf); unset values come from ``OTEL_*``."""
    protocol = resolved_protocol(settings.protocol)
    endpoint = traces_endpoint(settings.endpoint, protocol)
    headers = {name: value.get_secret_value() for name, value in settings.headers.items()} or None
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GRPCExporter

        insecure = not (settings.endpoint or "").startswith("https://")
        return GRPCExporter(endpoint=endpoint, insecure=insecure, headers=headers)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPExporter

    return HTTPExporter(endpoint=endpoint, headers=headers)


def _env_ratio() -> float:
    text = os.environ.get("OTEL_TRACES_SAMPLER_ARG")
    if not text:
        return 1.0
    try:
        ratio = float(text)
    except ValueError:
        ratio = -1.0
    if not 0.0 <= ratio <= 1.0:
        raise ConfigError(
            f"OTEL_TRACES_SAMPLER_ARG: a sampling ratio is a number from 0 to 1 (got {text!r}); or set gateway.tracing.sample_ratio"
        )
    return ratio


def _version() -> str:
    try:
        return version("sglang-gateway")
    except PackageNotFoundError:
        return "0"
