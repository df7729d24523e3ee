"""The gateway's upstream connections acknowledge every read at once (no delayed ACK on reused connections).

An upstream that does not set TCP_NODELAY (SGLang's router) holds each small write until its previous one is
acknowledged; with Linux's delayed ACKs on a reused keep-alive connection, every streamed event would wait up to
40 ms (``python -m benchmarks compare --upstream stub --router --quickack`` measures it). The kernel reports the
connection's mode through ``getsockopt(TCP_QUICKACK)``: 1 while reads are acknowledged at once.
"""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest

from gateway.data.upstream_session import QuickAckResponseHandler, upstream_session

pytestmark = pytest.mark.skipif(not hasattr(socket, "TCP_QUICKACK"), reason="TCP_QUICKACK is Linux-only")


async def _sse_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A keep-alive HTTP/1.1 server answering each request with two SSE events, 20 ms apart."""
    try:
        while True:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            writer.write(b"9\r\ndata: a\n\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.02)
            writer.write(b"9\r\ndata: b\n\n\r\n0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


async def _ack_modes(session: aiohttp.ClientSession, url: str, requests: int) -> list[tuple[type, int]]:
    """Per request on one pooled connection: its protocol class, and the ACK mode after the first event arrived."""
    modes = []
    for _ in range(requests):
        async with session.get(url) as response:
            assert response.connection is not None
            sock = response.connection.transport.get_extra_info("socket")
            protocol = type(response.connection.protocol)
            await response.content.readany()
            modes.append((protocol, sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK)))
            await response.read()
    return modes


def test_reused_upstream_connections_acknowledge_reads_at_once() -> None:
    async def main() -> tuple[list[tuple[type, int]], list[tuple[type, int]]]:
        server = await asyncio.start_server(_sse_server, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector()) as plain:
                baseline = await _ack_modes(plain, url, 5)
            async with upstream_session(5.0, 30.0, 8) as session:
                ours = await _ack_modes(session, url, 5)
        finally:
            server.close()
            await server.wait_closed()
        return baseline, ours

    baseline, ours = asyncio.run(main())
    if baseline[-1][1] != 0:  # aiohttp's own connections fall into delayed ACKs once reused (Linux): the penalty
        pytest.skip(f"this kernel does not delay ACKs on a reused connection: {baseline}")
    assert all(protocol is QuickAckResponseHandler and mode == 1 for protocol, mode in ours), ours
