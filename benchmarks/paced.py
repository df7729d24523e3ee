"""The paced load: many long streams at once, each fed one event per decode step (``benchmarks.paced_upstream``).

This is how a GPU engine at high batch streams, and what decides whether a proxy keeps up with it: the
cost of each relayed event, not of each request. Every stream has its own connection; the streams start
spread over ``ramp_s`` (as a busy endpoint's arrivals), and the client reads with byte scans only, so that
it stays the cheapest process of the three. Per run it reports time to first token, the gap between a
stream's events (a proxy that falls behind stretches it), events delivered per second, and errors.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import orjson

from benchmarks.apis import Api
from benchmarks.stats import percentile_ms

_TOKEN = b"tok "  # the fake's token text: the first read carrying it is the first token


@dataclass
class PacedResult:
    """What one paced run measured (times in seconds)."""

    streams: int
    completed: int = 0
    statuses: dict[str, int] = field(default_factory=dict)  # non-200 statuses, stream errors, cut streams
    events: int = 0
    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def errors(self) -> int:
        return sum(self.statuses.values())

    def summary(self) -> dict[str, Any]:
        return {
            "streams": self.streams,
            "completed": self.completed,
            "errors": self.errors,
            "statuses": dict(self.statuses),
            "events": self.events,
            "wall_s": self.wall_s,
            "events_per_s": self.events / self.wall_s if self.wall_s else 0.0,
            "ttft_p50_ms": percentile_ms(self.ttft, 50),
            "ttft_p99_ms": percentile_ms(self.ttft, 99),
            "gap_p50_ms": percentile_ms(self.gaps, 50),
            "gap_p99_ms": percentile_ms(self.gaps, 99),
        }


class _Stream(asyncio.Protocol):
    """One streamed request on its own connection: counts events (``\\n\\n``), notes times, never parses JSON."""

    def __init__(self, request: bytes, api: Api, result: PacedResult, done: asyncio.Future[None]) -> None:
        self.request = request
        self.api = api
        self.result = result
        self.done = done
        self.head = b""
        self.status = 0
        self.sent = 0.0
        self.last = 0.0  # when the last event came
        self.newline = False  # the previous read ended with "\n" (an event boundary may straddle reads)
        self.ended = False  # the stream's own last event came
        self.failed = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.sent = time.perf_counter()
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if not self.status:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            self.status = int(self.head[9:12])
            data, self.head = self.head[end + 4 :], b""
            if self.status != 200:
                self._finish(str(self.status))
                return
        events = data.count(b"\n\n") + (self.newline and data[:1] == b"\n")
        self.newline = data[-1:] == b"\n"
        if events:
            result = self.result
            result.events += events
            if self.last:
                result.gaps.append(now - self.last)
                self.last = now
            elif _TOKEN in data:  # leading events without a token (Responses' created...) do not count as the first
                result.ttft.append(now - self.sent)
                self.last = now
            if b"error" in data:  # rare: look at the events themselves (each after its chunk-size line)
                pieces = (piece.rsplit(b"\r\n", 1)[-1] for piece in data.split(b"\n\n"))
                self.failed = self.failed or any(self.api.is_error(piece) for piece in pieces)
            if any(end in data for end in self.api.ends):
                self.ended = True
        if data.endswith(b"0\r\n\r\n") and self.ended:
            self._finish("stream error" if self.failed else None)

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish("cut" if self.status == 200 else "connection lost")

    def _finish(self, problem: str | None) -> None:
        if self.done.done():
            return
        if problem is None:
            self.result.completed += 1
        else:
            self.result.statuses[problem] = self.result.statuses.get(problem, 0) + 1
        self.done.set_result(None)
        if self.transport is not None:
            self.transport.close()


def request_bytes(url: str, api: Api, tokens: int, model: str) -> bytes:
    parts = urlsplit(url)
    body = orjson.dumps(api.body(model, "hello " * 8, tokens, True))
    return (
        f"POST {api.path} HTTP/1.1\r\nhost: {parts.netloc}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body


async def run_paced(url: str, api: Api, streams: int, tokens: int, ramp_s: float, timeout_s: float, model: str = "bench") -> PacedResult:
    """``streams`` streams of ``tokens`` tokens to ``url``, started evenly over ``ramp_s``; bounded by ``timeout_s``."""
    loop = asyncio.get_running_loop()
    parts = urlsplit(url)
    request = request_bytes(url, api, tokens, model)
    result = PacedResult(streams)
    futures: list[asyncio.Future[None]] = []
    opened: list[_Stream] = []
    start = time.perf_counter()

    async def one(at: float) -> None:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
        done: asyncio.Future[None] = loop.create_future()
        stream = _Stream(request, api, result, done)
        opened.append(stream)
        futures.append(done)
        try:
            await loop.create_connection(lambda: stream, parts.hostname, parts.port)
        except OSError as error:
            stream._finish(f"connect: {type(error).__name__}")
        await done

    tasks = [asyncio.ensure_future(one(i * ramp_s / streams)) for i in range(streams)]
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)
    except TimeoutError:
        for stream in opened:
            stream._finish("client timeout")
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    result.wall_s = time.perf_counter() - start
    return result
