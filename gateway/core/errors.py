"""Errors in the client's dialect: one exception type, one response builder, one sanitizer.

Every failure reaches the client as JSON in the dialect of the route it called: OpenAI's
``{"error": {"message", "type", "param", "code"}}``, or on Anthropic's routes
``{"type": "error", "error": {"type", "message"}}``; a failure after a stream's 200 as a last event framed
like the stream's own events. Messages that come from an engine are sanitized first: SGLang's error
bodies can carry tracebacks, server file paths and source lines, which must never leave the gateway.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

import orjson
from starlette.responses import Response

from engine_guard.refusal import Refused
from gateway.core.client_mistakes import client_mistake

MAX_MESSAGE_CHARS = 2000


class Dialect(StrEnum):
    """The error shape (and the API key header) clients of a route expect."""

    OPENAI = "openai"  # {"error": {"message", "type", "param", "code"}}; Authorization: Bearer
    ANTHROPIC = "anthropic"  # {"type": "error", "error": {"type", "message"}}; x-api-key or Bearer
    SGLANG = "sglang"  # SGLang's own routes: its {"object": "error", "message", "type", "param", "code": 400}, plus OpenAI's "error"


# SGLang's own routes whose clients read SGLang's flat error body (its tests read body["type"] == "BadRequestError").
# This belongs in the route table (``dialect=Dialect.SGLANG`` on the route in gateway.core.endpoints); kept here until
# that module's rework lands.
SGLANG_SHAPED_PATHS = frozenset({"/v1/score"})


def shaped_for(path: str, dialect: Dialect) -> Dialect:
    """The dialect errors of ``path`` are answered in (``dialect`` unless the route answers SGLang's shape)."""
    return Dialect.SGLANG if path in SGLANG_SHAPED_PATHS else dialect


class StreamKind(StrEnum):
    """How a route's SSE stream is framed, and so how a failure after the 200 is told to the client."""

    DATA = "data"  # OpenAI chat/completions: "data: {...}" lines, "data: [DONE]" at the end
    RESPONSES = "responses"  # OpenAI Responses: "event: <type>" + "data: {...}" with sequence numbers
    ANTHROPIC = "anthropic"  # Anthropic Messages: "event: <type>" + "data: {...}"


# status -> Anthropic error type (their SDK picks its exception class by status)
_ANTHROPIC_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}

# status -> the "type" of SGLang's ErrorResponse (its create_error_response: "BadRequestError" for 400)
_SGLANG_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    503: "ServiceUnavailableError",
}

# status -> (OpenAI error type, default code)
_KINDS: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "invalid_request"),
    401: ("authentication_error", "invalid_api_key"),
    403: ("permission_error", "forbidden"),
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("timeout_error", "request_timeout"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
    422: ("invalid_request_error", "invalid_request"),
    429: ("rate_limit_error", "too_many_requests"),
    500: ("internal_error", "internal_error"),
    502: ("upstream_error", "bad_gateway"),
    503: ("service_unavailable", "engine_unavailable"),
    504: ("timeout_error", "upstream_timeout"),
    507: ("server_error", "insufficient_storage"),
}


class GatewayError(Exception):
    """An error with its HTTP status, answered in OpenAI's shape by the app's exception handler."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
        log_detail: str | None = None,
    ) -> None:
        super().__init__(message)
        kind, default_code = _KINDS.get(status, _KINDS[500] if status >= 500 else _KINDS[400])
        self.status = status
        self.message = message
        self.type = type or kind
        self.code = code or default_code
        self.param = param
        self.headers = headers or {}
        self.log_detail = log_detail  # for the gateway's log only (e.g. what an engine said about its own failure)

    def body(self, dialect: Dialect = Dialect.OPENAI) -> dict[str, Any]:
        if dialect is Dialect.ANTHROPIC:
            kind = _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
            return {"type": "error", "error": {"type": kind, "message": self.message}}
        body = error_body(self.message, self.type, self.code, self.param)
        if dialect is Dialect.SGLANG:  # SGLang's flat ErrorResponse; OpenAI's "error" kept for the gateway's clients
            kind = _SGLANG_TYPES.get(self.status, "InternalServerError" if self.status >= 500 else "BadRequestError")
            return {"object": "error", "message": self.message, "type": kind, "param": self.param, "code": self.status, **body}
        return body


def unknown_model(name: str) -> GatewayError:
    """The answer to a request naming a model (or an adapter) the gateway does not serve."""
    return GatewayError(404, f"The model {name!r} does not exist; see GET /v1/models", code="model_not_found", param="model")


def refused(refusal: Refused) -> GatewayError:
    """The 400 of a request the guard (:mod:`engine_guard`) refused, naming its field as the guard did."""
    return GatewayError(refusal.status, refusal.message, code=refusal.code, param=refusal.param)


def error_body(message: str, type: str, code: str | int | None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(error: GatewayError, dialect: Dialect = Dialect.OPENAI) -> Response:
    """A JSON response for ``error`` in ``dialect`` (usable from plain ASGI middleware too)."""
    return Response(
        orjson.dumps(error.body(dialect)), status_code=error.status, media_type="application/json", headers=error.headers
    )


def sse_error_event(error: GatewayError, kind: StreamKind = StreamKind.DATA, sequence_number: int = 0) -> bytes:
    """The final SSE event sent when a stream fails after the 200 was already sent, framed as ``kind``."""
    if kind is StreamKind.ANTHROPIC:
        return b"event: error\ndata: " + orjson.dumps(error.body(Dialect.ANTHROPIC)) + b"\n\n"
    if kind is StreamKind.RESPONSES:  # OpenAI's ResponseErrorEvent
        event = {"type": "error", "code": error.code, "message": error.message, "param": error.param, "sequence_number": sequence_number}
        return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"
    return b"data: " + orjson.dumps(error.body()) + b"\n\n"


_TRACEBACK = re.compile(r"Traceback \(most recent call last\):.*", re.S)
_FRAME = re.compile(r'^\s*File "[^"]*", line \d+.*$')
# Absolute filesystem paths (two or more segments), but not API routes like /v1/chat/completions.
_PATH = re.compile(r"(?<![\w:/.])(?:[A-Za-z]:)?(?:[/\\](?!v1[/\\])[\w.\-+@~]+){2,}[/\\]?")
# URLs: an engine's or a router's message can name the internal address of a worker.
_URL = re.compile(r"\b(?:https?|grpcs?)://[^\s\"'<>(){}]+(?<![.,;:!?\]])", re.I)


def sanitize_message(message: Any) -> str:
    """Strip tracebacks, ``File "...", line N`` frames with their source lines, URLs and file paths."""
    if not isinstance(message, str):
        message = orjson.dumps(message).decode() if message is not None else ""
    message = _TRACEBACK.sub("", message)
    kept: list[str] = []
    skip_source = False
    for line in message.splitlines():
        if _FRAME.match(line):
            skip_source = True
            continue
        if skip_source and line.startswith((" ", "\t")):
            skip_source = False
            continue
        skip_source = False
        kept.append(line)
    cleaned = _PATH.sub("<path>", _URL.sub("<url>", "\n".join(kept))).strip()
    if len(cleaned) > MAX_MESSAGE_CHARS:
        cleaned = cleaned[:MAX_MESSAGE_CHARS] + "..."
    return cleaned or "upstream error"


# A validation dump as SGLang's FastAPI layer writes it: "[{'type': 'missing', 'loc': ('body', 'messages'), 'msg': ...}]".
# A location is a tuple of repr'd names and indexes, and a name may hold any character, ")" and "]" included
# (pydantic's "function-after[validate(), Model]", a client's dict key): each part is matched whole.
_QUOTED = r"'(?:[^'\\]|\\.)*'" + r'|"(?:[^"\\]|\\.)*"'  # a repr'd string, either quote
_LOC_PART = re.compile(rf"{_QUOTED}|-?\d+")
_VALIDATION_ITEM = re.compile(rf"""['"]loc['"]:\s*[(\[]((?:\s*(?:{_QUOTED}|-?\d+)\s*,?)*)[)\]],\s*['"]msg['"]:\s*({_QUOTED})""")
# Where xgrammar's C++ code raised a grammar error: "[10:33:32] <path>:83: " (after sanitizing), noise to a client.
_VALIDATOR_TAG = re.compile(r"^[\w-]+\[.*\]$")  # pydantic's "function-after[...]", "list[union[...]]": not a field
_CPP_LOCATION = re.compile(r"\[\d{2}:\d{2}:\d{2}\] <path>:\d+: ")


def readable_validation_dump(text: str) -> str | None:
    """``body.messages: Field required; ...`` for a repr'd list of validation errors, else None."""
    items = _VALIDATION_ITEM.findall(text)
    if not items:
        return None
    parts = []
    for location, quoted in items:
        names = [part[1:-1] if part[0] in "'\"" else part for part in _LOC_PART.findall(location)]
        where = ".".join(name for name in names if name and name != "body" and not _VALIDATOR_TAG.match(name))
        message = quoted[1:-1]
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(dict.fromkeys(parts))


def upstream_error(status: int, body: bytes, request: Mapping[str, Any] | None = None) -> GatewayError:
    """Turn an engine's error response to ``request`` (the body sent) into a sanitized OpenAI error.

    4xx keep their status and a sanitized one-line message (validation dumps rewritten as ``field: problem``);
    a 5xx that :func:`~gateway.core.client_mistakes.client_mistake` blames on the request's input becomes a 400;
    other 5xx become 502 with a fixed message: what a failing engine says is about its own internals
    (Python exception texts...), so it goes to the gateway's log, not to the client.
    """
    message: Any = None
    param = None
    code: str | None = None
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        data = None
    if isinstance(data, dict):
        inner = data.get("error") if isinstance(data.get("error"), dict) else data
        message = inner.get("message") or inner.get("detail")
        param = inner.get("param") if isinstance(inner.get("param"), str) else None
        code = inner.get("code") if isinstance(inner.get("code"), str) else None
    if message is None:
        message = body.decode("utf-8", errors="replace")[:500] or f"engine answered HTTP {status}"
    text = sanitize_message(message)
    if status >= 500:
        detail = f"engine answered HTTP {status}: {text}"
        mistake = client_mistake(text, request)
        if mistake is not None:  # the client's input, not the engine: 400, not an engine failure
            return GatewayError(400, mistake[0], param=mistake[1], code="invalid_request", log_detail=f"client mistake; {detail}")
        return GatewayError(502, f"the engine failed to process the request (HTTP {status})", code="upstream_error", log_detail=detail)
    readable = readable_validation_dump(text) or _CPP_LOCATION.sub("", text)
    return GatewayError(status, readable, param=param, code=code)
