"""A FAKE OpenAI-compatible upstream for benchmarks: answers chat completions at once, never runs a model.

It exists so that the gateway's own cost is not hidden behind engine time. Two implementations:

- ``starlette`` (default): a minimal Starlette app under uvicorn (uvloop, access log off). The issue's
  throughput target is phrased against it: "the gateway spends no more CPU per request than a minimal
  Starlette app spends answering it".
- ``raw``: a hand-written asyncio protocol (keep-alive HTTP/1.1, Content-Length bodies only) that writes
  each answer in one ``transport.write``: the cheapest upstream Python can offer.

Streaming answers have the shape SGLang sends: a role chunk, ``max_tokens`` content chunks (one "token"
each, default 16), a finish chunk, a usage chunk when ``stream_options.include_usage`` is set, and
``data: [DONE]``. Non-streaming answers carry ``usage``. The ``model`` field echoes the request.

Run: ``python -m benchmarks.fake_upstream --port 9000 [--kind raw]``; it prints ``ready URL`` when it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

import orjson

DEFAULT_TOKENS = 16
TOKEN_TEXT = "tok "


# ------------------------------------------------------------------------------ answers (shared)
def _request_fields(raw: bytes) -> tuple[str, bool, int, bool]:
    try:
        body = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    tokens = body.get("max_tokens") or body.get("max_completion_tokens") or DEFAULT_TOKENS
    tokens = tokens if isinstance(tokens, int) and tokens > 0 else DEFAULT_TOKENS
    options = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
    return str(body.get("model", "fake")), body.get("stream") is True, tokens, bool(options.get("include_usage"))


def _prompt_tokens(raw: bytes) -> int:
    return max(1, len(raw) // 4)


def stream_events(model: str, tokens: int, include_usage: bool, prompt_tokens: int) -> list[bytes]:
    """The SSE events of one streamed answer, each ``data: ...\\n\\n``."""
    base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": int(time.time()), "model": model}

    def event(delta: dict[str, Any], finish: str | None = None, usage: Any = None, choices: bool = True) -> bytes:
        data = {
            **base,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}] if choices else [],
            "usage": usage,
        }
        return b"data: " + orjson.dumps(data) + b"\n\n"

    events = [event({"role": "assistant", "content": ""})]
    token_event = event({"role": "assistant", "content": TOKEN_TEXT})
    events += [token_event] * tokens
    events.append(event({"role": "assistant", "content": None}, finish="length"))
    if include_usage:
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": tokens, "total_tokens": prompt_tokens + tokens}
        events.append(event({}, usage=usage, choices=False))
    events.append(b"data: [DONE]\n\n")
    return events


def completion_body(model: str, tokens: int, prompt_tokens: int) -> bytes:
    return orjson.dumps(
        {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": TOKEN_TEXT * tokens},
                    "logprobs": None,
                    "finish_reason": "length",
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": tokens,
                "total_tokens": prompt_tokens + tokens,
            },
        }
    )


MODELS_BODY = orjson.dumps(
    {"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": "fake", "max_model_len": 4096}]}
)


# ------------------------------------------------------------------------------ Starlette
def starlette_app() -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    async def chat(request: Request) -> Response:
        raw = await request.body()
        model, stream, tokens, include_usage = _request_fields(raw)
        if not stream:
            return Response(completion_body(model, tokens, _prompt_tokens(raw)), media_type="application/json")
        events = stream_events(model, tokens, include_usage, _prompt_tokens(raw))

        async def gen() -> Any:
            for item in events:
                yield item

        return StreamingResponse(gen(), media_type="text/event-stream")

    async def health(request: Request) -> Response:
        return Response(b"", status_code=200)

    async def models(request: Request) -> Response:
        return Response(MODELS_BODY, media_type="application/json")

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/health", health),
            Route("/v1/models", models),
        ]
    )


def serve_starlette(host: str, port: int) -> None:
    import uvicorn

    config = uvicorn.Config(
        starlette_app(),
        host=host,
        port=port,
        access_log=False,
        log_level="warning",
        loop="auto",
        http="auto",
        lifespan="off",
    )
    server = uvicorn.Server(config)

    async def main() -> None:
        async def announce() -> None:
            while not server.started:
                await asyncio.sleep(0.02)
            print(f"ready http://{host}:{port}", flush=True)

        watcher = asyncio.ensure_future(announce())
        await server.serve()
        watcher.cancel()

    _run(main())


# ------------------------------------------------------------------------------ raw asyncio
class _RawProtocol(asyncio.Protocol):
    """Keep-alive HTTP/1.1 with Content-Length request bodies; enough for the benchmark's clients."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end]
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4 : end + 4 + length]
            self.buffer = self.buffer[end + 4 + length :]
            request_line = head.split(b"\r\n", 1)[0].split(b" ")
            self._answer(request_line[0], request_line[1] if len(request_line) > 1 else b"/", body)

    def _answer(self, method: bytes, path: bytes, body: bytes) -> None:
        if path.startswith(b"/v1/chat/completions") and method == b"POST":
            model, stream, tokens, include_usage = _request_fields(body)
            if stream:
                parts = [b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"]
                for event in stream_events(model, tokens, include_usage, _prompt_tokens(body)):
                    parts.append(b"%x\r\n%s\r\n" % (len(event), event))
                parts.append(b"0\r\n\r\n")
                self.transport.write(b"".join(parts))
                return
            self._plain(200, completion_body(model, tokens, _prompt_tokens(body)))
        elif path.startswith(b"/health"):
            self._plain(200, b"")
        elif path.startswith(b"/v1/models"):
            self._plain(200, MODELS_BODY)
        else:
            self._plain(404, b'{"error":{"message":"not found"}}')

    def _plain(self, status: int, content: bytes) -> None:
        reason = b"OK" if status == 200 else b"Not Found"
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (status, reason, len(content), content)
        )


def serve_raw(host: str, port: int) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(_RawProtocol, host, port, backlog=4096)
        print(f"ready http://{host}:{port}", flush=True)
        async with server:
            await server.serve_forever()

    _run(main())


def _run(coro: Any) -> None:
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:
        asyncio.run(coro)
    except KeyboardInterrupt:
        pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--kind", choices=["starlette", "raw"], default="starlette")
    args = parser.parse_args(argv)
    (serve_raw if args.kind == "raw" else serve_starlette)(args.host, args.port)


if __name__ == "__main__":
    sys.exit(main())
