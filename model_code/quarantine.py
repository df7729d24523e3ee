"""Calls that took the engine down are refused afterwards, as the gateway's quarantine refuses them.

The guard (:mod:`model_code.guard`) refuses the crash classes that are known. For the others: a call whose
connection broke after it was sent (the engine died under it) or that timed out (it froze) is a *suspect*,
and is never sent again (no retry, not even to a restarted shared engine). Its shape
(:func:`engine_guard.shapes.request_shape`, the gateway's fingerprint: fields, types and size classes, not the
words) is refused with a :class:`BadRequestError` once it was the only call of this model in flight when it
failed, or a suspect twice. The record lives as long as the loaded model (one per process): loading the
model again, or a new engine version, starts clean.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai

from engine_guard.shapes import fields_of
from model_code.errors import BadRequestError


def took_engine_down(error: BaseException) -> bool:
    """Whether ``error`` says the engine failed under a request it had received: a timeout (frozen), or a
    connection that broke after the request was sent (crashed). A connection refused is neither: nothing was
    sent (an engine not up yet, or restarting), and that request may be sent again."""
    if isinstance(error, (openai.APITimeoutError, httpx.TimeoutException)):
        return True
    cause = error.__cause__ if isinstance(error, openai.APIConnectionError) else error
    return isinstance(cause, httpx.TransportError) and not isinstance(cause, httpx.ConnectError)


class CallQuarantine:
    """One loaded model's suspect shapes, and the calls in flight (thread-safe: ``batch_predict`` and
    ``mlflow models serve`` call from several threads)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._lock = threading.Lock()
        self._in_flight: Counter[str] = Counter()
        self._strikes: Counter[str] = Counter()
        self._refused: set[str] = set()

    @contextmanager
    def holding(self, shape: str) -> Iterator[None]:
        """Refuse ``shape`` if it is quarantined, else count it in flight while the call runs."""
        with self._lock:
            if shape in self._refused:
                fields = ", ".join(fields_of(shape)) or "none"
                raise BadRequestError(
                    f"calls of this shape (fields {fields}) took the engine of model {self.model!r} down and are refused "
                    "by this loaded model; change the request (or load the model again)",
                    code="request_quarantined",
                )
            self._in_flight[shape] += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_flight[shape] -= 1
                if not self._in_flight[shape]:
                    del self._in_flight[shape]

    def engine_failed(self, shape: str) -> bool:
        """Note that the engine failed under a call of ``shape`` (each failed call notes itself once); returns
        whether the shape is refused from now on."""
        with self._lock:
            self._strikes[shape] += 1
            if sum(self._in_flight.values()) <= 1 or self._strikes[shape] >= 2:
                self._refused.add(shape)
            return shape in self._refused

    def refused(self) -> frozenset[str]:
        """The shapes refused now."""
        with self._lock:
            return frozenset(self._refused)
