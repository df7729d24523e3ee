"""The cost of tracing: ``compare --tracing`` runs a second gateway with ``gateway.tracing`` on and every request
sampled (``sample_ratio: 1``), next to the plain one, in the same run (batches alternate over direct, gateway and
gateway-traced). Its spans go over OTLP/HTTP to :class:`OTLPSink`, a collector stand-in in the benchmark process
that answers every export at once and counts the spans (decoded after the run), so the report can say that every
request was exported, not only that it was cheap.
"""

from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self

TRACED = "gateway-traced"  # the target's name in the results


class OTLPHTTPServer:
    """A collector's ``POST /v1/traces`` (OTLP/HTTP with protobuf bodies, gzip or not) in this process, on a free
    port; each export is answered 200 with an empty ``ExportTraceServiceResponse`` once :meth:`take` has the
    body. ``with OTLPHTTPServer() as server:``, ``server.url`` is its base URL."""

    def __init__(self) -> None:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                owner.take(gzip.decompress(body) if self.headers.get("Content-Encoding") == "gzip" else body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")  # an empty ExportTraceServiceResponse: no partial rejection
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-http", daemon=True)

    def take(self, body: bytes) -> None:
        """One export's ``ExportTraceServiceRequest``, serialised (called on the server's thread)."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


class OTLPSink(OTLPHTTPServer):
    """Keeps the bodies as they come (nothing decoded during the run) and counts their spans after it."""

    def __init__(self) -> None:
        super().__init__()
        self.bodies: list[bytes] = []

    def take(self, body: bytes) -> None:
        self.bodies.append(body)

    def span_count(self) -> dict[str, int]:
        """Spans received, by name (the server spans count the requests)."""
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        counts: dict[str, int] = {}
        for body in self.bodies:
            for resource in ExportTraceServiceRequest.FromString(body).resource_spans:
                for scope in resource.scope_spans:
                    for span in scope.spans:
                        counts[span.name] = counts.get(span.name, 0) + 1
        return counts


def traced_settings(sink_url: str, out_dir: Path) -> dict[str, Any]:
    """The gateway with tracing on, every request sampled, exporting to the sink."""
    return {
        "tracing.enabled": True,
        "tracing.endpoint": sink_url,
        "tracing.sample_ratio": 1.0,
        "state_dir": str(out_dir / "gateway-traced-state"),
    }
