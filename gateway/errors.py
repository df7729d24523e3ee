"""OpenAI-shaped errors: one exception type, one response builder, one sanitizer.

Every failure reaches the client as ``{"error": {"message", "type", "param", "code"}}``. Messages that
come from an engine are sanitized first: SGLang's error bodies can carry tracebacks, server file
paths and source lines, which must never leave the gateway.
"""

from __future__ import annotations

import re
from typing import Any

import orjson
from starlette.responses import Response

MAX_MESSAGE_CHARS = 2000

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

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code, self.param)


def error_body(message: str, type: str, code: str | int | None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(error: GatewayError) -> Response:
    """A JSON response for ``error`` (usable from plain ASGI middleware too)."""
    return Response(
        orjson.dumps(error.body()), status_code=error.status, media_type="application/json", headers=error.headers
    )


def sse_error_event(error: GatewayError) -> bytes:
    """The final SSE event sent when a stream fails after the 200 was already sent."""
    return b"data: " + orjson.dumps(error.body()) + b"\n\n"


_TRACEBACK = re.compile(r"Traceback \(most recent call last\):.*", re.S)
_FRAME = re.compile(r'^\s*File "[^"]*", line \d+.*$')
# Absolute filesystem paths (two or more segments), but not API routes like /v1/chat/completions.
_PATH = re.compile(r"(?<![\w:/.])(?:[A-Za-z]:)?(?:[/\\](?!v1[/\\])[\w.\-+@~]+){2,}[/\\]?")


def sanitize_message(message: Any) -> str:
    """Strip tracebacks, ``File "...", line N`` frames with their source lines, and file paths."""
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
    cleaned = _PATH.sub("<path>", "\n".join(kept)).strip()
    if len(cleaned) > MAX_MESSAGE_CHARS:
        cleaned = cleaned[:MAX_MESSAGE_CHARS] + "..."
    return cleaned or "upstream error"


# A validation dump as SGLang's FastAPI layer writes it: "[{'type': 'missing', 'loc': ('body', 'messages'), 'msg': ...}]".
_VALIDATION_ITEM = re.compile(r"""['"]loc['"]:\s*[(\[]([^)\]]*)[)\]],\s*['"]msg['"]:\s*(?:'([^']*)'|"([^"]*)")""")


def readable_validation_dump(text: str) -> str | None:
    """``body.messages: Field required; ...`` for a repr'd list of validation errors, else None."""
    items = _VALIDATION_ITEM.findall(text)
    if not items:
        return None
    parts = []
    for location, single, double in items:
        names = [part.strip().strip("'\"") for part in location.split(",")]
        where = ".".join(name for name in names if name and name != "body")
        message = single or double
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(dict.fromkeys(parts))


def upstream_error(status: int, body: bytes) -> GatewayError:
    """Turn an engine's error response into a sanitized OpenAI error.

    4xx keep their status and a sanitized message (validation dumps rewritten as ``field: problem``);
    5xx become 502 with a fixed message: what a failing engine says is about its own internals
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
        return GatewayError(502, f"the engine failed to process the request (HTTP {status})", code="upstream_error", log_detail=detail)
    return GatewayError(status, readable_validation_dump(text) or text, param=param, code=code)
