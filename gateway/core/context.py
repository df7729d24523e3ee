"""What the gateway learns about one request while serving it (for the log line, metrics and, in
:class:`RequestTrace`, the spans that :mod:`gateway.core.tracing` builds from it)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from opentelemetry.trace import SpanContext

SCOPE_KEY = "gateway.request"
BATCH_SCOPE_KEY = "gateway.batch"  # the batch id of a batch line's request (set by gateway.batches.dispatch)
ANTHROPIC_CACHE_COUNTS = ("cache_read_input_tokens", "cache_creation_input_tokens")  # prompt tokens input_tokens leaves out

_IDS_PER_DRAW = 256  # request ids drawn from the OS's random source at once


class _RequestIds:
    """Random request ids (32 hex digits, as ``secrets.token_hex(16)``), from the same source (``os.urandom``), drawn
    :data:`_IDS_PER_DRAW` at a time: one system call per 256 requests instead of one each. A forked child draws
    its own (it must never repeat its parent's)."""

    __slots__ = ("_hex", "_at")

    def __init__(self) -> None:
        self._hex = ""
        self._at = 0

    def next(self) -> str:
        at = self._at
        if at >= len(self._hex):
            self._hex, at = os.urandom(16 * _IDS_PER_DRAW).hex(), 0
        self._at = at + 32
        return self._hex[at : at + 32]

    def forget(self) -> None:
        self._hex, self._at = "", 0


_request_ids = _RequestIds()
os.register_at_fork(after_in_child=_request_ids.forget)
new_request_id = _request_ids.next


@dataclass(slots=True)
class Attempt:
    """One exchange with an upstream: the engine's spans hang under this one's ``span_id``."""

    span_id: int
    model: str  # the name the engine serves
    url: str
    replica: int | None
    started: float  # time.perf_counter() readings, like RequestInfo.started
    first_byte: float | None = None  # the response head arrived
    ended: float | None = None  # the last byte (a stream's end), or the failure
    error: str | None = None


@dataclass(slots=True)
class RequestTrace:
    """What one request notes for its spans (the ids are fixed at its start: the engine learns them then)."""

    trace_id: int
    span_id: int
    parent: SpanContext | None
    sampled: bool
    tracestate: str | None
    wall_ns: int  # time.time_ns() when the request started
    started: float  # its time.perf_counter()
    queued: tuple[float, float] | None = None
    attempts: list[Attempt] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    finish_reasons: tuple[str, ...] = ()

    def ns(self, at: float) -> int:
        return self.wall_ns + int((at - self.started) * 1e9)


class RequestInfo:
    """What one request notes as it goes, for its log line, metrics, ledger row and trace.

    Not a dataclass: its twenty fields are class-level defaults, and a request assigns only those it sets (a dataclass's
    ``__init__`` wrote all twenty, every request)."""

    def __init__(self, request_id: str, method: str, path: str, started: float | None = None) -> None:
        self.request_id = request_id
        self.method = method
        self.path = path
        self.started = time.perf_counter() if started is None else started

    request_id: str
    method: str
    path: str
    started: float
    model: str | None = None  # the route's model name, set once the name resolved (bounded label set)
    replica: int | None = None  # which of the model's replicas served it
    stream: bool = False
    status: int | None = None
    ttft_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens the engine served from its prefix cache, when it says
    error: str | None = None  # short reason for failures (never a key or a body)
    error_code: str | None = None  # the error's code in the answer (invalid_request, engine_unavailable...)
    key_name: str | None = None  # the named key (tenant) that called; None for plain keys and an open gateway
    trace: RequestTrace | None = None  # what its spans need (gateway.core.tracing); None with tracing off
    # headers an inner layer adds to the answer (a limited key's rate-limit headers): the request-id layer writes
    # them into the response start it already rewrites, so no layer wraps ``send`` for them
    extra_headers: Sequence[tuple[bytes, bytes]] = ()
    # a limited key's reservation (gateway.edge.quota): called with what the request may cost, raises a 429 when
    # that does not fit; ``reserved`` is what it holds until the end, ``prompt_estimate`` its prompt part (what a
    # stream that ends without the engine's usage is charged for its prompt)
    reserve: Callable[[int], None] | None = None
    reserved: int = 0
    prompt_estimate: int | None = None
    batch_id: str | None = None  # a batch line's request: its batch (the ledger row says so)

    def set_usage(self, usage: Any) -> None:
        """Take the token counts of a usage object (:func:`usage_counts`); absent counts keep earlier ones."""
        if isinstance(usage, dict):
            prompt, completion, cached = usage_counts(usage)
            self.prompt_tokens = prompt if prompt is not None else self.prompt_tokens
            self.completion_tokens = completion if completion is not None else self.completion_tokens
            self.cached_tokens = cached if cached is not None else self.cached_tokens


def usage_counts(usage: dict[str, Any]) -> tuple[int | None, int | None, int | None]:
    """(prompt, completion, cached prompt) tokens of an OpenAI (``prompt_tokens``/``completion_tokens``) or a
    Responses / Anthropic (``input_tokens``/``output_tokens``) usage object; None for a count it does not give.

    Cached prompt tokens: OpenAI's ``prompt_tokens_details.cached_tokens`` (Responses: ``input_tokens_details``) or
    Anthropic's ``cache_read_input_tokens``. Anthropic's ``input_tokens`` leaves out the prompt tokens read from or
    written to the cache (SGLang's Messages too: its prompt less the prefix-cache hit), so the prompt is their sum;
    OpenAI's and Responses' counts include the cached ones."""
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    completion = usage.get("completion_tokens", usage.get("output_tokens"))
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else usage.get("cache_read_input_tokens")
    if isinstance(prompt, int) and "prompt_tokens" not in usage and not isinstance(details, dict):
        prompt += sum(value for key in ANTHROPIC_CACHE_COUNTS if isinstance(value := usage.get(key), int))
    return (
        prompt if isinstance(prompt, int) else None,
        completion if isinstance(completion, int) else None,
        cached if isinstance(cached, int) else None,
    )


def request_info(scope: dict[str, Any]) -> RequestInfo | None:
    return scope.get(SCOPE_KEY)
