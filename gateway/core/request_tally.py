"""The per-request series (requests, latency, time to first token, tokens, by model, route, key and replica), kept as
one tuple per request and added to the Prometheus metrics in batches.

Each finished request touched nine labelled series, each update taking prometheus_client's lock and checks: about a
tenth of the Python a short request runs. Kept instead as one tuple, the requests of a batch are counted together
(one ``inc`` per label set, not per request). A batch is added before every scrape of this process (so a scrape is
never behind what this process answered), and :data:`FLUSH_S` after its first request otherwise; with worker
processes (prometheus_client's multiprocess mode: a scrape on any worker reads every worker's files) at once, so that
no worker's scrape misses what another answered.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections import Counter, defaultdict
from functools import partial
from operator import is_not, itemgetter
from typing import Any, NamedTuple

FLUSH_S = 1.0  # the longest a request's series wait to be added (none wait while no request comes: no timer runs)

_STATUS_CLASSES = ("other", "1xx", "2xx", "3xx", "4xx", "5xx")


class Finished(NamedTuple):
    """What the metrics keep of one finished request."""

    model: str
    route: str
    status: int
    elapsed_s: float
    ttft_s: float | None
    prompt_tokens: int | None
    completion_tokens: int | None
    replica: int | None
    key: str


class RequestTally:
    """Finished requests waiting to be added to ``metrics`` (:class:`gateway.core.metrics.Metrics`)."""

    def __init__(self, metrics: Any, at_once: bool) -> None:
        self.metrics = metrics
        self.at_once = at_once  # every request added as it ends (worker processes: their scrapes read each other's)
        self._pending: list[Finished] = []

    def note(self, finished: Finished) -> None:
        pending = self._pending
        pending.append(finished)
        if self.at_once:
            self.flush()
        elif len(pending) == 1:
            try:
                asyncio.get_running_loop().call_later(FLUSH_S, self.flush)
            except RuntimeError:  # no loop (a tool recording outside the server): now
                self.flush()

    def flush(self) -> None:
        """Add every waiting request to the metrics."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        series = set(map(_SERIES, pending))
        if len(series) == 1:  # one model, route, replica and key (a client's burst): counted without a loop in Python
            self._add_one_series(*series.pop(), pending)
        else:
            self._add_each(pending)

    def _add_one_series(self, model: str, route: str, replica: int | None, key: str, pending: list[Finished]) -> None:
        m = self.metrics
        child = m.child
        classes: Counter[str] = Counter()
        for status, count in Counter(map(_STATUS, pending)).items():
            child(m.requests, model, route, str(status)).inc(count)
            classes[_status_class(status)] += count
        for status_class, count in classes.items():
            child(m.key_requests, key, model, status_class).inc(count)
        if replica is not None:
            child(m.replica_requests, model, str(replica)).inc(len(pending))
        for kind, tokens in (("prompt", sum(filter(None, map(_PROMPT, pending)))), ("completion", sum(filter(None, map(_COMPLETION, pending))))):
            if tokens:
                child(m.tokens, model, kind).inc(tokens)
                child(m.key_tokens, key, model, kind).inc(tokens)
        _observe_all(child(m.latency, model, route), list(map(_ELAPSED, pending)))
        ttfts = list(filter(_IS_VALUE, map(_TTFT, pending)))
        if ttfts:
            _observe_all(child(m.ttft, model), ttfts)

    def _add_each(self, pending: list[Finished]) -> None:
        m = self.metrics
        child = m.child
        requests: Counter[tuple[str, str, str]] = Counter()
        by_key: Counter[tuple[str, str, str]] = Counter()
        replicas: Counter[tuple[str, str]] = Counter()
        tokens: Counter[tuple[str, str]] = Counter()
        key_tokens: Counter[tuple[str, str, str]] = Counter()
        latencies: defaultdict[tuple[str, str], list[float]] = defaultdict(list)
        ttfts: defaultdict[str, list[float]] = defaultdict(list)
        for model, route, status, elapsed_s, ttft_s, prompt, completion, replica, key in pending:
            requests[(model, route, str(status))] += 1
            latencies[(model, route)].append(elapsed_s)
            if ttft_s is not None:
                ttfts[model].append(ttft_s)
            if prompt:
                tokens[(model, "prompt")] += prompt
                key_tokens[(key, model, "prompt")] += prompt
            if completion:
                tokens[(model, "completion")] += completion
                key_tokens[(key, model, "completion")] += completion
            if replica is not None:
                replicas[(model, str(replica))] += 1
            by_key[(key, model, _status_class(status))] += 1
        for counts, metric in (
            (requests, m.requests), (by_key, m.key_requests), (replicas, m.replica_requests), (tokens, m.tokens),
            (key_tokens, m.key_tokens),
        ):  # fmt: skip
            for labels, count in counts.items():
                child(metric, *labels).inc(count)
        for histogram, observed in ((m.latency, latencies), (m.ttft, ttfts)):
            for labels, values in observed.items():
                _observe_all(child(histogram, *labels) if isinstance(labels, tuple) else child(histogram, labels), values)


def _status_class(status: int) -> str:
    return _STATUS_CLASSES[status // 100 if status < 600 else 0]


# A finished request's fields, read in C (map over a batch of them): its series, and each value
_SERIES = itemgetter(0, 1, 7, 8)  # model, route, replica, key
_STATUS, _ELAPSED, _TTFT, _PROMPT, _COMPLETION = (itemgetter(index) for index in (2, 3, 4, 5, 6))
_IS_VALUE = partial(is_not, None)


def _observe_all(series: Any, values: list[float]) -> None:
    """``series.observe(value)`` for each of ``values`` (a prometheus_client histogram child), as one update per bucket
    that got values: each value in the first bucket whose upper bound it does not exceed, as ``observe`` puts it."""
    buckets = series._buckets
    series._sum.inc(sum(values))
    for bucket, count in Counter(map(partial(bisect_left, series._upper_bounds), values)).items():
        buckets[bucket].inc(count)
