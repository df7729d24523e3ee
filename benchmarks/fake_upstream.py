"""A FAKE SGLang upstream for benchmarks: answers chat, Responses and Messages requests at once, never runs a model.

It exists so that the gateway's own cost is not hidden behind engine time. Two implementations:

- ``starlette`` (default): a minimal Starlette app under uvicorn (uvloop, access log off). The gateway's
  throughput target is phrased against it: "the gateway spends no more CPU per request than a minimal
  Starlette app spends answering it".
- ``raw``: a hand-written asyncio protocol (keep-alive HTTP/1.1, Content-Length bodies only) that writes
  each answer in one ``transport.write``: the cheapest upstream Python can offer.

Answers have the frames SGLang 0.5.23 sends, with exactly the requested number of one-"token" text pieces
(default 16) and a usage object; the ``model`` field echoes the request:

- ``POST /v1/chat/completions``: a role chunk, one content chunk per token, a finish chunk, a usage chunk
  when ``stream_options.include_usage`` is set, and ``data: [DONE]``;
- ``POST /v1/responses``: ``event:`` lines; ``response.created`` / ``response.in_progress``, the output item
  and content part opened, one ``response.output_text.delta`` per token, everything closed, and
  ``response.incomplete`` (what SGLang ends with when ``max_output_tokens`` cut the answer); a fresh
  ``resp_...`` id per answer;
- ``POST /v1/messages``: Anthropic's ``message_start``, ``content_block_start``, one
  ``content_block_delta`` per token, ``content_block_stop``, ``message_delta`` (usage), ``message_stop``.

Run: ``python -m benchmarks.fake_upstream --port 9000 [--kind raw]``; it prints ``ready URL`` when it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

DEFAULT_TOKENS = 16
TOKEN_TEXT = "tok "


# ------------------------------------------------------------------------------ answers (shared)
@dataclass(frozen=True)
class Answer:
    """One answer: a JSON body, or the SSE events of a stream (each ``...\\n\\n``)."""

    body: bytes = b""
    events: tuple[bytes, ...] | None = None
    status: int = 200


@dataclass(frozen=True)
class Asked:
    """What a request asks for (a malformed body asks for the defaults: this is not a validator)."""

    model: str
    stream: bool
    tokens: int
    include_usage: bool
    prompt_tokens: int


def _asked(raw: bytes, *token_fields: str) -> Asked:
    try:
        body = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    tokens = next((body[f] for f in token_fields if isinstance(body.get(f), int) and body[f] > 0), DEFAULT_TOKENS)
    options = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
    return Asked(
        str(body.get("model", "fake")),
        body.get("stream") is True,
        tokens,
        bool(options.get("include_usage")),
        max(1, len(raw) // 4),
    )


_ids = itertools.count()


def _new_id(prefix: str) -> str:
    """A fresh id per answer, as engines make (the gateway remembers the Responses API's ids)."""
    return f"{prefix}_fake{os.getpid():x}{next(_ids):016x}"


def _sse(data: dict[str, Any], event: str | None = None) -> bytes:
    head = b"event: %s\n" % event.encode() if event else b""
    return head + b"data: " + orjson.dumps(data) + b"\n\n"


# ------------------------------------------------------------------ OpenAI chat completions
def stream_events(model: str, tokens: int, include_usage: bool, prompt_tokens: int) -> list[bytes]:
    """The SSE events of one streamed chat answer, each ``data: ...\\n\\n``."""
    base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": int(time.time()), "model": model}

    def event(delta: dict[str, Any], finish: str | None = None, usage: Any = None, choices: bool = True) -> bytes:
        data = {
            **base,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}] if choices else [],
            "usage": usage,
        }
        return _sse(data)

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


def chat_answer(raw: bytes) -> Answer:
    asked = _asked(raw, "max_tokens", "max_completion_tokens")
    if asked.stream:
        return Answer(events=tuple(stream_events(asked.model, asked.tokens, asked.include_usage, asked.prompt_tokens)))
    return Answer(completion_body(asked.model, asked.tokens, asked.prompt_tokens))


# ------------------------------------------------------------------ OpenAI Responses (SGLang's frames)
def _response(asked: Asked, response_id: str, status: str, text: str | None) -> dict[str, Any]:
    """The response object SGLang sends: in progress (no output yet) or cut at max_output_tokens."""
    done = text is not None
    message = {
        "id": response_id.replace("resp_", "msg_", 1),
        "content": [{"annotations": [], "text": text, "type": "output_text", "logprobs": None}] if done else [],
        "role": "assistant",
        "status": "completed" if done else "in_progress",
        "type": "message",
        "phase": "final_answer",
    }
    usage = {
        "input_tokens": asked.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": asked.tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": asked.prompt_tokens + asked.tokens,
    }
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "model": asked.model,
        "output": [message] if done else [],
        "status": status,
        "usage": usage if done else None,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if done else None,
        "max_output_tokens": asked.tokens,
        "previous_response_id": None,
        "store": True,
        "temperature": 0.0,
        "truncation": "disabled",
        "metadata": {},
    }


def responses_events(asked: Asked) -> list[bytes]:
    """created, in_progress, the item and part opened, one text delta per token, everything closed, and
    ``response.incomplete`` (SGLang's last event when max_output_tokens cut the answer)."""
    response_id = _new_id("resp")
    item_id = response_id.replace("resp_", "msg_", 1)
    text = TOKEN_TEXT * asked.tokens
    part = {"annotations": [], "text": "", "type": "output_text", "logprobs": None}
    where = {"item_id": item_id, "output_index": 0}
    kinds_and_data: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": _response(asked, response_id, "in_progress", None)}),
        ("response.in_progress", {"response": _response(asked, response_id, "in_progress", None)}),
        ("response.output_item.added", {"item": {"id": item_id, "content": [], "role": "assistant", "status": "in_progress", "type": "message", "phase": "final_answer"}, "output_index": 0}),
        ("response.content_part.added", {"content_index": 0, **where, "part": part}),
        *[("response.output_text.delta", {"content_index": 0, "delta": TOKEN_TEXT, **where, "logprobs": []})] * asked.tokens,
        ("response.output_text.done", {"content_index": 0, **where, "logprobs": [], "text": text}),
        ("response.content_part.done", {"content_index": 0, **where, "part": {**part, "text": text}}),
        ("response.output_item.done", {"item": _response(asked, response_id, "incomplete", text)["output"][0], "output_index": 0}),
        ("response.incomplete", {"response": _response(asked, response_id, "incomplete", text)}),
    ]  # fmt: skip
    return [_sse({"type": kind, **data, "sequence_number": n}, kind) for n, (kind, data) in enumerate(kinds_and_data)]


def responses_answer(raw: bytes) -> Answer:
    asked = _asked(raw, "max_output_tokens")
    if asked.stream:
        return Answer(events=tuple(responses_events(asked)))
    return Answer(orjson.dumps(_response(asked, _new_id("resp"), "incomplete", TOKEN_TEXT * asked.tokens)))


# ------------------------------------------------------------------ Anthropic Messages (SGLang's frames)
def messages_events(asked: Asked) -> list[bytes]:
    """message_start, a text block with one delta per token, message_delta (stop reason, usage), message_stop."""
    start = {
        "id": _new_id("msg"),
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": asked.model,
        "usage": {"input_tokens": asked.prompt_tokens, "output_tokens": 0},
    }
    delta = _sse(
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": TOKEN_TEXT}},
        "content_block_delta",
    )
    return [
        _sse({"type": "message_start", "message": start}, "message_start"),
        _sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}, "content_block_start"),
        *[delta] * asked.tokens,
        _sse({"type": "content_block_stop", "index": 0}, "content_block_stop"),
        _sse({"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": asked.tokens}}, "message_delta"),
        _sse({"type": "message_stop"}, "message_stop"),
    ]  # fmt: skip


def messages_answer(raw: bytes) -> Answer:
    asked = _asked(raw, "max_tokens")
    if asked.stream:
        return Answer(events=tuple(messages_events(asked)))
    message = {
        "id": _new_id("msg"),
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": TOKEN_TEXT * asked.tokens}],
        "model": asked.model,
        "stop_reason": "max_tokens",
        "usage": {"input_tokens": asked.prompt_tokens, "output_tokens": asked.tokens},
    }
    return Answer(orjson.dumps(message))


# POST routes: path -> answer
ANSWERS: dict[str, Callable[[bytes], Answer]] = {
    "/v1/chat/completions": chat_answer,
    "/v1/responses": responses_answer,
    "/v1/messages": messages_answer,
}

MODELS_BODY = orjson.dumps(
    {"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": "fake", "max_model_len": 4096}]}
)


# ------------------------------------------------------------------------------ Starlette
def starlette_app() -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    def endpoint(answer: Callable[[bytes], Answer]) -> Callable[[Request], Awaitable[Response]]:
        async def handle(request: Request) -> Response:
            reply = answer(await request.body())
            if reply.events is None:
                return Response(reply.body, status_code=reply.status, media_type="application/json")
            events = reply.events

            async def gen() -> Any:
                for item in events:
                    yield item

            return StreamingResponse(gen(), media_type="text/event-stream")

        return handle

    async def health(request: Request) -> Response:
        return Response(b"", status_code=200)

    async def models(request: Request) -> Response:
        return Response(MODELS_BODY, media_type="application/json")

    return Starlette(
        routes=[
            *(Route(path, endpoint(answer), methods=["POST"]) for path, answer in ANSWERS.items()),
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
        answer = ANSWERS.get(path.split(b"?", 1)[0].decode("latin-1")) if method == b"POST" else None
        if answer is not None:
            reply = answer(body)
            if reply.events is None:
                self._plain(reply.status, reply.body)
                return
            parts = [b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"]
            for event in reply.events:
                parts.append(b"%x\r\n%s\r\n" % (len(event), event))
            parts.append(b"0\r\n\r\n")
            self.transport.write(b"".join(parts))
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
