"""The pooled aiohttp session plain requests go upstream on: keep-alive under the engines' own, no cookies,
no status raising, and an ACK of every upstream read at once (``TCP_QUICKACK``, shared with the stream pool)."""

from __future__ import annotations

import asyncio
import functools
import socket
from typing import Any

import aiohttp
from aiohttp.client_proto import ResponseHandler

from gateway.data.stream_pool import (
    KEEPALIVE_S,
    QuickAck,
)

# Idle upstream connections are kept this long (both pools): under the 5 s keep-alive of uvicorn (SGLang's
# server), so the gateway never reuses a connection the engine is closing (aiohttp does not retry a POST on one).
UPSTREAM_KEEPALIVE_S = KEEPALIVE_S


class QuickAckResponseHandler(ResponseHandler):
    """aiohttp's connection protocol, acknowledging every upstream read at once (:class:`gateway.data.stream_pool.QuickAck`)."""

    _ack: QuickAck | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._ack = QuickAck(transport)

    def data_received(self, data: bytes) -> None:
        if self._ack is not None:
            self._ack.rearm()
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._ack is not None:
            self._ack.close()
        super().connection_lost(exc)


class QuickAckConnector(aiohttp.TCPConnector):
    """A ``TCPConnector`` whose connections use :class:`QuickAckResponseHandler` (aiohttp has no public hook
    for the protocol; a test checks that this one still takes effect)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._factory = functools.partial(QuickAckResponseHandler, loop=self._loop)


def upstream_session(connect_timeout_s: float, read_timeout_s: float, max_connections: int | None) -> aiohttp.ClientSession:
    """The one pooled ``aiohttp.ClientSession`` that forwards plain requests (create it inside the event loop;
    streams go over :class:`gateway.data.stream_pool.StreamPool`).

    Connections are kept alive and reused, up to ``max_connections`` at once when set, else without a cap
    (no per-host cap and no smaller keep-alive cap: every concurrency level reuses its connections). ``connect_timeout_s``
    bounds the wait for a pooled connection plus the TCP connect; ``read_timeout_s`` is the longest
    silence between upstream bytes (response headers included); there is no total timeout, a
    stream lasts as long as the engine keeps sending. Reads are acknowledged at once where the OS
    allows it (:class:`QuickAckResponseHandler`): a router's stream events then never wait for a delayed ACK.
    """
    connector_class = QuickAckConnector if hasattr(socket, "TCP_QUICKACK") else aiohttp.TCPConnector
    connector = connector_class(
        limit=max_connections or 0, limit_per_host=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S, ttl_dns_cache=300
    )
    timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s, sock_connect=connect_timeout_s, sock_read=read_timeout_s)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        trust_env=False,  # no proxy variables: engines are reached directly
        auto_decompress=False,  # bytes are relayed as the engine sent them (we ask for no encoding)
        skip_auto_headers=("Accept-Encoding", "User-Agent"),
        cookie_jar=aiohttp.DummyCookieJar(),
        raise_for_status=False,
    )
