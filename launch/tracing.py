"""Where OTLP traces go, and the engine keys that send an engine's own spans there.

The gateway's ``tracing`` section (validated by ``gateway.config.TracingSettings``) names one collector; with
``engines: true`` every managed engine exports its spans (SGLang's ``--enable-trace``) to the same one, so that
they hang under the gateway's spans in one trace. Both sides resolve the collector's address here, the standard
``OTEL_EXPORTER_OTLP_*`` variables included, so that they can never disagree.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal
from urllib.parse import urlsplit

Protocol = Literal["grpc", "http/protobuf"]
PROTOCOLS: tuple[Protocol, ...] = ("http/protobuf", "grpc")
TRACING_SETTING = "tracing"  # the gateway section's key (``gateway.tracing``)
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"  # read by SGLang's exporter (its default: grpc)
_TRACES_PATH = "/v1/traces"


def resolved_protocol(protocol: str | None, environ: Mapping[str, str] = os.environ) -> str:
    """``protocol``, else ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL``, else http/protobuf."""
    return protocol or environ.get(PROTOCOL_ENV) or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf"


def traces_endpoint(endpoint: str | None, protocol: str, environ: Mapping[str, str] = os.environ) -> str:
    """The exporter's target: a full ``.../v1/traces`` URL for http/protobuf, ``host:port`` for grpc.

    ``endpoint`` is the collector's base address (``http://collector:4318``); a URL with a path is taken as the
    full traces URL. Unset: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (full), ``OTEL_EXPORTER_OTLP_ENDPOINT`` (base),
    then the collector's default port on localhost (4318, 4317 for grpc)."""
    full = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") if endpoint is None else None
    base = endpoint or full or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if protocol == "grpc":
        address = base or "localhost:4317"
        parts = urlsplit(address if "://" in address else f"http://{address}")
        return parts.netloc
    if base is None:
        return f"http://localhost:4318{_TRACES_PATH}"
    if full is not None and base == full:
        return full
    address = base if "://" in base else f"http://{base}"
    path = urlsplit(address).path
    return address if path not in ("", "/") else address.rstrip("/") + _TRACES_PATH


def engine_tracing_keys(gateway: Mapping[str, Any], model: str, environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The engine keys that make ``model``'s engine export its spans to the gateway's collector, or ``{}`` when
    ``gateway.tracing`` does not ask for it (``enabled`` and ``engines`` both true)."""
    section = gateway.get(TRACING_SETTING)
    if not isinstance(section, Mapping) or section.get("enabled") is not True or section.get("engines") is not True:
        return {}
    protocol = section.get("protocol")
    endpoint = section.get("endpoint")
    if (protocol is not None and protocol not in PROTOCOLS) or (endpoint is not None and not isinstance(endpoint, str)):
        return {}  # the gateway's own validation names the bad key
    protocol = resolved_protocol(protocol, environ)
    return {
        "enable_trace": True,
        "otlp_traces_endpoint": traces_endpoint(endpoint, protocol, environ),
        "otlp_traces_protocol": protocol,
        "otlp_service_name": f"sglang-{model}",
    }
