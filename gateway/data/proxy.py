"""Forward one validated request to its model's backend, plain or streaming, in the route's dialect.

A request (:class:`~gateway.core.call.Call`, built once at the edge) passes three stages, each in a module of its
own: admission (:mod:`gateway.data.admission`: checks, its model's slot, a grammar slot), the exchange
(:mod:`gateway.data.exchange`: a replica, one retry elsewhere when nothing reached the client) and the answer
(:mod:`gateway.data.answer`: plain JSON, or the SSE relay). The body goes upstream as the client sent it, with only
``model`` rewritten to the engine's served name. What a request holds is its :class:`~gateway.data.lease.Lease`;
a model whose engine is asleep is woken first (:mod:`gateway.data.waking` keeps a stream's client company).
"""

from __future__ import annotations

import aiohttp
from starlette.responses import Response
from yarl import URL

from gateway.core.backends import Backend
from gateway.core.call import Call
from gateway.core.context import RequestInfo
from gateway.core.errors import GatewayError, upstream_error
from gateway.core.metrics import Metrics
from gateway.core.poison import Quarantine
from gateway.core.registry import Registry
from gateway.core.responses_index import ResponseIndex
from gateway.core.state import Waker
from gateway.core.tracing import Tracing
from gateway.data.admission import admit
from gateway.data.answer import answer
from gateway.data.exchange import exchange
from gateway.data.grammar_costs import GrammarCosts
from gateway.data.relay import SSEProxyResponse
from gateway.data.stream_pool import StreamPool
from gateway.data.upstream_errors import UPSTREAM_ERRORS, transport_error
from gateway.data.upstream_send import UpstreamSender
from gateway.data.waking import WakingStreamResponse


class Proxy:
    """Forwards requests upstream over pooled connections parsed in their socket's callbacks
    (:mod:`gateway.data.stream_pool`): streams over ``streams`` (relayed as they come), plain requests over ``plain``.
    ``session`` (aiohttp) serves the calls off the request path: a stored response by id, a prompt counted."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        metrics: Metrics,
        quarantine: Quarantine | None = None,
        responses: ResponseIndex | None = None,
        streams: StreamPool | None = None,
        waker: Waker | None = None,
        tracing: Tracing | None = None,
        registry: Registry | None = None,
        grammar_costs: GrammarCosts | None = None,
        plain: StreamPool | None = None,
    ) -> None:
        self.session = session
        self.grammar_costs = grammar_costs  # the grammar compile budget (None: grammars are not measured)
        self.registry = registry  # the routes now: an adapter unloaded while a request queued is not sent
        self.tracing = tracing  # OpenTelemetry spans (gateway.core.tracing); None: off, and nothing noted
        self.waker = waker  # models whose engines start on demand: a request for one asleep waits for it
        self.streams = streams if streams is not None else StreamPool(5.0, 600.0)
        self.plain = plain if plain is not None else StreamPool(5.0, 600.0, plain=True)
        self.sender = UpstreamSender(self.streams, self.plain)
        self._urls: dict[str, URL] = {}
        self.metrics = metrics
        self.quarantine = quarantine if quarantine is not None else Quarantine()
        self.responses = responses if responses is not None else ResponseIndex()

    async def forward(self, call: Call) -> Response:
        """Admit ``call``, send it, and answer plain JSON or an SSE stream (waking its model's engine first if asleep).

        A stream for an asleep model answers at once, with keep-alives until the engine is up; any other request
        waits for it, counted as the model's user so that the idle model is never stopped under it.
        """
        if self.tracing is not None:
            call.notes = self.tracing.notes(call.info.trace)
        waker = self.waker
        if waker is None or not waker.manages(call.route.name):
            return await self._forward(call)
        if call.route.asleep and call.endpoint.stream is not None and call.body.get("stream") is True:
            call.info.stream = True
            return WakingStreamResponse(waker, call, self._forward)
        call.route = await waker.enter(call.route, call.owner)
        try:
            return await self._forward(call)
        finally:
            waker.leave(call.route.name)

    async def _forward(self, call: Call) -> Response:
        """The stages: admission, the exchange, the answer. The lease goes with a stream to its relay; else it ends here."""
        lease = await admit(call, self.registry, self.grammar_costs)
        try:
            exchanged = await exchange(call, lease, self.sender, self.quarantine, self.metrics)
            response = await answer(call, lease, exchanged, self.session, self.metrics, self.responses)
        except BaseException:
            lease.close()
            raise
        if not isinstance(response, SSEProxyResponse):
            lease.close()
        return response

    async def call_backend(self, model: str, backend: Backend, method: str, path: str, info: RequestInfo) -> Response:
        """A body-less call to one given backend (a stored response, by id), errors mapped like any request's."""
        reason = backend.unavailable_reason()
        if reason is not None:
            raise GatewayError(503, f"model {model!r} is unavailable: {reason}", code="engine_unavailable", headers={"Retry-After": "1"})
        headers = {"X-Request-Id": info.request_id, **backend.upstream_headers()}
        try:
            async with self.session.request(method, self._url(backend.url + path), headers=headers) as upstream:
                content = await upstream.read()
                media = upstream.headers.get("Content-Type", "application/json")
        except UPSTREAM_ERRORS as error:
            raise transport_error(error, model) from None
        if upstream.status != 200:
            raise upstream_error(upstream.status, content)
        return Response(content, status_code=200, media_type=media)

    def _url(self, text: str) -> URL:
        """``text`` parsed once (a URL per backend and path, reused by every call)."""
        url = self._urls.get(text)
        if url is None:
            if len(self._urls) > 1024:  # backends come and go with swaps; never grow without bound
                self._urls.clear()
            url = self._urls[text] = URL(text)
        return url
