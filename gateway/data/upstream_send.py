"""One request's bytes to an upstream and its answer back, over a pooled connection (:mod:`gateway.data.stream_pool`):
a stream relayed as it comes, a plain answer read whole."""

from __future__ import annotations

from gateway.core.backends import Backend
from gateway.data.lease import Lease
from gateway.data.stream_pool import StreamExchange, StreamPool

Answer = tuple[StreamExchange, bytes | None]


class UpstreamSender:
    """Sends requests upstream over pooled keep-alive connections parsed in their socket's callbacks: streams over
    ``streams``, plain requests over ``plain`` (the same client, a pool of its own: ``upstream_max_connections``
    caps each pool). Not aiohttp for plain requests: its request, response and stream objects cost an agent's plain
    request about a quarter of the gateway's Python, for an answer read whole either way."""

    def __init__(self, streams: StreamPool, plain: StreamPool) -> None:
        self.streams = streams
        self.plain = plain

    async def send(self, lease: Lease, backend: Backend, path: str, payload: bytes, headers: dict[str, str], streamed: bool) -> Answer:
        """The upstream's answer, held by ``lease``: a plain one read whole; a 200 stream's head (its events are
        relayed by :class:`gateway.data.relay.SSEProxyResponse`), an error stream read whole."""
        if streamed:
            quickack = not backend.sends_at_once
            exchange = lease.upstream = await self.streams.request(backend.url, path, payload, headers, quickack=quickack)
            return exchange, await exchange.read() if exchange.status != 200 else None
        exchange = lease.upstream = await self.plain.request(backend.url, path, payload, headers)
        return exchange, await exchange.read()
