"""Calls that took the engine down are refused afterwards, as the gateway's quarantine refuses them.

The guard (:mod:`model_code.guard`) refuses the crash classes that are known. For the others: a call whose
connection broke after it was sent while the engine died of an exception (its log says so) or that timed out
(it froze) is a *suspect*,
and is never sent again (no retry, not even to a restarted shared engine). Its shape
(:func:`engine_guard.shapes.request_shape`, the gateway's fingerprint: fields, types and size classes, not the
words) is refused with a :class:`BadRequestError` once it was the only call of this model in flight when it
failed, or a suspect twice. The record lives as long as the loaded model (one per process): loading the
model again, or a new engine version, starts clean.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai

from engine_guard.shapes import fields_of
from launch.engine_dir import log_tail
from launch.process import crash_cause
from model_code.errors import BadRequestError

CRASH_LOG_WAIT_S = 3.0  # how long a broken connection waits for the engine's log to say why it died


def took_engine_down(error: BaseException, *, has_engine: bool = False, log_file: Path | None = None) -> bool:
    """Whether ``error`` says the engine failed under a request it had received: a timeout (frozen), or a
    connection that broke after the request was sent while the engine died of an exception (crashed: its log,
    ``log_file``, says so, as the gateway's watchdog reads it). A connection refused is neither: nothing was sent
    (an engine not up yet, or restarting). An engine killed from outside (an operator, the OOM killer) logs no
    exception: its requests are innocent and may go to another replica. A URL target (``has_engine`` False) has
    no log to read: a broken connection counts against the call."""
    if isinstance(error, (openai.APITimeoutError, httpx.TimeoutException)):
        return True
    cause = error.__cause__ if isinstance(error, openai.APIConnectionError) else error
    if not isinstance(cause, httpx.TransportError) or isinstance(cause, httpx.ConnectError):
        return False
    if not has_engine:
        return True
    deadline = time.monotonic() + CRASH_LOG_WAIT_S
    while crash_cause(log_tail(log_file, 200)) is None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


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
