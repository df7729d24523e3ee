"""The ResponsesAgent flavour behind MLflow's ``AgentServer`` (what Databricks Apps run): ``POST /invocations`` and
``POST /responses`` (SSE with ``"stream": true``), ``GET /agent/info``, ``GET /health``.

Run ``python -m model_code.agent_server SOURCE`` where SOURCE is a deployment YAML or a logged ResponsesAgent
model (``models:/...``, ``runs:/...``, a local model folder). The port is ``--port``, else ``DATABRICKS_APP_PORT``
(what an App gets from the platform), else 8000.

One engine per host however many workers: this process loads the agent first (starting the engine, or joining
the one this machine runs, or connecting to the config's URL), so a start that fails ends the command before the
port is bound, and every uvicorn worker then joins that engine (``engine_sharing: shared``, the default) when it
starts, before it accepts a request. The engine stops when the server does: each worker releases it on shutdown
and this process after uvicorn returns (SIGTERM included). A logged model is downloaded once, here, and every
worker loads that copy: the weights path, part of the shared engine's key, is then the same for all.

What ``AgentServer`` (MLflow 3.17) does on its own and this adapts:

- it calls a plain ``@invoke`` function on its event loop, so a worker would serve one call at a time (its
  ``/health`` blocked meanwhile): the flavour's ``predict`` runs in the thread pool, and ``predict_stream`` in a
  thread of its own per stream (:func:`in_one_thread`);
- it answers any failure of ``@invoke`` with 500: a flavour error keeps its own status here (400 for a request the
  guard refuses, 503 while the engine is unavailable...), as ``mlflow models serve`` answers it.
  A stream that fails sends ``AgentServer``'s ``{"error": ...}`` event (its status is 200 by then);
- its ``run()`` parses ``sys.argv`` and reads no environment: this module runs uvicorn itself, with the same
  arguments plus the source.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

from mlflow.genai.agent_server import AgentServer, get_invoke_function, get_stream_function, invoke, stream
from mlflow.pyfunc import ResponsesAgent
from mlflow.types.responses import ResponsesAgentRequest, ResponsesAgentResponse, ResponsesAgentStreamEvent

from model_code.errors import EngineRequestError
from model_code.flavors.responses_agent import SGLangResponsesAgent, _ResponsesAgentMethods

T = TypeVar("T")
SOURCE_ENV = "SGLANG_GATEWAY_AGENT_SOURCE"
"""What the workers load: the YAML file or local model folder the command resolved its SOURCE to."""
PORT_ENV = "DATABRICKS_APP_PORT"
DEFAULT_PORT = 8000
APP_FACTORY = "model_code.agent_server:create_app"
YAML_SUFFIXES = (".yaml", ".yml")
WORKER_HEALTHCHECK_S = 120
"""How long uvicorn's supervisor waits for a worker's answer before killing it as hung. Its default, 5 s, is less
than a spawned worker takes to import MLflow on a busy machine: the workers were killed and respawned in a loop."""

_AGENT: _ResponsesAgentMethods | None = None
"""This process's agent (the command's own, or a worker's)."""


# ------------------------------------------------------------------------------------------ the agent
def is_config_file(source: str) -> bool:
    return Path(source).suffix in YAML_SUFFIXES and Path(source).is_file()


def local_source(source: str, into: Path) -> str:
    """SOURCE as something every worker can load without downloading it again: a YAML file or a model folder."""
    if is_config_file(source) or Path(source).is_dir():
        return str(Path(source).resolve())
    import mlflow.artifacts

    return mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(into))


def load_agent(source: str) -> _ResponsesAgentMethods:
    """The ResponsesAgent of a deployment YAML or a logged model, with its engine started or joined."""
    if is_config_file(source):
        from model_code.log import config_dict

        agent = SGLangResponsesAgent()
        agent.load_context(SimpleNamespace(model_config=config_dict(source), artifacts={}))
        return agent
    import mlflow.pyfunc

    from model_code.loaded import close_model, python_model_of

    model = mlflow.pyfunc.load_model(source)
    agent = python_model_of(model)
    if not isinstance(agent, ResponsesAgent):  # the model's class comes from its own packed code: not ours by identity
        close_model(model)
        raise ValueError(
            f"{source}: AgentServer serves the responses_agent flavour; this model is {type(agent).__name__} "
            "(log it with flavor='responses_agent')"
        )
    return agent


def current_agent() -> _ResponsesAgentMethods:
    if _AGENT is None:
        raise RuntimeError(f"no agent loaded in this process (start the server with python -m {__name__})")
    return _AGENT


# ------------------------------------------------------------------------------------------ what AgentServer calls
async def predict(request: ResponsesAgentRequest) -> ResponsesAgentResponse:
    """The flavour's ``predict``, off the event loop."""
    from starlette.concurrency import run_in_threadpool

    return await run_in_threadpool(current_agent().predict, request)


async def predict_stream(request: ResponsesAgentRequest) -> AsyncIterator[ResponsesAgentStreamEvent]:
    """The flavour's ``predict_stream``, iterated in a thread of its own, each event handed over as it comes."""
    async for event in in_one_thread(current_agent().predict_stream(request)):
        yield event


async def in_one_thread(items: Iterator[T]) -> AsyncIterator[T]:
    """Iterate a blocking generator in ONE thread, in a copy of the caller's context, and yield its items here.

    Not a thread-pool hop per ``next()`` (starlette's ``iterate_in_threadpool``): each hop costs a round trip between
    threads, and runs the generator in a fresh copy of the context each time (a context variable set inside it
    could not be reset). The caller's context carries AgentServer's span and ``get_request_headers()``. Leaving
    early (the client went away) stops the thread at its next item and closes the generator (the engine's stream).
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[bool, Any]] = asyncio.Queue()
    stop = threading.Event()

    def put(more: bool, value: Any) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (more, value))
        except RuntimeError:  # the loop has closed: nobody is waiting any more
            stop.set()

    def produce() -> None:
        try:
            for item in items:
                if stop.is_set():
                    break
                put(True, item)
            put(False, None)
        except BaseException as error:  # handed to the consumer, who raises it where AgentServer reports it
            put(False, error)
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    context = contextvars.copy_context()
    threading.Thread(target=context.run, args=(produce,), name="agent-stream", daemon=True).start()
    try:
        while True:
            more, value = await queue.get()
            if not more:
                if value is not None:
                    raise value
                return
            yield value
    finally:
        stop.set()


def register_functions() -> None:
    """Hand ``AgentServer`` this module's invoke and stream functions (once per process: its registry is global)."""
    if get_invoke_function() is None:
        invoke()(predict)
    if get_stream_function() is None:
        stream()(predict_stream)
    if get_invoke_function() is not predict or get_stream_function() is not predict_stream:
        raise RuntimeError("another @invoke / @stream function is registered in this process")


class SGLangAgentServer(AgentServer):
    """``AgentServer`` for the ResponsesAgent flavour, answering a flavour error with its own status."""

    def __init__(self) -> None:
        super().__init__(agent_type="ResponsesAgent")

    async def _handle_invoke_request(self, request: Any, return_trace_id: bool) -> dict[str, Any]:
        from fastapi import HTTPException

        try:
            return await super()._handle_invoke_request(request, return_trace_id)
        except HTTPException as error:  # AgentServer turned the flavour's error into a 500: restore its status
            cause = error.__context__
            if not isinstance(cause, EngineRequestError):
                raise
            raise HTTPException(cause.status_code, detail=cause.message) from cause


def create_app() -> Any:
    """A worker's FastAPI app (uvicorn's factory): the agent loaded before the worker serves, released at shutdown."""
    global _AGENT
    owned = _AGENT is None  # one worker in the command's own process: it serves the agent the command loaded
    if owned:
        _AGENT = load_agent(os.environ[SOURCE_ENV])
    register_functions()
    app = SGLangAgentServer().app
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[Any]:
        global _AGENT
        async with inner(app) as state:
            try:
                yield state
            finally:
                if owned and _AGENT is not None:
                    _AGENT.close()
                    _AGENT = None

    app.router.lifespan_context = lifespan
    return app


# ------------------------------------------------------------------------------------------ the command
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__name__}",
        description="Serve a ResponsesAgent on SGLang with MLflow's AgentServer (/invocations, /responses).",
    )
    parser.add_argument("source", help="a deployment YAML, or a logged responses_agent model (models:/..., runs:/...)")
    parser.add_argument("--host", default="0.0.0.0", help="interface to listen on (default: all)")
    parser.add_argument(
        "--port", type=int, default=int(os.environ.get(PORT_ENV) or DEFAULT_PORT),
        help=f"port (default: ${PORT_ENV}, else {DEFAULT_PORT})",
    )  # fmt: skip
    parser.add_argument("--workers", type=int, default=1, help="uvicorn workers, all on one engine (default: 1)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    global _AGENT
    args = parse_args(argv)
    import uvicorn

    staging = Path(tempfile.mkdtemp(prefix="sglang-gateway-agent-"))
    try:
        source = local_source(args.source, staging)
        os.environ[SOURCE_ENV] = source  # the workers (spawned) inherit it
        try:
            _AGENT = load_agent(source)
        except Exception as error:  # a start that failed (preflight, engine exit, timeout), a wrong flavour
            print(f"error: {args.source}: {type(error).__name__}: {error}", file=sys.stderr)
            return 1
        client = getattr(_AGENT, "client", None)
        sharing = getattr(getattr(client, "settings", None), "engine_sharing", "shared")
        if args.workers > 1 and sharing != "shared" and getattr(client, "engine", None) is not None:
            print(f"error: --workers {args.workers} with engine_sharing: {sharing} would start an engine per worker",
                  file=sys.stderr)  # fmt: skip
            return 2
        uvicorn.run(
            APP_FACTORY, factory=True, host=args.host, port=args.port, workers=args.workers,
            timeout_worker_healthcheck=WORKER_HEALTHCHECK_S,
        )  # fmt: skip
        return 0
    finally:
        if _AGENT is not None:
            _AGENT.close()
            _AGENT = None
        shutil.rmtree(staging, ignore_errors=True)


if __name__ == "__main__":  # run as the module itself, so that uvicorn's factory finds the agent loaded here
    from model_code.agent_server import main as module_main

    sys.exit(module_main())
