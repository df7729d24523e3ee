"""A stream for a model whose engine is asleep (residency): its 200 and SSE comments go out at once and every
:data:`KEEPALIVE_S` while the engine starts, so that no proxy or client cuts a quiet connection during a cold
start; then the engine's own stream follows on the same response.

SSE comments (lines starting with ``:``) are ignored by every SSE client (the OpenAI and Anthropic SDKs
included). A start that fails or outlasts its bound (the engine's ``startup_timeout_s``, plus the group's
``turn_s``), and any refusal after it, end the stream with the
error event of the route's framing, as a failure after the 200 does in the relay.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from gateway.core.call import Call
from gateway.core.errors import GatewayError, StreamKind, sse_error_event
from gateway.core.state import Waker
from gateway.data.relay import SSE_HEADERS, wait_disconnect

KEEPALIVE_S = 5.0


class WakingStreamResponse(Response):
    """Waits for the engine of ``call``'s model with keep-alives, then answers with what ``forward`` makes of ``call``
    on the woken route."""

    def __init__(self, waker: Waker, call: Call, forward: Callable[[Call], Awaitable[Response]]) -> None:
        super().__init__(status_code=200, media_type="text/event-stream")
        self.waker, self.call, self.forward = waker, call, forward
        self.kind = call.endpoint.stream or StreamKind.DATA

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:  # type: ignore[override]
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        call = self.call
        comment = f": model {call.route.name} is starting for this request\n\n".encode()
        waking = asyncio.ensure_future(self.waker.enter(call.route, call.owner))  # its cold starts count (wakes_per_key_per_hour)
        gone = asyncio.ensure_future(wait_disconnect(receive))
        try:
            while not waking.done():
                await send({"type": "http.response.body", "body": comment, "more_body": True})
                await asyncio.wait({waking, gone}, timeout=KEEPALIVE_S, return_when=asyncio.FIRST_COMPLETED)
                if gone.done():
                    waking.cancel()  # the start goes on for the next request; this one left
                    call.info.error = "client disconnected while its model started"
                    return
        finally:
            gone.cancel()
        try:
            call.route = waking.result()
        except GatewayError as error:
            await self._fail(send, error)
            return
        try:
            response = await self.forward(call)
        except GatewayError as error:
            await self._fail(send, error)
            return
        finally:
            self.waker.leave(call.route.name)
        if response.status_code != 200:  # the client went away meanwhile (499): nothing more to say
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        await response(scope, receive, _after_start(send))

    async def _fail(self, send: Send, error: GatewayError) -> None:
        self.call.info.error = error.log_detail or error.message
        await send({"type": "http.response.body", "body": sse_error_event(error, self.kind), "more_body": False})


def _after_start(send: Send) -> Send:
    """``send`` without the second response start (this response's went out first)."""

    async def sending(message: Message) -> None:
        if message["type"] != "http.response.start":
            await send(message)

    return sending
