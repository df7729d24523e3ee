"""A FAKE upstream that streams like a GPU engine's decode loop: every step, one event to each running stream.

SGLang on a GPU runs hundreds of requests in one batch; each decode step (10-30 ms) gives every running
request one token, sent as its own SSE event. This fake does the same with no model: a request's headers go
out at once (as SGLang sends them), then one timer per step writes, to every stream still running, the next
token's event (the role chunk rides with the first token, the finish / usage / end events with the last).
Answers have the frames of :mod:`benchmarks.fake_upstream` (chat, Responses, Messages), so the gateway scans
and relays them exactly as it does the engine's. Plain (non-stream) requests are answered at once.

Run: ``python -m benchmarks.paced_upstream --port 9000 [--step-ms 20]``; prints ``ready URL`` when it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Iterator

from benchmarks.fake_upstream import ANSWERS, _RawProtocol, _run

# events before the first token event, per path (the rest after the last token rides with the last one)
_LEADING = {"/v1/chat/completions": 1, "/v1/responses": 4, "/v1/messages": 2}
_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def steps(path: str, events: tuple[bytes, ...], tokens: int) -> list[bytes]:
    """The answer's events grouped one token per step, each group framed as one HTTP chunk."""
    lead = _LEADING[path]
    token_events = events[lead : lead + tokens]
    groups = [bytearray(event) for event in token_events] or [bytearray()]
    groups[0][:0] = b"".join(events[:lead])
    groups[-1] += b"".join(events[lead + tokens :])
    return [b"%x\r\n%s\r\n" % (len(group), bytes(group)) for group in groups]


class DecodeLoop:
    """The running batch: every ``step_s`` each stream gets its next group; finished ones end their body."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.running: dict[asyncio.Transport, Iterator[bytes]] = {}

    def add(self, transport: asyncio.Transport, chunks: list[bytes]) -> None:
        self.running[transport] = iter(chunks)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            next_at += self.step_s
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            if loop.time() - next_at > self.step_s:  # fell behind by a whole step: do not burst to catch up
                next_at = loop.time()
            self.step()

    def step(self) -> None:
        done = []
        for transport, chunks in self.running.items():
            if transport.is_closing():
                done.append(transport)
                continue
            chunk = next(chunks, None)
            if chunk is None:
                transport.write(b"0\r\n\r\n")
                done.append(transport)
            else:
                transport.write(chunk)
        for transport in done:
            del self.running[transport]


class _PacedProtocol(_RawProtocol):
    loop_of_streams: DecodeLoop

    def _answer(self, method: bytes, path: bytes, body: bytes) -> None:
        route = path.split(b"?", 1)[0].decode("latin-1")
        answer = ANSWERS.get(route) if method == b"POST" else None
        reply = answer(body) if answer is not None else None
        if reply is None or reply.events is None:
            super()._answer(method, path, body)
            return
        tokens = _token_count(route, reply.events)
        self.transport.write(_HEAD)
        self.loop_of_streams.add(self.transport, steps(route, reply.events, tokens))


def _token_count(path: str, events: tuple[bytes, ...]) -> int:
    """How many token events ``events`` holds (the fake answers repeat one token's text)."""
    marker = {"/v1/chat/completions": b'"content":"tok "', "/v1/responses": b"event: response.output_text.delta\n"}.get(
        path, b"event: content_block_delta\n"
    )
    return sum(marker in event for event in events)


def serve(host: str, port: int, step_ms: float) -> None:
    async def main() -> None:
        decode = DecodeLoop(step_ms / 1000)
        protocol = type("PacedProtocol", (_PacedProtocol,), {"loop_of_streams": decode})
        server = await asyncio.get_running_loop().create_server(protocol, host, port, backlog=4096)
        ticker = asyncio.ensure_future(decode.run())
        print(f"ready http://{host}:{port}", flush=True)
        try:
            async with server:
                await server.serve_forever()
        finally:
            ticker.cancel()

    _run(main())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--step-ms", type=float, default=20.0, help="decode step: one event per running stream each step")
    args = parser.parse_args(argv)
    serve(args.host, args.port, args.step_ms)


if __name__ == "__main__":
    sys.exit(main())
