"""Real OTLP trace receivers in the test process: the collector's ``POST /v1/traces`` (OTLP/HTTP) and its gRPC
``TraceService/Export``, both with the protobuf ``ExportTraceServiceRequest`` of ``opentelemetry-proto`` (what
Jaeger, Tempo and the OpenTelemetry Collector accept), decoded into plain :class:`Span` records for assertions.
Exporters (the gateway's, SGLang's) talk to them exactly as to a collector; nothing of the SDK is mocked.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from benchmarks.tracing import OTLPHTTPServer
from tests.waiting import wait_until


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_id: str  # "" for a root span
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind: 2 server, 3 client, 1 internal
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: tuple[str, ...]
    status_code: int  # 0 unset, 1 ok, 2 error
    status_message: str


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(item) for item in value.array_value.values]
    return getattr(value, kind) if kind is not None else None


class SpanLog:
    """The spans received so far, decoded into :class:`Span` records, for assertions (thread-safe)."""

    def __init__(self) -> None:
        self.endpoint = ""  # where exporters send (set by the receiver that serves the log)
        self.spans: list[Span] = []
        self.requests = 0
        self._lock = threading.Lock()

    def _take(self, request: ExportTraceServiceRequest) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            resource = {item.key: _value(item.value) for item in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(
                        Span(
                            service=str(resource.get("service.name", "")), name=span.name, trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(), parent_id=span.parent_span_id.hex(), kind=span.kind,
                            start_ns=span.start_time_unix_nano, end_ns=span.end_time_unix_nano,
                            attributes={item.key: _value(item.value) for item in span.attributes},
                            events=tuple(event.name for event in span.events), status_code=span.status.code,
                            status_message=span.status.message,
                        )  # fmt: skip
                    )
        with self._lock:
            self.requests += 1
            self.spans.extend(spans)

    def of_trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [span for span in self.spans if span.trace_id == trace_id]

    def wait_for(self, predicate: Callable[[list[Span]], bool], timeout_s: float = 30, what: str = "spans") -> list[Span]:
        """Until ``predicate(all spans so far)`` holds; the spans then."""

        def received() -> tuple[list[Span]] | None:
            with self._lock:
                spans = list(self.spans)
            return (spans,) if predicate(spans) else None

        def failure() -> str:
            with self._lock:
                names = sorted({(span.service, span.name) for span in self.spans})
            return f"no {what}; received: {names}"

        (spans,) = wait_until(received, failure, timeout_s)
        return spans


class OTLPReceiver(SpanLog, OTLPHTTPServer):
    """OTLP/HTTP: ``with OTLPReceiver() as receiver:``; ``receiver.endpoint`` is its base URL
    (``http://127.0.0.1:port``). Each export is decoded as it arrives (:class:`benchmarks.tracing.OTLPHTTPServer`
    serves the protocol)."""

    def __init__(self) -> None:
        SpanLog.__init__(self)
        OTLPHTTPServer.__init__(self)
        self.endpoint = self.url

    def take(self, body: bytes) -> None:
        self._take(ExportTraceServiceRequest.FromString(body))


@contextmanager
def otlp_receiver() -> Iterator[OTLPReceiver]:
    with OTLPReceiver() as receiver:
        yield receiver


@contextmanager
def otlp_grpc_receiver() -> Iterator[SpanLog]:
    """OTLP/gRPC: the collector's ``TraceService/Export`` (grpcio, the service of ``opentelemetry-proto``) on a free
    loopback port; ``receiver.endpoint`` is ``http://127.0.0.1:port`` (plain text, as a collector's 4317)."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

    receiver = SpanLog()

    class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: ExportTraceServiceRequest, context: Any) -> ExportTraceServiceResponse:  # noqa: N802
            receiver._take(request)
            return ExportTraceServiceResponse()

    server = grpc.server(ThreadPoolExecutor(2, thread_name_prefix="otlp-grpc"))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    receiver.endpoint = f"http://127.0.0.1:{port}"
    try:
        yield receiver
    finally:
        server.stop(grace=None)
