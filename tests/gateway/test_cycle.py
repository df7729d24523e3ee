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


def _start(cls: type[RequestResponseCycle], headers: list[tuple[bytes, bytes]], status: int = 200, *, keep_alive: bool = True, method: str = "POST") -> tuple[Any, Any]:
    async def run() -> tuple[Any, Any]:
        transport = _Transport()
        scope: Any = {"type": "http", "method": method, "path": "/v1/chat/completions", "headers": []}
        cycle = cls(
            scope=scope, transport=transport, flow=FlowControl(transport), logger=logging.getLogger("t"),  # type: ignore[arg-type]
            access_logger=logging.getLogger("t.access"), access_log=False, default_headers=list(DEFAULT),
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
]


@pytest.mark.parametrize(("headers", "status", "keep_alive", "method"), HEADS)
def test_the_start_is_uvicorns_byte_for_byte(headers: list[tuple[bytes, bytes]], status: int, keep_alive: bool, method: str) -> None:
    assert _start(GatewayCycle, headers, status, keep_alive=keep_alive, method=method) == _start(
        RequestResponseCycle, headers, status, keep_alive=keep_alive, method=method
    )


def test_a_header_that_would_break_the_head_is_refused() -> None:
    assert _start(GatewayCycle, [(b"x-ok", b"a\r\nb")])[0] == ("refused", "Invalid HTTP header value.")
    assert _start(GatewayCycle, [(b"x:colon", b"v")])[0] == ("refused", "Invalid HTTP header name.")
