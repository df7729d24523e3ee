"""A FAKE SGLang engine process, for control-plane tests (swaps, restarts, the watchdog) that need engines
to start, die, hang and be replaced many times, which the real CPU engine does in ~30-40 s of CPU each.

It is launched by the product exactly like the real one: the engine config's ``python:`` names the
interpreter wrapper :func:`fake_engine_python` writes, the gateway runs ``<python> -m sglang.launch_server
<SGLang's flags>`` through :class:`launch.process.EngineProcess` (its own process group, its port, its
``--config`` key file, its log), and the wrapper runs this file with the same argv instead of SGLang. So a
SIGKILL, a SIGSTOP, a stop and a restart hit a real process; only the model is missing.

What it does, SGLang's way (what the gateway relies on, nothing more):

- ``GET /health`` 200 (no key); with ``FAKE_ENGINE_HEALTH_BEHIND`` set, it answers only once no request runs (as
  SGLang's, a generation queued behind the batch, waits while a loaded CPU engine works);
- ``GET /metrics`` (no key): the two gauges the gateway reads, and the counter of work done the watchdog reads
  (``sglang:realtime_tokens_total``: one per piece generated, as SGLang's scheduler counts decode tokens);
- it listens ``FAKE_ENGINE_START_S`` (default 0) after its start: a start takes time;
- every other route needs ``Authorization: Bearer <api-key>`` from the ``--config`` file (401 otherwise);
- ``GET /v1/models``: the served model name with ``max_model_len``; ``GET /get_server_info``: the SGLang ``version``
  it plays (``FAKE_ENGINE_SGLANG_VERSION``, default 0.5.23);
- ``POST /v1/chat/completions``: ``max_tokens`` (default 16) pieces ``"tok "`` (``"<adapter> "`` for an adapter), streamed (role chunk, one chunk
  per piece every ``FAKE_ENGINE_TOKEN_S``, finish chunk, ``data: [DONE]``) or not; ``model`` is the served name;
  a plain answer with a ``json_schema`` ``response_format`` is the JSON ``{"answer": <the pieces>, "prompt": <the last
  message's content>}`` (any schema); a plain answer says in ``fake_priority`` the ``priority`` the request came with, in ``fake_model`` the model it
  named; a ``model`` of ``<name>:<adapter>`` needs the adapter loaded (400 otherwise, as SGLang): those of
  ``--lora-paths``, and then as ``POST /load_lora_adapter`` / ``/unload_lora_adapter`` (key needed) change them, as
  SGLang's do (a path containing ``broken`` fails to load; each call is noted in ``FAKE_ENGINE_CALLS``,
  ``load <name>`` / ``unload <name>``);
- with ``FAKE_ENGINE_ANSWERS`` set: each plain chat answer's last message content appended to that file as it is sent;
- ``POST /v1/messages`` (Anthropic's Messages, not streamed): ``max_tokens`` pieces ``"tok "`` as one text block, after
  ``FAKE_ENGINE_TOKEN_S`` each, with ``usage`` (``input_tokens`` 5, ``output_tokens``), ``fake_priority`` as for chat,
  its last message's content noted in ``FAKE_ENGINE_ANSWERS``; a last message whose content is :data:`REFUSE`
  answers 400 as SGLang refuses a request;
- ``POST /v1/responses`` (not streamed), ``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel`` (marks it
  ``cancelled``): responses stored in memory;
- a chat message whose content is :data:`CRASH`: it logs a traceback and exits 70 while the request is in
  flight, as an engine a request crashes does; one whose content is :data:`FREEZE`: it blocks its event loop
  (nothing answers, ``/health`` included, until it is killed), as an engine stuck on a request does; one whose content
  is :data:`FREEZE_LATER`: it never answers, and blocks its event loop ``FAKE_ENGINE_FREEZE_AFTER_S`` (default 1) later,
  as an engine does whose work for a request (a grammar compile) goes on after the client gave up;
- with ``--enable-memory-saver``: ``POST /release_memory_occupation`` and ``/resume_memory_occupation`` (key needed),
  as SGLang's; while released, a chat request answers 500 (SGLang's engine has no weights then). Each of
  these calls and each chat request is appended to the file ``FAKE_ENGINE_CALLS`` names (``release``,
  ``resume``, ``chat``, ``chat-while-released``), so a test reads their order;
- a ``--model-path`` whose ``config.json`` is not valid JSON: it logs a traceback and exits 1 after a moment,
  as SGLang does for a broken model directory.

Its command line keeps ``sglang.launch_server`` (after this file's path), so
``tests.model_code.helpers.engine_children`` counts it as an engine of this process.

:func:`running_fake_engine` runs it on its own, as the server behind a ``url:`` model (no key).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import stat
import sys
import time
import traceback
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TOKEN = "tok "
CRASH = "FAKE_ENGINE_CRASH"  # a chat message with this content makes the fake die under the request (a poison request)
FREEZE = "FAKE_ENGINE_FREEZE"  # ... makes it freeze under the request: its event loop blocked, /health unanswered
FREEZE_LATER = "FAKE_ENGINE_FREEZE_LATER"  # ... makes it freeze FAKE_ENGINE_FREEZE_AFTER_S later, the request long gone
REFUSE = "FAKE_ENGINE_REFUSE"  # a Messages request whose last message says this is refused (400)
TOKEN_S = float(os.environ.get("FAKE_ENGINE_TOKEN_S", "0.01"))  # time per generated piece
START_S = float(os.environ.get("FAKE_ENGINE_START_S", "0"))  # how long it takes to listen
CALLS = os.environ.get("FAKE_ENGINE_CALLS")  # a file the memory calls and chat requests are appended to
ANSWERS = os.environ.get("FAKE_ENGINE_ANSWERS")  # a file each plain chat answer's last message content is appended to, once answered
HEALTH_BEHIND = bool(os.environ.get("FAKE_ENGINE_HEALTH_BEHIND"))  # /health waits until no request runs
SGLANG_VERSION = os.environ.get("FAKE_ENGINE_SGLANG_VERSION", "0.5.23")  # what GET /get_server_info says
HERE = Path(__file__).resolve()


def fake_engine_python(directory: Path) -> Path:
    """Write (into ``directory``) the interpreter wrapper to put in an engine config's ``python:``.

    ``<it> -m sglang.launch_server ...`` runs this fake with that argv; anything else (the product's
    ``-c`` probe of the interpreter) goes to the real interpreter unchanged.
    """
    wrapper = directory / "fake-engine-python"
    wrapper.write_text(
        "#!/bin/sh\n"
        "# FAKE engine interpreter (tests/fake_engine.py): runs the fake instead of SGLang's server.\n"
        f'if [ "$1" = "-m" ] && [ "$2" = "sglang.launch_server" ]; then exec {sys.executable} {HERE} "$@"; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return wrapper


@contextmanager
def running_fake_engine(directory: Path, served_name: str = "m", env: dict[str, str] | None = None) -> Iterator[str]:
    """The fake run on its own (no key) until the block ends: its base URL, for a ``url:`` model. ``env``: variables
    added to this process's (``FAKE_ENGINE_TOKEN_S``, ``FAKE_ENGINE_ANSWERS``...)."""
    from tests.servers import server_process  # not imported when this file runs as the engine

    model = directory / "fake-model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text("{}")
    argv = [sys.executable, str(HERE), "-m", "sglang.launch_server", "--model-path", str(model), "--port", "{port}"]
    argv += ["--served-model-name", served_name]
    environment = {**os.environ, **env} if env else None
    with server_process(argv, log_path=directory / "fake-engine.log", ready_path="/health", timeout_s=60, env=environment) as server:
        yield server.url


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fake-sglang")
    parser.add_argument("-m", dest="module")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--served-model-name")
    parser.add_argument("--max-total-tokens", type=int, default=4096)
    parser.add_argument("--config")
    parser.add_argument("--enable-memory-saver", action="store_true")
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("--lora-paths", nargs="*", default=[])
    parsed, _ = parser.parse_known_args(argv)  # SGLang's other flags mean nothing to a fake
    return parsed


def _chunk(model: str, created: int, cid: str, delta: dict[str, Any], finish: str | None = None) -> bytes:
    body = {
        "id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }  # fmt: skip
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _note(call: str) -> None:
    if CALLS:
        with open(CALLS, "a") as calls:
            calls.write(call + "\n")


def build_app(
    model: str, api_key: str | None, context_length: int, memory_saver: bool = False, adapters: tuple[str, ...] = (),
    lora: bool = False,
) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    responses: dict[str, dict[str, Any]] = {}
    loaded = set(adapters)  # LoRA adapters served now: those of --lora-paths, then as loaded and unloaded
    running = [0]
    generated = [0]  # pieces generated so far (its sglang:realtime_tokens_total)
    released = [False]

    def refused(request: Request) -> Response | None:
        if api_key and request.headers.get("authorization") != f"Bearer {api_key}":
            return JSONResponse({"error": {"message": "Unauthorized", "type": "invalid_request_error", "code": 401}}, 401)
        return None

    async def health(request: Request) -> Response:
        while HEALTH_BEHIND and running[0]:
            await asyncio.sleep(0.01)
        return Response(b"", 200)

    async def metrics(request: Request) -> Response:
        text = f'sglang:num_running_reqs{{model_name="{model}"}} {running[0]}\nsglang:num_queue_reqs{{model_name="{model}"}} 0\n'
        text += f'sglang:realtime_tokens_total{{model_name="{model}",mode="decode"}} {float(generated[0])}\n'
        return Response(text, media_type="text/plain")

    async def generate(tokens: int) -> None:
        """The time ``tokens`` pieces take, counted as they are made."""
        for _ in range(tokens):
            await asyncio.sleep(TOKEN_S)
            generated[0] += 1

    async def server_info(request: Request) -> Response:
        if (no := refused(request)) is not None:
            return no
        return JSONResponse({"model_path": model, "version": SGLANG_VERSION})

    async def models(request: Request) -> Response:
        if (no := refused(request)) is not None:
            return no
        card = {"id": model, "object": "model", "created": int(time.time()), "owned_by": "sglang", "max_model_len": context_length}
        return JSONResponse({"object": "list", "data": [card]})

    async def chat(request: Request) -> Response:
        if (no := refused(request)) is not None:
            return no
        body = await request.json()
        _note("chat-while-released" if released[0] else "chat")
        asked = body.get("model")
        if isinstance(asked, str) and ":" in asked and asked.split(":", 1)[1] not in loaded:  # SGLang's "<model>:<adapter>"
            return JSONResponse({"error": {"message": f"adapter of {asked!r} not loaded (FAKE)", "type": "invalid_request_error", "code": 400}}, 400)
        if released[0]:
            return JSONResponse({"error": {"message": "memory released (FAKE)", "type": "server_error", "code": 500}}, 500)
        if any(message.get("content") == CRASH for message in body.get("messages", ())):
            await asyncio.sleep(0.2)  # the request is in flight when the engine dies
            try:
                raise IndexError("index out of range in self (FAKE)")  # what SGLang's scheduler logs for a bad token id
            except IndexError:  # logged as SGLang's scheduler logs a crash (the gateway reads the marker and the exception)
                print(f"Scheduler hit an exception: {traceback.format_exc()}", file=sys.stderr, flush=True)
            os._exit(70)
        if any(message.get("content") == FREEZE for message in body.get("messages", ())):
            time.sleep(3600)  # blocks the event loop: a frozen engine (SIGTERM's handler never gets to run either)
        if any(message.get("content") == FREEZE_LATER for message in body.get("messages", ())):
            # work that outlives its client (a grammar compile goes on after the client left): the engine freezes later
            asyncio.get_running_loop().call_later(float(os.environ.get("FAKE_ENGINE_FREEZE_AFTER_S", "1")), time.sleep, 3600)
            await asyncio.sleep(3600)  # no answer: the client gives up first
        tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        piece = f"{asked.split(':', 1)[1]} " if isinstance(asked, str) and ":" in asked else TOKEN  # an adapter's own words
        created, cid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
        usage = {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": 5 + tokens}
        if not body.get("stream"):
            running[0] += 1
            try:
                await generate(tokens)
            finally:
                running[0] -= 1
            content = piece * tokens
            if (body.get("response_format") or {}).get("type") == "json_schema":  # constrained output: JSON saying what it answered
                content = json.dumps({"answer": content.strip(), "prompt": (body.get("messages") or [{}])[-1].get("content")})
            message = {"role": "assistant", "content": content}
            if ANSWERS:  # what was answered (a batch test counts each line's answers)
                with open(ANSWERS, "a") as answers:
                    answers.write(str((body.get("messages") or [{}])[-1].get("content")) + "\n")
            return JSONResponse({
                "id": cid, "object": "chat.completion", "created": created, "model": model, "usage": usage,
                "fake_priority": body.get("priority"),  # what the request's priority was, as the engine got it
                "fake_model": asked,  # the model the request named, as the engine got it
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "length"}],
            })  # fmt: skip

        async def events() -> Any:
            running[0] += 1
            try:
                yield _chunk(model, created, cid, {"role": "assistant", "content": ""})
                for _ in range(tokens):
                    await generate(1)
                    yield _chunk(model, created, cid, {"content": piece})
                yield _chunk(model, created, cid, {}, "length")
                yield b"data: [DONE]\n\n"
                _note("chat-end")
            finally:
                running[0] -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    async def messages(request: Request) -> Response:
        if (no := refused(request)) is not None:
            return no
        body = await request.json()
        last = (body.get("messages") or [{}])[-1].get("content")
        if last == REFUSE:
            return JSONResponse({"object": "error", "message": "refused (FAKE)", "type": "BadRequestError", "param": None, "code": 400}, 400)
        tokens = int(body.get("max_tokens") or 16)
        running[0] += 1
        try:
            await generate(tokens)
        finally:
            running[0] -= 1
        if ANSWERS:
            with open(ANSWERS, "a") as answers:
                answers.write(str(last) + "\n")
        return JSONResponse({
            "id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": TOKEN * tokens}], "stop_reason": "max_tokens", "stop_sequence": None,
            "usage": {"input_tokens": 5, "output_tokens": tokens}, "fake_priority": body.get("priority"),
        })  # fmt: skip

    def memory(release: bool) -> Any:
        async def call(request: Request) -> Response:
            if (no := refused(request)) is not None:
                return no
            if not memory_saver:
                return JSONResponse({"error": {"message": "memory saver is off (FAKE)", "code": 400}}, 400)
            _note("release" if release else "resume")
            released[0] = release
            return JSONResponse({"success": True})

        return call

    def lora(load: bool) -> Any:
        async def call(request: Request) -> Response:
            if (no := refused(request)) is not None:
                return no
            body = await request.json()
            name = body["lora_name"]
            _note(f"{'load' if load else 'unload'} {name}")
            if not lora:
                error = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA. (FAKE)"
            elif load and "broken" in body.get("lora_path", ""):
                error = f"Failed to load LoRA adapter {name}: no adapter_config.json in {body['lora_path']} (FAKE)"
            elif load and name in loaded:
                error = f"LoRA adapter {name} is already loaded (FAKE)"
            elif not load and name not in loaded:
                error = f"LoRA with name {name} does not exist (FAKE)"
            else:
                (loaded.add if load else loaded.discard)(name)
                return JSONResponse({"success": True, "error_message": None, "loaded_adapters": {n: n for n in loaded}})
            return JSONResponse({"success": False, "error_message": error, "loaded_adapters": None}, 400)

        return call

    async def create_response(request: Request) -> Response:
        if (no := refused(request)) is not None:
            return no
        body = await request.json()
        tokens = int(body.get("max_output_tokens") or 16)
        rid = f"resp_{uuid.uuid4().hex}"
        text = TOKEN * tokens
        item = {
            "id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }  # fmt: skip
        stored = {
            "id": rid, "object": "response", "created_at": int(time.time()), "model": model, "status": "completed",
            "output": [item], "previous_response_id": body.get("previous_response_id"), "parallel_tool_calls": True,
            "tool_choice": "auto", "tools": [], "usage": {"input_tokens": 5, "output_tokens": tokens, "total_tokens": 5 + tokens},
        }  # fmt: skip
        responses[rid] = stored
        return JSONResponse(stored)

    async def get_response(request: Request) -> Response:
        if (no := refused(request)) is not None:
            return no
        stored = responses.get(request.path_params["rid"])
        if stored is None:
            return JSONResponse({"error": {"message": "Response not found", "type": "invalid_request_error", "code": 404}}, 404)
        return JSONResponse(stored)

    async def cancel_response(request: Request) -> Response:
        if (no := refused(request)) is not None:
            return no
        stored = responses.get(request.path_params["rid"])
        if stored is None:
            return JSONResponse({"error": {"message": "Response not found", "type": "invalid_request_error", "code": 404}}, 404)
        stored["status"] = "cancelled"
        return JSONResponse(stored)

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/metrics", metrics),
            Route("/v1/models", models),
            Route("/get_server_info", server_info),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/messages", messages, methods=["POST"]),
            Route("/v1/responses", create_response, methods=["POST"]),
            Route("/v1/responses/{rid}", get_response),
            Route("/v1/responses/{rid}/cancel", cancel_response, methods=["POST"]),
            Route("/load_lora_adapter", lora(True), methods=["POST"]),
            Route("/unload_lora_adapter", lora(False), methods=["POST"]),
            Route("/release_memory_occupation", memory(True), methods=["POST"]),
            Route("/resume_memory_occupation", memory(False), methods=["POST"]),
        ]
    )


def main(argv: list[str]) -> int:
    args = _args(argv)
    print(f"fake engine (tests/fake_engine.py) for {args.model_path} on port {args.port}", flush=True)
    try:
        json.loads((Path(args.model_path) / "config.json").read_text())
    except (OSError, ValueError) as error:
        time.sleep(1.0)  # a real engine fails a moment into its start, not at once
        print("Traceback (most recent call last):", flush=True)
        print(f"{type(error).__name__}: {error}", flush=True)
        return 1
    time.sleep(START_S)
    api_key = None
    if args.config:
        import yaml

        api_key = (yaml.safe_load(Path(args.config).read_text()) or {}).get("api-key")
    import uvicorn

    adapters = tuple(item.split("=", 1)[0] for item in args.lora_paths)  # --lora-paths name=path ...
    app = build_app(
        args.served_model_name or args.model_path, api_key, args.max_total_tokens, args.enable_memory_saver, adapters, args.enable_lora
    )
    # SIGTERM ends it within a second, streams or not (as SGLang's does; uvicorn alone would wait for them).
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False, timeout_graceful_shutdown=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
