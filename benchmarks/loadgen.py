"""The load generator: a minimal keep-alive HTTP/1.1 client on raw asyncio streams (uvloop when installed).

Why not httpx or the openai SDK: on a 2-core machine the client shares the CPU with the gateway and the
upstream, so it must spend as little as possible per request. This client sends one precomputed request
body, parses the status line, headers and chunked transfer encoding by hand, and finds SSE events and
tokens with byte scans (no JSON parsing). One persistent connection per concurrent worker, opened before
a batch starts, like a client's connection pool.

A *batch* is ``requests`` requests at a fixed concurrency against one target; it stops early at
``max_seconds`` (bounded runs). Each request yields one :class:`Sample`.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import orjson

from benchmarks.apis import APIS, Api

_READ_LIMIT = 8 * 1024 * 1024
_SENTENCE = "The quick brown fox jumps over the lazy dog.".split()


@dataclass(frozen=True)
class Workload:
    """What every request of a run looks like (the same bytes for direct and gateway targets)."""

    model: str = "bench"
    stream: bool = True
    prompt_tokens: int = 32
    output_tokens: int = 16
    timeout_s: float = 60.0
    api: str = "chat"  # a name of benchmarks.apis.APIS: chat, responses, messages
    agent: bool = False  # chat: the request an agent loop sends (its tools, and the turns of calls so far before the prompt)

    @property
    def dialect(self) -> Api:
        return APIS[self.api]

    @property
    def path(self) -> str:
        return self.dialect.path

    def prompt(self) -> str:
        # Natural words: a prompt of one repeated word makes the tiny random model emit byte fragments that
        # SGLang holds back until they form UTF-8, i.e. one content event at the end (no measurable TTFT).
        words = (_SENTENCE * (1 + self.prompt_tokens // len(_SENTENCE)))[: max(1, self.prompt_tokens - 8)]
        return " ".join(words)  # ~1 token per word; the chat template adds a few tokens

    def body(self) -> bytes:
        data = self.dialect.body(self.model, self.prompt(), self.output_tokens, self.stream)
        if self.agent:
            if self.api != "chat":
                raise ValueError("an agent's requests are chat requests (api chat)")
            data["messages"] = [*AGENT_HISTORY, *data["messages"]]
            data["tools"] = AGENT_TOOLS
        return orjson.dumps(data)


# An agent loop's request at its sixth step: 8 function tools, a system prompt, and five turns of a call and its result
# before the user's prompt (17 messages, ~7.6 KB): what LangGraph, openai-agents and the like send.
AGENT_TOOLS = [
    {"type": "function", "function": {
        "name": f"tool_{index}", "description": "Looks something up for the user. " * 3,
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}, "required": ["query"]},
    }}
    for index in range(8)
]  # fmt: skip
AGENT_HISTORY = [{"role": "system", "content": "You are a careful assistant that uses tools. " * 40}] + [
    message
    for turn in range(5)
    for message in (
        {"role": "user", "content": "Find what the docs say about this. " * 8},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{turn}", "type": "function", "function": {"name": f"tool_{turn}", "arguments": '{"query": "docs"}'}},
        ]},
        {"role": "tool", "tool_call_id": f"call_{turn}", "content": "Nothing more than what you knew. " * 4},
    )
]  # fmt: skip


@dataclass
class Sample:
    """One request as the client saw it (seconds from the batch's time origin)."""

    ok: bool
    start: float
    end: float
    ttft: float | None = None  # first content token (streaming); None for plain requests
    tokens: int = 0  # output tokens (usage when sent, else content events)
    itl: float | None = None  # mean gap between content events after the first
    error: str | None = None

    @property
    def latency(self) -> float:
        return self.end - self.start


@dataclass
class BatchResult:
    target: str
    concurrency: int
    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0
    truncated: bool = False  # stopped by max_seconds before all requests were sent
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds spent during the batch, per process


class HttpError(Exception):
    pass


class Connection:
    """One keep-alive HTTP/1.1 connection; reopened when the server closes it.

    ``quickack``: acknowledge every read at once (Linux ``TCP_QUICKACK``, re-armed after each read: the
    kernel drops it by itself). A server that does not set ``TCP_NODELAY`` (SGLang's router) holds each
    small write until the previous one is acknowledged, so a client with delayed ACKs (the default on a
    keep-alive connection) stalls every stream event by up to 40 ms; a quick-ACK client does not.
    """

    def __init__(self, host: str, port: int, quickack: bool = False) -> None:
        self.host, self.port = host, port
        self.quickack = quickack
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self._ack: Callable[[], None] = _nothing

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=_READ_LIMIT)
        sock = self.writer.get_extra_info("socket")
        if self.quickack and sock is not None and hasattr(socket, "TCP_QUICKACK"):
            self._ack = lambda: sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None
        self._ack = _nothing

    async def request(self, head: bytes, body: bytes, on_data: Callable[[bytes, float], None]) -> int:
        """Send one request; feed body bytes to ``on_data`` as they arrive; return the status.

        A kept-alive connection that the server closed while it was idle (uvicorn closes one after 5 s: a
        client that spreads its requests over several servers leaves each connection idle in turn) answers
        nothing at all; the request never reached the server, so it is sent once more on a new connection.
        """
        fresh = self.writer is None
        if fresh:
            await self.open()
        assert self.reader is not None and self.writer is not None
        reader, ack = self.reader, self._ack
        try:
            self.writer.write(head + body)
            raw = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionResetError) as error:
            if fresh or getattr(error, "partial", b""):
                raise
            self.close()
            return await self.request(head, body, on_data)
        ack()
        status = int(raw[9:12])
        chunked, length, close = False, None, False
        for line in raw[:-4].split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"content-length":
                length = int(value)
            elif name == b"connection":
                close = b"close" in value.lower()
        if chunked:
            while True:
                size_line = await reader.readuntil(b"\r\n")
                size = int(size_line.split(b";", 1)[0], 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")
                    break
                data = await reader.readexactly(size + 2)
                ack()
                on_data(data[:-2], time.perf_counter())
        elif length is not None:
            if length:
                on_data(await reader.readexactly(length), time.perf_counter())
        else:  # read to EOF
            on_data(await reader.read(), time.perf_counter())
            close = True
        if close:
            self.close()
        return status


def _nothing() -> None:
    pass


class StreamParser:
    """SSE bytes -> first-token time, text event count, usage, end and error events; byte scans only."""

    __slots__ = ("api", "pending", "first", "last", "events", "usage_tokens", "error", "ended", "raw")

    def __init__(self, api: Api, stream: bool) -> None:
        self.api = api
        self.pending = b""
        self.first: float | None = None
        self.last: float | None = None
        self.events = 0
        self.usage_tokens: int | None = None
        self.error: str | None = None
        self.ended = False
        self.raw = b"" if not stream else None

    def feed_plain(self, data: bytes, now: float) -> None:
        self.raw += data  # type: ignore[operator]

    def feed_stream(self, data: bytes, now: float) -> None:
        data = self.pending + data if self.pending else data
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self.pending = data
            return
        self.pending = data[cut + 2 :]
        api = self.api
        for event in data[: cut + 2].split(b"\n\n"):
            if not event:
                continue
            if api.is_text(event):
                self.events += 1
                if self.first is None:
                    self.first = now
                self.last = now
            elif b"_tokens" in event:
                tokens = api.output_tokens(event)
                if tokens is not None:
                    self.usage_tokens = tokens
            if event.startswith(api.ends):
                self.ended = True
            if api.is_error(event):
                self.error = event[:200].decode("utf-8", "replace")

    def stream_problem(self) -> str | None:
        """Why a streamed answer that came with a 200 is not a success (None: it is one)."""
        if self.error is not None:
            return self.error
        if not self.ended:
            return f"stream ended without its last event ({self.api.ends[0].decode().strip()})"
        return None


# The headers the OpenAI Python SDK (1.x) sends with a request, beyond those every request here carries (host,
# content-type, accept, content-length): a server's per-header work, as a client SDK makes it pay
SDK_HEADERS = {
    "accept-encoding": "gzip, deflate", "connection": "keep-alive", "user-agent": "OpenAI/Python 1.99.0",
    "x-stainless-lang": "python", "x-stainless-package-version": "1.99.0", "x-stainless-os": "Linux",
    "x-stainless-arch": "x64", "x-stainless-runtime": "CPython", "x-stainless-runtime-version": "3.11.7",
    "authorization": "Bearer sk-none", "x-stainless-async": "false", "x-stainless-retry-count": "0",
    "x-stainless-read-timeout": "600",
}  # fmt: skip


async def run_batch(
    url: str | Sequence[str],
    workload: Workload,
    concurrency: int,
    requests: int,
    *,
    target: str = "target",
    max_seconds: float = 120.0,
    on_done: Callable[[], None] | None = None,
    headers: dict[str, str] | None = None,
    quickack: bool = False,
) -> BatchResult:
    """``requests`` requests at ``concurrency`` against ``url`` (base URL, no path), or spread round robin over
    several base URLs (request i goes to URL i mod n; each worker keeps a connection to every URL);
    ``quickack``: see :class:`Connection`."""
    urls = [url] if isinstance(url, str) else list(url)
    body = workload.body()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    heads, addresses = [], []
    for one_url in urls:
        parts = urlsplit(one_url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        addresses.append((host, port))
        heads.append(
            (
                f"POST {parts.path.rstrip('/')}{workload.path} HTTP/1.1\r\nhost: {host}:{port}\r\n"
                f"content-type: application/json\r\naccept: */*\r\n{extra}content-length: {len(body)}\r\n\r\n"
            ).encode()
        )
    result = BatchResult(target, concurrency)
    pools = [[Connection(host, port, quickack) for host, port in addresses] for _ in range(concurrency)]
    connections = [conn for pool in pools for conn in pool]
    await asyncio.gather(*(c.open() for c in connections))
    issued = 0
    t0 = time.perf_counter()
    deadline = t0 + max_seconds

    async def one(conn: Connection, head: bytes) -> Sample:
        parser = StreamParser(workload.dialect, workload.stream)
        start = time.perf_counter()
        try:
            feed = parser.feed_stream if workload.stream else parser.feed_plain
            status = await asyncio.wait_for(conn.request(head, body, feed), workload.timeout_s)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as error:
            conn.close()
            return Sample(False, start - t0, time.perf_counter() - t0, error=f"{type(error).__name__}: {error}"[:200])
        end = time.perf_counter()
        if status != 200:
            return Sample(False, start - t0, end - t0, error=f"HTTP {status}")
        if workload.stream:
            tokens = parser.usage_tokens if parser.usage_tokens is not None else parser.events
            itl = None
            if parser.events > 1 and parser.first is not None and parser.last is not None:
                itl = (parser.last - parser.first) / (parser.events - 1)
            ttft = parser.first - start if parser.first is not None else None
            problem = parser.stream_problem()
            return Sample(problem is None, start - t0, end - t0, ttft, tokens, itl, problem)
        tokens = workload.dialect.output_tokens(parser.raw or b"")
        return Sample(True, start - t0, end - t0, None, tokens or 0)

    async def worker(pool: list[Connection]) -> None:
        nonlocal issued
        while issued < requests:
            if time.perf_counter() > deadline:
                result.truncated = True
                return
            pick = issued % len(pool)
            issued += 1
            result.samples.append(await one(pool[pick], heads[pick]))
            if on_done is not None:
                on_done()

    try:
        await asyncio.gather(*(worker(pool) for pool in pools))
    finally:
        result.wall_s = time.perf_counter() - t0
        for conn in connections:
            conn.close()
    return result


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()
