"""The floor under a Python proxy: the least a proxy on the gateway's own stack (uvloop, httptools) can cost a request.

``costs --floor`` measures it beside the gateway and SGLang's router. It is not a gateway: no routing, no checks, no
limits, no metrics, no error handling worth the name. Each client connection gets one kept-alive connection to the
upstream; a request's head is parsed and its body sent on as a POST to the same path; the answer goes back chunked,
each upstream read as it came. What the gateway costs above it is what its own work costs; what it would take to
come under the router's CPU per request, where the floor itself is close to it, is a question of that work.

    python -m benchmarks.floor_proxy --port 8001 --upstream http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
from urllib.parse import urlsplit

import httptools
import uvloop

_HEALTH = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"


class _Upstream(asyncio.Protocol):
    """One kept-alive connection to the upstream, for one client connection's requests in turn."""

    def __init__(self, client: _Client) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.upstream_lost()

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        self.client.write(b"HTTP/1.1 %d -\r\ncontent-type: %b\r\ntransfer-encoding: chunked\r\n\r\n" % (status, self.client.media_type))

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self.client.media_type = value

    def on_body(self, body: bytes) -> None:
        self.client.write(b"%x\r\n%b\r\n" % (len(body), body))

    def on_message_complete(self) -> None:
        self.client.write(b"0\r\n\r\n")
        self.parser = httptools.HttpResponseParser(self)


class _Client(asyncio.Protocol):
    """One client connection: its requests parsed, sent upstream one at a time."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.upstream: _Upstream | None = None
        self.url = b""
        self.body: list[bytes] = []
        self.media_type = b"application/json"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.close()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()  # type: ignore[union-attr]

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        url, self.url = self.url, b""
        body, self.body = b"".join(self.body), []
        if self.parser.get_method() == b"GET":
            self.write(_HEALTH)
            return
        head = b"POST %b HTTP/1.1\r\nhost: %b\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
        request = head % (url, self.host.encode(), len(body)) + body
        self.media_type = b"application/json"
        if self.upstream is not None and self.upstream.transport is not None and not self.upstream.transport.is_closing():
            self.upstream.transport.write(request)
            return
        asyncio.ensure_future(self._connect_and_send(request))

    async def _connect_and_send(self, request: bytes) -> None:
        loop = asyncio.get_running_loop()
        _, self.upstream = await loop.create_connection(lambda: _Upstream(self), self.host, self.port)
        self.upstream.transport.write(request)  # type: ignore[union-attr]

    def upstream_lost(self) -> None:
        self.upstream = None

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)


async def serve(port: int, upstream: str) -> None:
    parts = urlsplit(upstream)
    host, upstream_port = parts.hostname or "127.0.0.1", parts.port or 80
    server = await asyncio.get_running_loop().create_server(lambda: _Client(host, upstream_port), "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="the upstream's base URL (http://host:port)")
    args = parser.parse_args()
    uvloop.run(serve(args.port, args.upstream))


if __name__ == "__main__":
    main()
