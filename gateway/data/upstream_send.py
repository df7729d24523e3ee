"""One request's bytes to an upstream and its answer back: a plain request over the pooled ``aiohttp`` session
(:mod:`gateway.data.upstream_session`), a stream over its own connection (:mod:`gateway.data.stream_pool`)."""

from __future__ import annotations

import aiohttp
from yarl import URL

from gateway.core.backends import Backend
from gateway.data.lease import Lease
from gateway.data.stream_pool import StreamExchange, StreamPool, UpstreamPoolFull

Answer = tuple[aiohttp.ClientResponse | StreamExchange, bytes | None]


class UpstreamSender:
    """Sends requests upstream: plain ones over one shared, pooled session, streams over ``streams``."""

    def __init__(self, session: aiohttp.ClientSession, streams: StreamPool) -> None:
        self.session = session
        self.streams = streams
        self.max_connections: int | None = getattr(session.connector, "limit", 0) or None
        self._plain_busy = 0  # plain requests upstream now (the session's connections they hold)
        self._urls: dict[str, URL] = {}

    def url(self, text: str) -> URL:
        """``text`` parsed once (a URL per backend and path, reused by every request)."""
        url = self._urls.get(text)
        if url is None:
            if len(self._urls) > 1024:  # backends come and go with swaps; never grow without bound
                self._urls.clear()
            url = self._urls[text] = URL(text)
        return url

    async def send(self, lease: Lease, backend: Backend, path: str, payload: bytes, headers: dict[str, str], streamed: bool) -> Answer:
        """The upstream's answer, held by ``lease``: a plain one read whole; a 200 stream's head (its events are
        relayed by :class:`gateway.data.relay.SSEProxyResponse`), an error stream read whole."""
        if streamed:
            quickack = not backend.sends_at_once
            exchange = lease.upstream = await self.streams.request(backend.url, path, payload, headers, quickack=quickack)
            return exchange, await exchange.read() if exchange.status != 200 else None
        self._plain_busy += 1
        try:
            upstream = lease.upstream = await self.session.post(self.url(backend.url + path), data=payload, headers=headers)
            return upstream, await upstream.read()
        except aiohttp.ConnectionTimeoutError:
            if self.max_connections is not None and self._plain_busy > self.max_connections:
                # the wait was for one of the session's connections, not for the engine
                raise UpstreamPoolFull(f"all {self.max_connections} upstream connections (upstream_max_connections) were busy") from None
            raise
        finally:
            self._plain_busy -= 1
