"""A request's headers are parsed as uvicorn parses them, mapped once, and the proxy headers still mean what they
meant under uvicorn's own middleware."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import uvicorn
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from gateway.config import HttpSettings
from gateway.core.headers import HEADER_MAP, header_map, header_text
from gateway.edge.connection import guarded_protocol
from gateway.edge.forwarded import ForwardedHeaders
from gateway.server import GatewayConfig
from tests.gateway.test_cycle import _Transport as RecordingTransport


class _Transport(RecordingTransport):
    """The parts of a client's transport a protocol reads while parsing a head (what it writes is recorded)."""

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(name, default)


def _parsed(protocol_class: type[HttpToolsProtocol], head: bytes) -> tuple[list[tuple[bytes, bytes]], bool, dict[bytes, bytes], bool]:
    """The headers a protocol hands the app for ``head``, whether it saw ``Expect: 100-continue``, the request's
    header map, and whether the protocol built that map itself."""
    scopes: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        scopes.append(scope)

    async def run() -> tuple[list[tuple[bytes, bytes]], bool, dict[bytes, bytes], bool]:
        config = uvicorn.Config(app, log_level="warning")
        config.load()
        protocol = protocol_class(config=config, server_state=ServerState(), app_state={})
        protocol.connection_made(_Transport())  # type: ignore[arg-type]
        protocol.data_received(head)
        await asyncio.sleep(0)
        expects = protocol.expect_100_continue
        protocol.connection_lost(None)
        (scope,) = scopes
        built = HEADER_MAP in scope
        return list(scope["headers"]), expects, header_map(scope), built

    return asyncio.run(run())


HEADS = [
    b"Host: x\r\nContent-Length: 0\r\n",
    b"Host: x\r\nX-Trailing: spaced  \t\r\nX-Dup: first\r\nx-DUP: second\r\nContent-Length: 0\r\n",
    b"Host: x\r\nEXPECT: 100-Continue\r\nContent-Length: 0\r\n",
    b"Host: x\r\nExpect: something-else\r\nExpect: 100-continue\r\nContent-Length: 0\r\n",
    b"Host: x\r\nExpect: something-else\r\nContent-Length: 0\r\n",
    b"Host: x\r\nAuthorization: Bearer k\r\nX-Stainless-Lang: python\r\nX-Request-Id: abc \r\nContent-Length: 0\r\n",
]


@pytest.mark.parametrize("head", HEADS)
def test_the_head_is_parsed_as_uvicorn_parses_it_and_mapped_once(head: bytes) -> None:
    raw = b"GET /v1/models HTTP/1.1\r\n" + head + b"\r\n"
    ours = _parsed(guarded_protocol(HttpSettings()), raw)
    theirs = _parsed(HttpToolsProtocol, raw)
    assert ours[:3] == theirs[:3]  # the headers, the Expect, the first value of each
    assert ours[3] and not theirs[3]  # the gateway's protocol built the map as the head completed


def test_the_map_holds_the_first_value_of_each_name_in_lower_case() -> None:
    scope: dict[str, Any] = {"headers": [(b"X-Dup", b"first"), (b"x-dup", b"second"), (b"Content-Length", b" 12 ")]}
    assert header_map(scope) == {b"x-dup": b"first", b"content-length": b" 12 "}
    assert header_text(scope, b"content-length") == "12"
    assert header_text(scope, b"authorization") is None
    scope["headers"].append((b"authorization", b"late"))
    assert header_text(scope, b"authorization") is None  # built once per request, kept in its scope


# (headers, client host): what uvicorn's middleware makes of the client address and scheme for each
FORWARDED = [
    ([], "127.0.0.1"),
    ([(b"x-forwarded-for", b"203.0.113.7")], "127.0.0.1"),
    ([(b"x-forwarded-for", b"203.0.113.7, 127.0.0.1")], "127.0.0.1"),
    ([(b"x-forwarded-for", b"203.0.113.7"), (b"x-forwarded-for", b"198.51.100.2")], "127.0.0.1"),
    ([(b"x-forwarded-proto", b"https")], "127.0.0.1"),
    ([(b"x-forwarded-proto", b"https"), (b"x-forwarded-for", b"[2001:db8::1]:443")], "127.0.0.1"),
    ([(b"x-forwarded-for", b"203.0.113.7"), (b"x-forwarded-proto", b"https")], "192.0.2.1"),  # not a trusted proxy
]


async def _seen(middleware: Any, headers: list[tuple[bytes, bytes]], host: str) -> tuple[Any, Any]:
    scope = {"type": "http", "client": (host, 5000), "scheme": "http", "headers": list(headers)}
    await middleware(scope, None, None)
    return scope["client"], scope["scheme"]


@pytest.mark.parametrize(("headers", "host"), FORWARDED)
def test_forwarded_headers_mean_what_they_meant_under_uvicorns_middleware(headers: list[tuple[bytes, bytes]], host: str) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None: ...

    config = GatewayConfig(app, log_level="warning", http=guarded_protocol(HttpSettings()))
    config.load()
    assert type(config.loaded_app) is ForwardedHeaders  # the gateway's, in uvicorn's place

    async def both() -> tuple[Any, Any]:
        return await _seen(config.loaded_app, headers, host), await _seen(ProxyHeadersMiddleware(app), headers, host)

    ours, theirs = asyncio.run(both())
    assert ours == theirs
    if headers and host == "127.0.0.1":
        assert ours != ((host, 5000), "http")  # (the cases forward something: the comparison is not vacuous)
