"""The gateway's response start writes uvicorn's head byte for byte and refuses what uvicorn refuses."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from gateway.edge.cycle import GatewayCycle

DEFAULT = [(b"server", b"uvicorn"), (b"date", b"Mon, 07 Dec 2026 15:00:00 GMT")]


class _Transport:
    """Records what is written (the parts of asyncio.Transport a cycle's start uses)."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


def _start(
    cls: type[RequestResponseCycle], headers: list[tuple[bytes, bytes]], status: int = 200, *, keep_alive: bool = True, method: str = "POST",
    default: list[tuple[bytes, bytes]] = DEFAULT,
) -> tuple[Any, Any]:
    async def run() -> tuple[Any, Any]:
        transport = _Transport()
        scope: Any = {"type": "http", "method": method, "path": "/v1/chat/completions", "headers": []}
        cycle = cls(
            scope=scope, transport=transport, flow=FlowControl(transport), logger=logging.getLogger("t"),  # type: ignore[arg-type]
            access_logger=logging.getLogger("t.access"), access_log=False, default_headers=list(default),
            message_event=asyncio.Event(), expect_100_continue=False, keep_alive=keep_alive, on_response=lambda: None,
        )  # fmt: skip
        try:
            await cycle.send({"type": "http.response.start", "status": status, "headers": headers})
        except RuntimeError as error:
            return ("refused", str(error)), cycle.response_started
        state = (cycle.chunked_encoding, cycle.expected_content_length, cycle.keep_alive, cycle.response_started)
        return b"".join(transport.written), state

    return asyncio.run(run())


HEADS = [
    ([(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"), (b"x-request-id", b"abc")], 200, True, "POST"),
    ([(b"Content-Type", b"application/json"), (b"content-length", b"17")], 200, True, "POST"),
    ([(b"content-type", b"application/json"), (b"Transfer-Encoding", b"Chunked")], 201, True, "POST"),
    ([(b"connection", b"keep-alive, Close"), (b"content-length", b"0")], 404, True, "GET"),
    ([(b"content-type", b"text/plain")], 200, False, "POST"),
    ([(b"content-type", b"text/plain")], 204, True, "POST"),
    ([], 200, True, "HEAD"),
    ([(b"x-a", b"tab\there is fine")], 200, True, "POST"),
    ([(b"x-bad name", b"v")], 200, True, "POST"),
    ([(b"x-ok", b"line\r\nx-injected: 1")], 200, True, "POST"),
    ([(b"x-ok", b"nul\x00")], 200, True, "POST"),
    ([(b"x(paren)", b"v"), (b"x-ok", b"v\x7f")], 200, True, "POST"),
    ([(b"Content-Length", b"5")], 200, False, "POST"),
    ([(b"content-length", b"5"), (b"content-length", b"7")], 200, True, "POST"),
    ([(b"content-length", b"5"), (b"transfer-encoding", b"chunked")], 200, True, "POST"),
    ([(b"transfer-encoding", b"chunked"), (b"content-length", b"5")], 200, True, "POST"),
    ([(b"content-length", b"5"), (b"connection", b"close")], 200, True, "POST"),
    ([(b"transfer-encoding", b"gzip")], 200, True, "POST"),
    ([(b"content-length", b"0")], 304, True, "GET"),
    ([(b"x-nul\x00", b"v")], 200, True, "POST"),
]


@pytest.mark.parametrize(("headers", "status", "keep_alive", "method"), HEADS)
def test_the_start_is_uvicorns_byte_for_byte(headers: list[tuple[bytes, bytes]], status: int, keep_alive: bool, method: str) -> None:
    assert _start(GatewayCycle, headers, status, keep_alive=keep_alive, method=method) == _start(
        RequestResponseCycle, headers, status, keep_alive=keep_alive, method=method
    )


@pytest.mark.parametrize("headers", [[], [(b"content-type", b"text/plain")], [(b"content-length", b"3")]])
def test_a_start_without_default_headers_is_uvicorns(headers: list[tuple[bytes, bytes]]) -> None:
    """No ``server`` or ``date`` header (both turned off): a start with no field at all has a head too."""
    assert _start(GatewayCycle, headers, default=[]) == _start(RequestResponseCycle, headers, default=[])


def test_a_header_that_would_break_the_head_is_refused() -> None:
    assert _start(GatewayCycle, [(b"x-ok", b"a\r\nb")])[0] == ("refused", "Invalid HTTP header value.")
    assert _start(GatewayCycle, [(b"x:colon", b"v")])[0] == ("refused", "Invalid HTTP header name.")


def _respond(cls: type[RequestResponseCycle], headers: list[tuple[bytes, bytes]], bodies: list[dict[str, Any]], *, keep_alive: bool = True, method: str = "POST") -> Any:
    """A start, then ``bodies`` in turn: what was written, each send's outcome and the cycle's state after each."""

    async def run() -> Any:
        transport = _Transport()
        ended: list[int] = []
        scope: Any = {"type": "http", "method": method, "path": "/v1/chat/completions", "headers": []}
        cycle = cls(
            scope=scope, transport=transport, flow=FlowControl(transport), logger=logging.getLogger("t"),  # type: ignore[arg-type]
            access_logger=logging.getLogger("t.access"), access_log=False, default_headers=list(DEFAULT),
            message_event=asyncio.Event(), expect_100_continue=False, keep_alive=keep_alive, on_response=lambda: ended.append(1),
        )  # fmt: skip
        await cycle.send({"type": "http.response.start", "status": 200, "headers": headers})
        steps = []
        for message in bodies:
            try:
                await cycle.send(message)
                outcome = "sent"
            except RuntimeError as error:
                outcome = str(error)
            state = (cycle.response_complete, cycle.expected_content_length, cycle.message_event.is_set(), transport.closed, len(ended))
            steps.append((outcome, b"".join(transport.written), state))
        return steps

    return asyncio.run(run())


CHUNKED = [(b"content-type", b"text/event-stream")]
SIZED = [(b"content-type", b"application/json"), (b"content-length", b"10")]
BODY = "http.response.body"
BODIES = [
    (CHUNKED, [{"type": BODY, "body": b"data: a\n\n", "more_body": True}, {"type": BODY, "body": b"", "more_body": True}, {"type": BODY, "body": b"data: [DONE]\n\n"}], True, "POST"),
    (CHUNKED, [{"type": BODY, "body": b"x" * 300, "more_body": True}, {"type": BODY}], False, "POST"),
    (CHUNKED, [{"type": BODY, "body": b"whole"}, {"type": BODY, "body": b"after the end"}], True, "POST"),
    (SIZED, [{"type": BODY, "body": b"12345", "more_body": True}, {"type": BODY, "body": b"67890"}], True, "POST"),
    (SIZED, [{"type": BODY, "body": b"1234567890"}], False, "POST"),
    (SIZED, [{"type": BODY, "body": b"12345678901"}], True, "POST"),
    (SIZED, [{"type": BODY, "body": b"123"}], True, "POST"),
    (SIZED, [{"type": "http.response.start", "status": 200}], True, "POST"),
    (SIZED, [{"type": BODY, "body": b"1234567890"}], True, "HEAD"),
]


@pytest.mark.parametrize(("headers", "bodies", "keep_alive", "method"), BODIES)
def test_the_body_is_uvicorns_byte_for_byte(headers: list[tuple[bytes, bytes]], bodies: list[dict[str, Any]], keep_alive: bool, method: str) -> None:
    """Chunks, an empty chunk, the last one; a declared length met, exceeded and short; the connection closed after
    the end when not kept alive; a message after the end, or of the wrong type; a HEAD response's body."""
    assert _respond(GatewayCycle, headers, bodies, keep_alive=keep_alive, method=method) == _respond(
        RequestResponseCycle, headers, bodies, keep_alive=keep_alive, method=method
    )
