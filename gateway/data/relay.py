"""The SSE relay: one upstream stream to one client, event by event, from the socket's callbacks.

Events go out as the engine framed them (complete ``\\n\\n``-terminated events); only those that carry usage, an
engine error or a Responses id are parsed. A client that goes away closes the upstream (the engine aborts);
an upstream failure after the 200 ends the stream with an error event framed like the route's own, and a
stream cut short ends on an event boundary.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from typing import Any

import orjson
from loguru import logger
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from gateway.core.context import RequestInfo
from gateway.core.errors import GatewayError, StreamKind, sanitize_message, sse_error_event, upstream_error
from gateway.core.metrics import Metrics
from gateway.core.tracing import finish_reasons
from gateway.data.event_scan import count_events, find_any
from gateway.data.lease import Lease
from gateway.data.native_streams import NativeTotals
from gateway.data.prompt_count import PromptCounter
from gateway.data.stream_pool import (
    StreamExchange,
)
from gateway.data.upstream_errors import transport_error
from gateway.data.usage_request import prompt_bound
from gateway.edge.cycle import HTTP_CYCLE, CancelOnLeave

_MAX_PENDING = 4 * 1024 * 1024  # an SSE event larger than this is forwarded unsplit, unscanned


SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


_DONE = b"data: [DONE]\n\n"


_USAGE = (b'"usage":{', b'"usage": {')


# How a complete stream ends, by framing: a stream that stops before one of these (a router or engine that
# closed it cleanly in the middle) ends with the gateway's error event instead.
_ENDINGS: dict[StreamKind, tuple[bytes, ...]] = {
    StreamKind.DATA: (_DONE[:-2], b'data: {"error":'),
    StreamKind.RESPONSES: (b'"type":"response.completed"', b'"type":"response.incomplete"', b'"type":"response.failed"', b"event: error"),
    StreamKind.ANTHROPIC: (b"event: message_stop", b"event: error"),
}


# What says a stream is finishing: its last events (usage, the end) follow at once, so a read carrying one is not
# followed by a coalescing rest (``stream_coalesce_ms``) and the end, and the engine's slot, come without the wait.
# Searched only when a rest would follow the read (the process is behind): a separate pass then, and none while it
# keeps up (in the scan above, it cost every read ~0.25 µs). One missed costs one rest, nothing else.
_FINISH: dict[StreamKind, re.Pattern[bytes]] = {
    StreamKind.DATA: re.compile(rb'finish_reason": ?"|data: \[DONE\]'),
    StreamKind.RESPONSES: re.compile(rb'type": ?"response\.(?:completed|[a-z_]+\.done)"|data: \[DONE\]'),  # output_text.done .. the end
    StreamKind.ANTHROPIC: re.compile(rb'type": ?"message_(?:delta|stop)"|data: \[DONE\]'),
}


# What makes an event worth parsing (a usage object, an engine error, a new Responses id), by stream framing: one scan
# of each read for the first of these (gateway.data.event_scan), and the same strings in the native relay
# (gateway.data.native_streams). Engines put ``"usage":null`` in every chunk, so only an object counts, and Responses
# events all carry ``"error":null`` (tests/gateway/test_native_relay.py holds them to what they stand for).
_NEEDLES: dict[StreamKind, tuple[bytes, ...]] = {
    StreamKind.DATA: (b'"usage":{', b'"usage": {', b'"error"'),
    StreamKind.RESPONSES: (
        b'"usage":{', b'"usage": {', b'"error":{', b'"error": {', b'"type":"error"', b'"type": "error"', b'"response.created"',
    ),  # fmt: skip
    StreamKind.ANTHROPIC: (b'"usage":{', b'"usage": {', b'"type":"error"', b'"type": "error"'),
}
_KIND_INDEX = {kind: index for index, kind in enumerate(StreamKind)}
_NATIVE_NEEDLES = [list(_NEEDLES[kind]) for kind in StreamKind]
_NATIVE_POLL_S = 0.005  # a parked native stream whose client still has bytes buffered looks again this often
# A stream goes to the native relay at its first read this long after its first: one still coming in by then is a
# long one (a decode loop's next step). An answer that comes whole at once (a short one, a cached one) ends in Python:
# handing it over (two duplicated sockets, the thread woken per read, its end reported back) would cost it ~50 µs.
_NATIVE_AFTER_S = 0.01


_SEQUENCE_NUMBER = re.compile(rb'"sequence_number": ?(\d+)')


class SSEProxyResponse(Response):
    """An ASGI response relaying an upstream SSE stream; owns the upstream exchange and admission slot.

    The relay runs in the upstream socket's callbacks (:meth:`StreamExchange.relay`): each body piece is cut
    at event boundaries, scanned, and written to the client at once. Under the gateway's own uvicorn protocol
    the events go straight to the client's transport (:class:`_TransportWriter`, honouring its flow control);
    under any other ASGI server they go out as ASGI messages (:class:`_MessageWriter`). Either way the
    response's start and its last message pass through the middlewares as ASGI messages.
    """

    # What every stream starts with (class defaults, assigned per stream only once they change)
    status_code, media_type, background, body = 200, "text/event-stream", None, b""
    events = 0  # events relayed: a stream that ends without the engine's usage is charged by them
    _uncounted = False  # the prompt is still to be counted, once the client has what it gets
    _last = (b"", b"")  # the last two pieces written before [DONE]: where a stream's finish and ending are
    _done = b""  # the piece that ended with [DONE] (written as it came): kept apart, so _last still names the finish
    _pending = b""  # a partial event held back until its end comes
    _writer: _TransportWriter | _MessageWriter | None = None
    _native_tries = False  # hand the stream to the native relay once it shows itself a long one
    _first_read_at = 0.0

    def __init__(
        self,
        lease: Lease,
        info: RequestInfo,
        metrics: Metrics,
        model: str,
        kind: StreamKind = StreamKind.DATA,
        on_created: Callable[[str], None] | None = None,
        request: dict[str, Any] | None = None,
        hide_usage: bool = False,
        count_prompt: PromptCounter | None = None,
    ) -> None:
        # (not Response.__init__: its body and headers are never sent, __call__ sends the start itself; the state every
        # stream starts with is the class's, above)
        self.raw_headers = list(SSE_HEADERS)
        assert isinstance(lease.upstream, StreamExchange)
        self.upstream: StreamExchange = lease.upstream
        self.lease = lease
        self.info = info
        self.metrics = metrics
        self.model = model
        self.kind = kind
        self.on_created = on_created  # told the id of a Responses API response when its creation event passes
        self.request = request  # the body sent: an engine error event may be about its input (gateway.core.client_mistakes)
        self.hide_usage = hide_usage  # the gateway asked for the usage event, the client did not: it is not forwarded
        self.count_prompt = count_prompt  # ... and its prompt counted by the engine's tokenizer, where it can say
        self._needles = _NEEDLES[kind]
        self._finish = _FINISH[kind]
        self._endings = _ENDINGS[kind]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:  # type: ignore[override]
        # The response's task waits for the end; the client leaving meanwhile cancels it.
        on_gone = CancelOnLeave()

        def on_watch_done(watch: asyncio.Task[None]) -> None:
            if not watch.cancelled() and watch.exception() is None:
                on_gone()

        cycle = scope.get("extensions", {}).get(HTTP_CYCLE)
        # An answer that came whole (a short one) is relayed and ended without waiting on anything: nothing to watch.
        # Under the gateway's own protocol its connection says when the client leaves; elsewhere a task waits for it.
        watch = None
        if not self.upstream.is_complete:
            if cycle is not None:
                cycle.on_disconnect(on_gone)
            else:
                watch = asyncio.ensure_future(wait_disconnect(receive))
                watch.add_done_callback(on_watch_done)
        head: _HeadWithFirstWrite | None = None
        try:
            if cycle is not None:  # the start's bytes go out with the first events, in one write
                head = _HeadWithFirstWrite(cycle)
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            if head is not None:
                head.hold()
            writer = _TransportWriter(cycle, self.upstream) if cycle is not None else _MessageWriter(send, self.upstream)
            await self._pump(writer, send)
        except asyncio.CancelledError:
            if not on_gone.was_the_cause():
                raise
            self.upstream.leave_native()  # (what the native relay relayed: the stream's end, when it had come)
            last = self._last_events()
            if find_any(last, self._endings, 0) < 0:
                self.info.error = "client disconnected"
            else:  # it left once it had the stream's end (before the body's own end came): a complete stream
                self._end_trace(last)
        finally:
            self.upstream.leave_native()  # (a stream cut here: the events the native relay counted first)
            if on_gone.gone:
                self._charge_unreported()
            on_gone.done()
            if cycle is not None:
                cycle.on_disconnect(None)
            if watch is not None:
                watch.remove_done_callback(on_watch_done)
                watch.cancel()
            if head is not None:
                head.release()  # (a stream cut before any write: what the client gets is as before, the head alone)
            self.lease.close()  # a stream cut short closes the upstream connection: the engine aborts the request
            if self._uncounted:
                await self._count_the_prompt()

    def _on_data(self, chunk: bytes) -> None:
        """One upstream body piece, in the socket's callback: whole events go to the client at once."""
        writer = self._writer
        try:
            info = self.info
            if info.ttft_s is None:
                self._first_read_at = time.perf_counter()
                info.ttft_s = self._first_read_at - info.started
                self.lease.release_grammar()
            events = self._complete_events(chunk)
            if not events:
                return
            self.events += count_events(events)
            writer.write(events)  # [DONE] too: the client's stream ends when the engine's does, not at its body's close
            if events.endswith(_DONE):
                self._done = events
            else:
                self._last = (self._last[1], events)
            if self._native_tries and time.perf_counter() - self._first_read_at >= _NATIVE_AFTER_S:
                self._go_native()
        except Exception as error:  # a bug here must end this stream, not the upstream socket's callback
            logger.exception("relay: the stream of {} failed", self.model)
            writer.finish(_RelayFailed(error))

    def _says_finishing(self, read: bytes) -> bool:
        """Whether an upstream read shows the stream finishing (a finish reason, the end): the pool then reads on
        without a rest. Asked only when a rest would follow the read."""
        return self._finish.search(read) is not None

    async def _pump(self, writer: _TransportWriter | _MessageWriter, send: Send) -> None:
        self._writer = writer
        self._native_tries = isinstance(writer, _TransportWriter) and self.upstream.can_go_native
        self.upstream.relay(self._on_data, writer.finish, self._says_finishing)
        error = await writer.wait()
        held = writer.take_held() if isinstance(writer, _TransportWriter) else b""
        failure: GatewayError | None = None
        if isinstance(error, _RelayFailed):
            failure = GatewayError(500, "the gateway failed relaying the stream", code="internal_error")
        elif error is not None:
            if self.info.ttft_s is None:  # a stream that already produced tokens got past the prefill: not a suspect
                self.lease.note_if_lost(error)
            failure = transport_error(error, self.model)
        # The engine is done with this request: give back its slot now, not once a slow client has read
        # the rest (a client that stops reading is cut off by the HTTP layer's write timeout).
        self.lease.close()
        tail = b""
        if self._pending:
            tail += self._last_partial_event(self._pending)
            self._pending = b""
        # Scanned here, not per event: a stream's ending is its last event (a scan per event cost ~1-4 µs).
        last = self._last_events() + tail
        ended = find_any(last, self._endings, 0) >= 0
        if failure is None and not ended:
            failure = GatewayError(
                502, f"the stream from the engine of {self.model} stopped before its end", code="upstream_stream_incomplete"
            )
        self._charge_unreported()
        self._end_trace(last)
        if failure is not None:
            self.info.error = failure.log_detail or failure.message
            self.info.error_code = failure.code
            self.metrics.child(self.metrics.stream_errors, self.model).inc()
            tail += sse_error_event(failure, self.kind, self._next_sequence_number(tail))
        await send({"type": "http.response.body", "body": held + tail if held else tail, "more_body": False})

    def _next_sequence_number(self, tail: bytes = b"") -> int:
        """Responses: the number after the highest one the engine gave the events sent last (they count from 0), for
        the error event that ends a failed stream; 0 when none came. Read at the end, not counted per read, from the
        last pieces written: the one that ended with [DONE] and ``tail`` (a partial last event) included, as either
        may hold the highest."""
        numbers = _SEQUENCE_NUMBER.findall(self._last_events() + tail)
        return max(map(int, numbers)) + 1 if numbers else 0

    def _last_events(self) -> bytes:
        """The last pieces written (where a stream's finish, usage and ending are)."""
        return b"".join((*self._last, self._done))

    def _end_trace(self, last: bytes) -> None:
        trace = self.info.trace
        if trace is not None and trace.attempts:
            trace.attempts[-1].ended = time.perf_counter()
            trace.finish_reasons = finish_reasons(last)

    # ------------------------------------------------------------------ the native relay (gateway.data.native_streams)
    def _go_native(self) -> None:
        """After a write, in the upstream read's callback: hand the rest of the stream to the native relay, once the
        client's transport holds nothing (the thread writes to its socket) and nothing pauses the stream."""
        writer = self._writer
        assert isinstance(writer, _TransportWriter)
        cycle = writer.cycle
        transport = cycle.transport
        if writer.draining is not None or cycle.disconnected or isinstance(transport, _HeadWithFirstWrite):
            return
        if transport.is_closing() or transport.get_write_buffer_size():
            return
        sock = transport.get_extra_info("socket")
        if sock is None or transport.get_extra_info("sslcontext") is not None:  # (TLS: the thread writes plain bytes)
            self._native_tries = False
            return
        kind = _KIND_INDEX[self.kind]
        if self.upstream.go_native(sock.fileno(), self._pending, _NATIVE_NEEDLES, kind, bool(cycle.chunked_encoding), self):
            self._pending = b""
            self._native_tries = False
        elif not self.upstream.can_go_native:
            self._native_tries = False

    def native_inspect(self, events: bytes) -> None:
        """Events the native relay found a usage object, an error or a Responses id in: parsed and written here."""
        writer = self._writer
        assert isinstance(writer, _TransportWriter)
        try:
            out = self._inspect(events)
            self.events += count_events(out)
            if out:
                writer.write(out)
        except Exception as error:  # a bug here must end this stream, not the loop's report callback
            logger.exception("relay: the stream of {} failed", self.model)
            writer.finish(_RelayFailed(error))
            return
        self._resume_native()

    def native_blocked(self, unsent: bytes) -> None:
        """The client's socket took part of a native write: the rest goes through the transport (its flow control
        and write timeout); the thread writes again once it has drained."""
        writer = self._writer
        assert isinstance(writer, _TransportWriter)
        if not writer.cycle.disconnected:
            writer.cycle.transport.write(unsent)
        self._resume_native()

    def native_gone(self, errno: int) -> None:
        """The client's socket failed under a native write: the connection is closed (the disconnect ends the stream)."""
        writer = self._writer
        assert isinstance(writer, _TransportWriter)
        writer.cycle.transport.abort()

    def native_ended(self, outcome: str, detail: str, reusable: bool, totals: NativeTotals) -> None:
        self.native_totals(totals)
        self.upstream.native_ended(outcome, detail, reusable)

    def native_totals(self, totals: NativeTotals) -> None:
        self.events += totals.events
        if totals.last:  # (after the pieces written here: the thread may have relayed only the end, the finish before it)
            self._last, self._done = (b"".join((*self._last, self._done)), totals.last), b""
        self._pending = totals.pending

    def _resume_native(self, since: float | None = None) -> None:
        """Let the native relay write again once the client's transport holds nothing; a client that takes nothing
        for the HTTP write timeout is disconnected, as it would be under a Python write."""
        native = self.upstream.native
        writer = self._writer
        if native is None or not isinstance(writer, _TransportWriter):
            return
        cycle = writer.cycle
        transport = cycle.transport
        if cycle.disconnected or transport.is_closing():
            return
        if not transport.get_write_buffer_size():
            native[0].resume(native[1])
            return
        loop = asyncio.get_running_loop()
        since = loop.time() if since is None else since
        limits = getattr(transport.get_protocol(), "limits", None)
        if limits is not None and loop.time() - since > limits.write_timeout_s:
            transport.abort()  # (the protocol's own timer covers a paused transport; this one, any bytes left)
            return
        loop.call_later(_NATIVE_POLL_S, self._resume_native, since)

    def _charge_unreported(self) -> None:
        """A stream that ended without the engine's usage (cut by the client, failed midway): its completion is
        the events relayed (SGLang sends one per token, plus a few framing events: docs/tenants.md), its prompt
        what the engine's tokenizer counts (:mod:`gateway.data.prompt_count`, once the client has its answer) when
        the engine did not say it (Messages' ``message_start`` does, but for a short answer as 0), else the bound on
        it (the body's bytes)."""
        info = self.info
        if info.completion_tokens is None:
            info.completion_tokens = self.events
        if info.prompt_tokens == 0 and self.kind is StreamKind.ANTHROPIC:
            # SGLang's Messages stream says input_tokens 0 when its first content chunk came without usage (a short
            # answer): no rendered prompt is empty, so the engine did not say it
            info.prompt_tokens = None
        if info.prompt_tokens is None:
            if self.count_prompt is not None:
                self._uncounted = True
            else:
                info.prompt_tokens = self._prompt_bound()

    async def _count_the_prompt(self) -> None:
        self._uncounted = False
        assert self.count_prompt is not None
        counted = await self.count_prompt()
        if self.info.prompt_tokens is None:
            self.info.prompt_tokens = counted if counted is not None else self._prompt_bound()

    def _prompt_bound(self) -> int | None:
        info, sent = self.info, self.lease.request
        return info.prompt_estimate if info.prompt_estimate is not None else prompt_bound(len(sent[1])) if sent else None

    def _last_partial_event(self, pending: bytes) -> bytes:
        """What follows the last blank line when the upstream body ended: the stream's own last event as it
        is; otherwise whole lines go out (an event whose closing blank line never came), closed with one, and a
        line cut short is dropped, so that the error event after it starts on an event boundary instead of
        inside a broken JSON line."""
        if find_any(pending, self._endings, 0) >= 0:
            return self._inspect(pending)  # the stream's own last event, without its closing blank line
        whole = pending[: pending.rfind(b"\n") + 1]
        if not whole.strip():
            return b""
        return self._inspect(whole) + b"\n"  # ``whole`` ends with one newline (pending follows the last blank line)

    def _complete_events(self, chunk: bytes) -> bytes:
        """The complete events received so far (held back: a partial event at the end)."""
        data = self._pending + chunk if self._pending else chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            if len(data) > _MAX_PENDING:
                self._pending = b""
                return data
            self._pending = data
            return b""
        if cut + 2 == len(data):  # the usual piece: whole events, nothing to copy or hold back
            self._pending = b""
            return self._inspect(data)
        self._pending = data[cut + 2 :]
        return self._inspect(data[: cut + 2])

    def _inspect(self, events: bytes) -> bytes:
        """Byte scans only; JSON is parsed just for the lines carrying a usage object, an error or a new response."""
        needles = self._needles
        at = find_any(events, needles, 0)
        if at < 0:
            return events
        out = []
        start = 0
        while at >= 0:
            line_start = events.rfind(b"\n", 0, at) + 1
            line_end = events.find(b"\n", at)
            line_end = len(events) if line_end < 0 else line_end
            line = events[line_start:line_end]
            out.append(events[start:line_start])
            kept = self._inspect_line(line) if line.startswith(b"data: {") else line
            if kept is None:  # an event the client did not ask for: the line and the blank line closing it go
                if events.startswith(b"\n\n", line_end):
                    line_end += 2
                kept = b""
            out.append(kept)
            start = line_end
            at = find_any(events, needles, start)
        out.append(events[start:])
        return b"".join(out)

    def _inspect_line(self, line: bytes) -> bytes | None:
        """The line as it goes to the client; None: the usage event the client did not ask for."""
        try:
            data = orjson.loads(line[6:])
        except orjson.JSONDecodeError:
            return line
        if not isinstance(data, dict):
            return line
        self.info.set_usage(_usage_of(data))
        if self.hide_usage and data.get("choices") == [] and isinstance(data.get("usage"), dict):
            return None
        if self.kind is not StreamKind.DATA:
            return self._inspect_event(line, data)
        error = data.get("error")
        if error is not None and "choices" not in data:
            detail = error if isinstance(error, dict) else {"message": error}
            status = detail.get("code") if isinstance(detail.get("code"), int) else 500
            sanitized = upstream_error(status, orjson.dumps({"error": {**detail, "message": sanitize_message(detail.get("message"))}}), self.request)
            self.info.error = sanitized.log_detail or sanitized.message
            self.info.error_code = sanitized.code
            return sse_error_event(sanitized).rstrip(b"\n")
        return line

    def _inspect_event(self, line: bytes, data: dict[str, Any]) -> bytes:
        """Responses / Anthropic events: note a created response's id; sanitize an engine error in place."""
        if data.get("type") == "response.created" and self.on_created is not None:
            response = data.get("response")
            if isinstance(response, dict) and isinstance(response.get("id"), str):
                self.on_created(response["id"])
        holders = [data] if data.get("type") == "error" and "message" in data else []
        response = data.get("response")
        inner = response.get("error") if isinstance(response, dict) else None  # an engine may send anything there
        holders += [value for value in (data.get("error"), inner) if isinstance(value, dict)]
        if not holders:
            return line
        for holder in holders:
            holder["message"] = sanitize_message(holder.get("message"))
            self.info.error = self.info.error or holder["message"][:300]
        return b"data: " + orjson.dumps(data)


def _usage_of(data: dict[str, Any]) -> Any:
    """The usage object of an event: top level (chat, Anthropic deltas) or in the object it carries
    (Responses' ``response``, Anthropic's ``message_start.message``)."""
    usage = data.get("usage")
    if usage is None:
        for key in ("response", "message"):
            inner = data.get(key)
            if isinstance(inner, dict) and isinstance(inner.get("usage"), dict):
                return inner["usage"]
    return usage


async def wait_disconnect(receive: Receive) -> None:
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            return


class _RelayFailed(Exception):
    """The relay itself raised (a bug): the stream ends with a 500 error event."""


class _HeadWithFirstWrite:
    """Stands in for the client's transport from the response's start to its first write (uvicorn writes the
    status line and headers at once, the relay then writes the events): the start's bytes are kept and go out
    in front of the first events, or of the end, in one write. One system call and one segment less per stream,
    and the client wakes once; the head reaches the client with the first event rather than before it."""

    __slots__ = ("cycle", "transport", "head", "holding")

    def __init__(self, cycle: Any) -> None:
        self.cycle = cycle
        self.transport = cycle.transport
        self.head: list[bytes] = []
        self.holding = False  # after the start: the next write takes the head along
        cycle.transport = self

    def hold(self) -> None:
        """The start was sent (its bytes kept here): the next write carries them."""
        self.holding = True

    def write(self, data: bytes) -> None:
        if not self.holding:  # the start, through the middlewares and uvicorn
            self.head.append(data)
            return
        self.release(data)

    def release(self, data: bytes = b"") -> None:
        """Give the cycle its transport back, writing the head (with ``data``) unless the client is gone."""
        if self.cycle.transport is not self:
            return
        self.cycle.transport = self.transport
        if self.head and not self.cycle.disconnected and not self.transport.is_closing():
            self.transport.write(b"".join((*self.head, data)))
        elif data:
            self.transport.write(data)
        self.head.clear()

    def __getattr__(self, name: str) -> Any:  # is_closing, close, get_extra_info...: the transport's own
        return getattr(self.transport, name)


class _TransportWriter:
    """Events straight to the client's transport, framed as uvicorn frames the body (one write per piece).

    ``cycle`` is uvicorn's request-response cycle, handed over by :class:`gateway.edge.connection.GuardedHttpProtocol`.
    When the client's socket buffer is full (its flow control paused writing), reading from the engine pauses
    until it drains: a slow client slows its own stream, never the gateway's memory.

    ``held``: the events of the read that brought the answer's end (all of a short answer, which came whole before
    the relay began), kept, not written: they go out with the body's end (:meth:`take_held`), in the same write as
    its closing chunk (and the head, for a short answer): one system call and one segment less, and the client
    wakes once.
    """

    __slots__ = ("cycle", "upstream", "draining", "done", "held")

    def __init__(self, cycle: Any, upstream: StreamExchange) -> None:
        self.cycle = cycle
        self.upstream = upstream
        self.draining: asyncio.Future[None] | None = None
        self.done: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
        self.held: list[bytes] | None = None

    def take_held(self) -> bytes:
        """The events kept for the end (unframed), no longer kept."""
        held, self.held = self.held, None
        return b"".join(held) if held else b""

    def write(self, events: bytes) -> None:
        cycle = self.cycle
        if cycle.disconnected:  # (the cycle's disconnect callback ends the stream)
            return
        if self.upstream.ending:  # these are the answer's last events: they go out with its end, in one write
            if self.held is None:
                self.held = []
            self.held.append(events)
            return
        cycle.transport.write(b"%x\r\n%b\r\n" % (len(events), events) if cycle.chunked_encoding else events)
        if cycle.flow.write_paused and self.draining is None:
            self.upstream.pause_reading()
            self.draining = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            await self.cycle.flow.drain()
        finally:
            self.draining = None
            self.upstream.resume_reading()

    def finish(self, error: BaseException | None) -> None:
        if not self.done.done():
            self.done.set_result(error)

    async def wait(self) -> BaseException | None:
        try:
            return await self.done
        finally:
            if self.draining is not None:
                self.draining.cancel()


class _MessageWriter:
    """Events as ASGI messages, sent from the response's task (a server other than the gateway's uvicorn)."""

    __slots__ = ("send", "upstream", "pending", "size", "wake", "ended", "error")
    _PAUSE_AT = 256 * 1024  # bytes waiting to be sent: beyond, reading from the engine pauses

    def __init__(self, send: Send, upstream: StreamExchange) -> None:
        self.send = send
        self.upstream = upstream
        self.pending: list[bytes] = []
        self.size = 0
        self.wake: asyncio.Future[None] | None = None
        self.ended = False
        self.error: BaseException | None = None

    def write(self, events: bytes) -> None:
        self.pending.append(events)
        self.size += len(events)
        if self.size > self._PAUSE_AT:
            self.upstream.pause_reading()
        self._wake()

    def finish(self, error: BaseException | None) -> None:
        if not self.ended:
            self.ended, self.error = True, error
            self._wake()

    def _wake(self) -> None:
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)

    async def wait(self) -> BaseException | None:
        while True:
            if self.pending:
                body, paused = b"".join(self.pending), self.size > self._PAUSE_AT
                self.pending.clear()
                self.size = 0
                await self.send({"type": "http.response.body", "body": body, "more_body": True})
                if paused:
                    self.upstream.resume_reading()
                continue
            if self.ended:
                return self.error
            self.wake = asyncio.get_running_loop().create_future()
            await self.wake
