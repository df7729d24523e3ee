"""What one admitted request holds while it runs, and gives back once: its slot, its counts, its upstream."""

from __future__ import annotations

from typing import Any

from engine_guard.shapes import payload_shape
from gateway.core.backends import Backend
from gateway.core.limits import ConcurrencyLimiter
from gateway.core.poison import Suspicion
from gateway.data.stream_pool import (
    StreamExchange,
    UpstreamPoolFull,
    UpstreamUnreachable,
)

LONG_PROMPT_BYTES = 64 * 1024
"""A request body this large holds a prompt whose prefill can take the engine seconds on a CPU, after its client left."""


class Lease:
    """What one admitted request holds, given back by :meth:`close` (once, in reverse order of taking).

    Its limiter slot, its count in the backend's and the gauge's in-flight numbers, and the upstream
    response: a fully read one gives its connection back to the pool; one cut short is closed, which
    is what tells the engine that nobody listens any more (it aborts the request).
    """

    __slots__ = ("limiter", "backend", "gauge", "upstream", "request", "shape", "grammar", "adapter", "key", "lingers")

    def __init__(self, limiter: ConcurrencyLimiter) -> None:
        self.limiter: ConcurrencyLimiter | None = limiter
        self.grammar = False  # holds one of the limiter's grammar slots
        self.backend: Backend | None = None
        self.gauge: Any = None
        self.upstream: StreamExchange | None = None
        self.request: tuple[str, bytes] | None = None  # (path, body) as sent upstream
        self.shape: str | None = None  # the request shape of that body (engine_guard.shapes): the quarantine's unit
        self.adapter: str | None = None  # the LoRA adapter it selects: an unload waits for it (gateway.control.adapters)
        self.key: str | None = None  # the client key that sent it (name or hash; None: open gateway): whose evidence it is
        self.lingers = False  # its engine work can outlive it (a grammar to compile): a suspect for a while if it leaves early

    def take(self, backend: Backend, gauge: Any) -> None:
        """Count this request on ``backend`` (and in the model's in-flight gauge: ``gauge.inc(1)``, the count of
        :meth:`gateway.core.metrics.Metrics.in_flight_count`)."""
        backend.in_flight += 1
        backend.active.add(self)
        self.backend = backend
        if self.gauge is None:
            self.gauge = gauge
            gauge.inc(1)

    def let_go(self) -> None:
        """Give back the backend (and its upstream response) but keep the slot: for a retry elsewhere."""
        upstream, self.upstream = self.upstream, None
        if upstream is not None:
            upstream.close()
        backend, self.backend = self.backend, None
        if backend is not None:
            backend.in_flight -= 1
            backend.active.discard(self)

    def note_if_lost(self, error: BaseException) -> None:
        """Remember this request on its backend when ``error`` means the connection broke under it
        (not a refused connect, not a timeout): if the engine died, the request is a suspect."""
        if self.backend is None or self.request is None:
            return
        if isinstance(error, (TimeoutError, UpstreamUnreachable, UpstreamPoolFull)):
            return
        self.backend.lost.append(self._suspicion(self.backend))

    def suspect(self) -> Suspicion | None:
        """This request's shape and key, when it is upstream (a suspect if its engine freezes), and whether its
        backend answered a request of that shape in full before."""
        return self._suspicion(self.backend) if self.request is not None and self.backend is not None else None

    def _suspicion(self, backend: Backend) -> Suspicion:
        shape = self.shape if self.shape is not None else payload_shape(*self.request)  # type: ignore[misc]
        return (shape, self.key, shape in backend.completed)

    def _lingers(self) -> bool:
        """Whether the engine may still be working for this request after it left: a grammar to compile (the engine
        compiles on after the client has gone), or a prompt long enough for a prefill of seconds."""
        return self.lingers or (self.request is not None and len(self.request[1]) >= LONG_PROMPT_BYTES)

    def release_grammar(self) -> None:
        """Give back the grammar slot: the engine has compiled the grammar (a stream's first bytes came)."""
        if self.grammar and self.limiter is not None:
            self.grammar = False
            self.limiter.release_grammar()

    def close(self) -> None:
        self.release_grammar()
        upstream, self.upstream = self.upstream, None
        answered = False
        if upstream is not None:
            answered = _answered_in_full(upstream)
            if self.shape is not None and self.backend is not None and answered:
                self.backend.note_completed(self.shape)
            upstream.release()  # an answer cut short is closed by it (the engine aborts the request)
        if not answered and self.backend is not None and self.request is not None and self._lingers():
            self.backend.note_lingering(self._suspicion(self.backend))  # gone, but its engine work may not be
        gauge, self.gauge = self.gauge, None
        if gauge is not None:
            gauge.inc(-1)
        backend, self.backend = self.backend, None
        if backend is not None:
            backend.in_flight -= 1
            backend.active.discard(self)
        limiter, self.limiter = self.limiter, None
        if limiter is not None:
            limiter.release()


def _answered_in_full(upstream: StreamExchange) -> bool:
    """The engine answered with success and its answer came to its end: it did not die of this request. (Not a 4xx:
    a request the engine refused was not run, so it says nothing of its shape.)"""
    return 200 <= upstream.status < 300 and upstream.is_complete
