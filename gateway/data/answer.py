"""The last stage of a proxied request: the upstream's answer made the client's. A plain answer goes back with its
usage noted (an embedding model's ``model`` set to the client's name; SGLang's fields that the SDKs' models refuse
taken out, :mod:`gateway.data.answer_extensions`); a stream is handed to the relay
(:class:`gateway.data.relay.SSEProxyResponse`), which then holds the request's lease; an error is the route's
dialect's; a client that left before the answer is noted (499) with the prompt the engine took."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import aiohttp
import orjson
from starlette.responses import Response

from engine_guard.tool_calls import forced_call_problem
from gateway.core.call import Call
from gateway.core.errors import GatewayError, StreamKind, upstream_error
from gateway.core.metrics import Metrics
from gateway.core.responses_index import ResponseIndex
from gateway.data.answer_extensions import drop_schema_breaking
from gateway.data.exchange import Exchanged
from gateway.data.lease import Lease
from gateway.data.prompt_count import count_prompt
from gateway.data.relay import SSEProxyResponse
from gateway.data.usage_request import prompt_bound


async def answer(
    call: Call, lease: Lease, exchanged: Exchanged, session: aiohttp.ClientSession, metrics: Metrics, responses: ResponseIndex
) -> Response:
    """The client's response to ``exchanged``. ``session`` counts the prompt of a request whose answer nobody
    takes; ``responses`` learns where a Responses API response is stored, and whose it is."""
    backend, info, path, body = exchanged.backend, call.info, call.endpoint.upstream_path, call.body
    if exchanged.answer is None:
        info.error = "client disconnected"
        # the engine took the prompt (and aborts what it was generating, which the gateway never sees)
        counted = await count_prompt(session, backend, path, body)
        info.prompt_tokens = counted if counted is not None else info.prompt_estimate or prompt_bound(len(exchanged.payload))
        return Response(b"", status_code=499)  # nobody is listening; 499 only shows in logs/metrics
    upstream, content = exchanged.answer
    call.notes.answered(content, call.streamed)
    if upstream.status != 200:
        raise upstream_error(upstream.status, content or b"", body)
    endpoint, model = call.endpoint, call.route.name
    if call.streamed:
        on_created = (lambda response_id: responses.record(response_id, model, backend.identity, call.owner)) if endpoint.response_ids else None
        counter = partial(count_prompt, session, backend, path, body)  # for a stream that ends without usage
        kind = endpoint.stream or StreamKind.DATA
        return SSEProxyResponse(lease, info, metrics, model, kind, on_created, body, call.hide_usage, counter)
    info.ttft_s = time.perf_counter() - info.started
    strict = endpoint.sdk_strict and not call.keep_extensions
    markers = (b'"id"',) if endpoint.response_ids else (b'"usage"', b'"metadata"') if strict else (b'"usage"',)
    data = _parsed_if(content or b"", *markers)
    if strict and data is not None and drop_schema_breaking(data):
        content = orjson.dumps(data)  # (SGLang's chat and text completions: every one; one dump, no second parse)
    if data is not None:
        info.set_usage(data.get("usage"))
        problem = forced_call_problem(path, body, data)
        if problem is not None:  # a forced choice promises a call: never a 200 without one
            raise GatewayError(502, problem, code="forced_call_missing")
        if endpoint.response_ids and isinstance(data.get("id"), str):
            await responses.publish(data["id"], model, backend.identity, call.owner)
    if endpoint.renames_model:  # SGLang names an embedding model by its path (a file path on this host)
        content = _with_model(content or b"", data, backend.served_name)
    return PlainAnswer(content or b"", upstream.content_type or "application/json")


class PlainAnswer(Response):
    """A 200 with ``content`` as ``media_type``: Starlette's ``Response`` with the same two headers (its length, its
    type, a ``text/`` type given Starlette's charset), set in one step instead of through ``init_headers``' general
    case (a plain answer's Python is a tenth cheaper than a stream's, the router's half: every step shows)."""

    def __init__(self, content: bytes, media_type: str) -> None:
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        self.body = content
        if media_type.startswith("text/") and "charset=" not in media_type.lower():
            media_type += "; charset=" + self.charset
        self.raw_headers = [(b"content-length", b"%d" % len(content)), (b"content-type", media_type.encode("latin-1"))]


def _with_model(content: bytes, data: dict[str, Any] | None, name: str) -> bytes:
    """``content`` (a JSON object, ``data`` when already parsed) with its ``model`` set to ``name``; anything
    else unchanged. Parsed once: an embeddings answer can be megabytes of vectors."""
    if data is None:
        data = _parsed_if(content, b'"model"')
    if data is None or "model" not in data:
        return content
    data["model"] = name
    return orjson.dumps(data)


def _parsed_if(content: bytes, *markers: bytes) -> dict[str, Any] | None:
    """The JSON object in ``content`` when it mentions one of ``markers`` (most answers need no parsing)."""
    if not any(marker in content for marker in markers):
        return None
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None
