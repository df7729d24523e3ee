"""The wrapper's own engine transport: chat-completions requests over the ``openai`` client's pooled ``httpx``
client, answers parsed by ``orjson`` into plain dicts, one pass per stream chunk.

The ``openai`` SDK builds a pydantic model per streamed chunk (~100-200 µs of CPU each) that the flavours then
take apart again; here a chunk is one ``orjson.loads`` of its ``data:`` line. Failures are raised as the very
``openai`` exceptions the SDK raises for them (its own status-error mapping, ``APIConnectionError`` /
``APITimeoutError`` from the ``httpx`` error, ``APIError`` for an error event mid-stream), so the client's
retries, quarantine and :func:`model_code.errors.from_openai_error` treat both paths alike.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

import httpx
import openai
import orjson

_JSON_HEADERS = {"Content-Type": "application/json", "Accept": "application/json"}


class LeanTransport:
    """POSTs to ``{base_url}/chat/completions`` through ``sdk``'s ``httpx`` client (its pool, auth and timeout)."""

    def __init__(self, sdk: openai.OpenAI, timeout: float) -> None:
        self.sdk = sdk
        self.url = f"{str(sdk.base_url).rstrip('/')}/chat/completions"
        self.headers = {**_JSON_HEADERS, "Authorization": f"Bearer {sdk.api_key}"}
        self.timeout = timeout

    def _send(self, body: Mapping[str, Any], extra_headers: Mapping[str, str] | None, stream: bool) -> httpx.Response:
        http: httpx.Client = self.sdk._client  # the SDK's pooled client: one pool per replica, shared with it
        headers = {**self.headers, **extra_headers} if extra_headers else self.headers
        request = http.build_request("POST", self.url, content=_json_bytes(body), headers=headers, timeout=self.timeout)
        try:
            response = http.send(request, stream=stream)
        except httpx.TimeoutException as error:
            raise openai.APITimeoutError(request=request) from error
        except Exception as error:  # what the SDK turns into a connection error
            raise openai.APIConnectionError(request=request) from error
        if response.status_code >= 400:
            try:
                response.read()
            finally:
                response.close()
            raise self.sdk._make_status_error_from_response(response)
        return response

    def post(self, body: Mapping[str, Any], extra_headers: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The completion of a non-streaming request, as a dict."""
        response = self._send(body, extra_headers, stream=False)
        data = orjson.loads(response.content)
        _raise_error_event(data, response)
        return data

    def stream(self, body: Mapping[str, Any], extra_headers: Mapping[str, str] | None = None) -> Iterator[dict[str, Any]]:
        """The chunks of a streaming request as dicts, until ``[DONE]``. The request is sent now (a refused
        one raises here, as the SDK's ``create`` does); the response is closed when the caller stops (``close()``)."""
        return _chunks(self._send(body, extra_headers, stream=True))


def _chunks(response: httpx.Response) -> Iterator[dict[str, Any]]:
    try:
        for data in sse_data(response.iter_bytes()):
            if data.startswith(b"[DONE]"):
                break
            chunk = orjson.loads(data)
            _raise_error_event(chunk, response)
            yield chunk
    finally:
        response.close()


def sse_data(pieces: Iterator[bytes]) -> Iterator[bytes]:
    """The ``data`` of each server-sent event in a byte stream (multi-line data joined by ``\\n``; other
    fields and comments skipped), as the SDK's decoder reads it."""
    buffer = b""
    data: list[bytes] = []
    for piece in pieces:
        buffer += piece
        start = 0
        while True:
            end = buffer.find(b"\n", start)
            if end < 0:
                break
            line = buffer[start:end]
            start = end + 1
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if data:
                    yield data[0] if len(data) == 1 else b"\n".join(data)
                    data = []
            elif line.startswith(b"data:"):
                value = line[5:]
                data.append(value[1:] if value.startswith(b" ") else value)
        buffer = buffer[start:]
    if buffer.rstrip(b"\r").startswith(b"data:"):  # a last event without its blank line
        value = buffer.rstrip(b"\r")[5:]
        data.append(value[1:] if value.startswith(b" ") else value)
    if data:
        yield b"\n".join(data)


def _raise_error_event(data: Any, response: httpx.Response) -> None:
    """An ``{"error": ...}`` payload, raised as the SDK raises it (an ``APIError`` with the error as its body)."""
    if isinstance(data, dict) and data.get("error"):
        error = data["error"]
        message = error.get("message") if isinstance(error, dict) else None
        if not message or not isinstance(message, str):
            message = "An error occurred during streaming"
        raise openai.APIError(message=message, request=response.request, body=error)


def _json_bytes(body: Mapping[str, Any]) -> bytes:
    """The body as JSON: orjson, or the standard library for what orjson cannot write (an integer past 64 bits, which
    a Python caller may pass and the openai SDK's path sends as it is)."""
    try:
        return orjson.dumps(body)
    except TypeError:
        return json.dumps(body).encode()
