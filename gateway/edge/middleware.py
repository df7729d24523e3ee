"""Pure-ASGI middleware: request ids + the per-request log line and metrics, and the body-size/time caps.

Pure ASGI (not ``BaseHTTPMiddleware``) so streaming responses pass through untouched and a client
disconnect reaches the streaming response itself.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable
from typing import Any

from loguru import logger
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.core.context import BATCH_SCOPE_KEY, SCOPE_KEY, RequestInfo, new_request_id
from gateway.core.endpoints import dialect_for_path, route_label
from gateway.core.errors import GatewayError, error_response
from gateway.core.headers import header_text
from gateway.core.metrics import Metrics
from gateway.core.request_tally import Finished
from gateway.core.tracing import Tracing
from gateway.edge.cycle import HTTP_CYCLE
from gateway.tenants.keys import UNNAMED
from gateway.tenants.ledger import Ledger, UsageRow

_GOOD_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_REQUEST_ID_FIELD = b"\0x-request-id\0"  # among a response's field names, each lowered and between NULs


# Probes and scrapes (a Kubernetes probe every few seconds) would bury the requests' traces.
UNTRACED_PATHS = frozenset({"/health", "/ready", "/metrics"})

class RequestContextMiddleware:
    """Gives every response an ``X-Request-Id`` and records one log line, the metrics and a usage ledger row per request."""

    def __init__(
        self, app: ASGIApp, metrics: Metrics, log_requests: bool = True, worker: int | None = None, record: bool = True,
        ledger: Ledger | None = None, tracing: Tracing | None = None,
    ) -> None:  # fmt: skip
        self.app = app
        self.tracing = tracing  # one trace per request (gateway.core.tracing), begun here and exported by _record
        self.metrics = metrics
        self.log_requests = log_requests
        self.ledger = ledger
        self.record = record  # False in the control process of workers: the worker that forwarded it records it
        # A worker process names itself on every response (X-Gateway-Worker: its index) and log line.
        self.worker = worker
        self._extra = [(b"x-gateway-worker", str(worker).encode())] if worker is not None else []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = header_text(scope, b"x-request-id")
        request_id = incoming if incoming and _GOOD_ID.match(incoming) else new_request_id()
        info = RequestInfo(request_id=request_id, method=scope["method"], path=scope["path"])
        info.batch_id = scope.get(BATCH_SCOPE_KEY)
        if self.tracing is not None and scope["path"] not in UNTRACED_PATHS:
            parent, state = header_text(scope, b"traceparent"), header_text(scope, b"tracestate")
            info.trace = self.tracing.begin(parent, state, info.started)
        scope[SCOPE_KEY] = info

        def send_with_id(message: Message) -> Awaitable[None]:  # (the server's send itself: no coroutine around it)
            if message["type"] == "http.response.start":
                info.status = message["status"]
                headers = message.get("headers", ())
                if headers and _REQUEST_ID_FIELD in b"\0%b\0" % b"\0".join(next(zip(*headers, strict=True))).lower():  # (one a worker answered with)
                    headers = [(k, v) for k, v in headers if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id.encode()), *self._extra, *info.extra_headers]}
            return send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except ClientDisconnect:  # gone while sending its body: nobody to answer, nothing to log as a failure
            info.status = info.status or 499
            info.error = info.error or "client disconnected"
        except BaseException:
            info.status = info.status or 500
            raise
        finally:
            if self.record:
                self._record(info)

    def _record(self, info: RequestInfo) -> None:
        ended = time.perf_counter()
        elapsed = ended - info.started
        if self.tracing is not None:
            self.tracing.finish(info, ended)
        status = info.status or 0
        key = info.key_name or UNNAMED
        self.metrics.finished(
            Finished(
                info.model or "-", route_label(info.path), status, elapsed, info.ttft_s, info.prompt_tokens, info.completion_tokens,
                info.replica, key,
            )
        )  # fmt: skip
        if self.ledger is not None:
            ttft = info.ttft_s
            self.ledger.record(
                UsageRow(
                    time.time() - elapsed, info.key_name, info.model, info.path, info.prompt_tokens, info.completion_tokens,
                    info.cached_tokens, status, elapsed * 1000, ttft * 1000 if ttft is not None else None, info.request_id,
                    info.replica, info.stream, info.error, info.batch_id,
                )
            )  # fmt: skip
        if not self.log_requests:
            return
        fields: dict[str, Any] = {
            "request_id": info.request_id,
            "method": info.method,
            "path": info.path,
            "model": info.model,
            "key": info.key_name,  # the named key (tenant), never the key itself
            "replica": info.replica,  # for models with several replicas
            "status": info.status,
            "stream": info.stream,
            "latency_ms": round(elapsed * 1000, 1),
            "ttft_ms": round(info.ttft_s * 1000, 1) if info.ttft_s is not None else None,
            "tokens_in": info.prompt_tokens,
            "tokens_out": info.completion_tokens,
            "error": info.error,
            "worker": self.worker,
        }
        fields = {k: escape_log_text(v) if isinstance(v, str) else v for k, v in fields.items()}
        text = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
        logger.bind(**fields).info("request {}", text)


_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\\]")


def escape_log_text(text: str) -> str:
    """``text`` with control characters, line separators and backslashes escaped: a client-chosen path or
    model name can neither forge a log line nor write a NUL into the log."""
    if _UNPRINTABLE.search(text) is None:
        return text
    return _UNPRINTABLE.sub(_escape_char, text)


def _escape_char(match: re.Match[str]) -> str:
    char = match.group()
    if char == "\\":
        return "\\\\"
    return f"\\x{ord(char):02x}" if ord(char) < 256 else f"\\u{ord(char):04x}"


class BodyLimitMiddleware:
    """413 for bodies over ``max_bytes`` (by ``Content-Length`` first, then by counting streamed bytes);
    408 when the body stops arriving for ``timeout_s``, or is not complete ``deadline_s`` after the headers
    (a sender trickling one byte every few seconds is never silent for long, and must not hold a connection
    forever either)."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, timeout_s: float = 30.0, deadline_s: float = 60.0, larger: dict[str, int] | None = None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.larger = larger or {}  # path -> its own cap (an upload route: gateway.batches.max_file_bytes)
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        """The refusal of a declared length over the cap, the request as it is when its whole body (within the cap, as
        declared) is in already (the next step's awaitable: no coroutine of its own around it), or the request with
        its body counted and timed as it comes (:meth:`_counted`)."""
        if scope["type"] != "http":
            return self.app(scope, receive, send)
        max_bytes = self.larger.get(scope["path"], self.max_bytes) if self.larger else self.max_bytes
        declared = header_text(scope, b"content-length")
        cycle = scope.get("extensions", {}).get(HTTP_CYCLE)
        if declared is not None:
            if not declared.isdigit():
                error = GatewayError(400, "invalid Content-Length header", code="invalid_header")
                return error_response(error, dialect_for_path(scope["path"]))(scope, receive, send)
            if int(declared) > max_bytes:
                return error_response(self._too_large(max_bytes), dialect_for_path(scope["path"]))(scope, receive, send)
            if cycle is not None and not cycle.more_body:  # all of it came, as long as declared: nothing to count or time
                return self.app(scope, receive, send)
        return self._counted(scope, receive, send, max_bytes, cycle)

    async def _counted(self, scope: Scope, receive: Receive, send: Send, max_bytes: int, cycle: Any) -> None:
        seen = 0
        complete = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.deadline_s  # the app is called once the headers are complete

        async def counting_receive() -> Message:
            nonlocal seen, complete
            if complete:  # after the body, receive() waits for a disconnect: no deadline then
                return await receive()
            if cycle is not None and not cycle.more_body:
                message = await receive()  # uvicorn holds the whole body already: no timer to arm
            else:
                message = await self._within(receive, deadline - loop.time())
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > max_bytes:
                    raise self._too_large(max_bytes)
                complete = not message.get("more_body", False)
            return message

        await self.app(scope, counting_receive, send)

    async def _within(self, receive: Receive, left: float) -> Message:
        """The next body message, or 408 once ``timeout_s`` of silence or the whole-body deadline (``left``) passed."""
        try:
            async with asyncio.timeout(min(self.timeout_s, max(left, 0.0))):
                return await receive()
        except TimeoutError:
            # The rest of the body may still come: close the connection rather than parse it as a request.
            message = (
                f"not complete within {self.deadline_s:g}s"
                if left < self.timeout_s
                else f"not received within {self.timeout_s:g}s"
            )
            raise GatewayError(
                408, f"request body {message}", code="request_timeout", headers={"Connection": "close"}
            ) from None

    def _too_large(self, max_bytes: int) -> GatewayError:
        return GatewayError(413, f"request body is larger than {max_bytes} bytes", code="request_too_large")


class JSONCORSMiddleware(CORSMiddleware):
    """Starlette's CORS middleware, with its refusal of a preflight answered in OpenAI's error shape."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code < 400:
            return response
        reason = bytes(response.body).decode("utf-8", errors="replace")  # "Disallowed CORS origin, method"
        error = GatewayError(
            response.status_code, reason.replace("Disallowed CORS", "CORS preflight refused:"), code="cors_refused"
        )
        headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
        return error_response(GatewayError(error.status, error.message, code=error.code, headers=headers))
