"""Prometheus metrics, on a CollectorRegistry of their own per app (tests build many apps).

Request counters and histograms are recorded once per request by the request-context middleware;
engine up/down is computed at scrape time from the model registry, so it is never stale.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from gateway.core.registry import Registry
from gateway.core.request_tally import Finished, RequestTally

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_WAKE_BUCKETS = (0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200)


class Metrics:
    """Every metric the gateway exports.

    With worker processes (``PROMETHEUS_MULTIPROC_DIR`` set by the control process for itself and its workers),
    every process writes its samples to that directory and a scrape on any worker sums them all
    (prometheus_client's multiprocess mode: counters and histograms summed, the in-flight gauge summed over
    live processes); the engine-state gauges are computed by the process that answers, from its routing state.
    """

    def __init__(self, registry: Registry, multiprocess_dir: str | None = None) -> None:
        self.multiprocess_dir = multiprocess_dir if multiprocess_dir is not None else os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        self.models = registry
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("gateway_requests", "Requests by model, route and HTTP status.", ["model", "route", "status"], registry=r)
        self.latency = Histogram("gateway_request_duration_seconds", "Time from request to last byte.", ["model", "route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("gateway_time_to_first_token_seconds", "Time to the first upstream byte of a stream.", ["model"], buckets=_TTFT_BUCKETS, registry=r)
        self.in_flight = Gauge("gateway_in_flight_requests", "Requests being proxied now.", ["model"], registry=r, multiprocess_mode="livesum")
        self.tokens = Counter("gateway_tokens", "Tokens reported by the engines' usage.", ["model", "kind"], registry=r)
        self.stream_errors = Counter("gateway_stream_errors", "Streams ended by an upstream failure after 200.", ["model"], registry=r)
        self.engine_restarts = Counter("gateway_engine_restarts", "Engine restarts by the gateway.", ["model"], registry=r)
        self.engine_busy_probes = Counter(
            "gateway_engine_busy_probes", "Failed /health probes of an engine whose work counters moved meanwhile: busy, not counted as frozen.", ["model"], registry=r
        )  # fmt: skip
        self.engine_restart_failures = Counter("gateway_engine_restart_failures", "Engine restarts that did not come up.", ["model"], registry=r)
        self.swaps = Counter("gateway_model_swaps", "Backend swaps by model and result (ok / failed).", ["model", "result"], registry=r)
        self.reloads = Counter("gateway_config_reloads", "Config reloads by result (ok / invalid / partial).", ["result"], registry=r)
        self.replica_requests = Counter("gateway_replica_requests", "Requests by the replica that served them (models with replicas).", ["model", "replica"], registry=r)
        # Per client key (label ``key``: the key's name, "unnamed" for the others: bounded by the configured keys).
        self.key_requests = Counter("gateway_key_requests", "Requests by client key, model and status class (2xx, 4xx...).", ["key", "model", "status_class"], registry=r)
        self.key_tokens = Counter("gateway_key_tokens", "Tokens reported by the engines' usage, by client key.", ["key", "model", "kind"], registry=r)
        self.usage_rows_dropped = Counter("gateway_usage_rows_dropped", "Usage ledger rows dropped: the database was unreachable and the buffer full.", registry=r)
        self.usage_rows_refused = Counter("gateway_usage_rows_refused", "Usage ledger rows the database refused, set aside so the rows behind them are written.", registry=r)
        self.wakes = Counter("gateway_model_wakes", "Asleep models woken for a waiting request (residency), by model and how: started / resumed.", ["model", "how"], registry=r)
        self.wake_seconds = Histogram(
            "gateway_model_wake_seconds", "From a request finding its model asleep to its engine ready (a cold start, or a memory resume).", ["model"],
            buckets=_WAKE_BUCKETS, registry=r,
        )  # fmt: skip
        self.residency_stops = Counter("gateway_residency_stops", "Engines stopped by residency, by model and reason (idle / evicted).", ["model", "reason"], registry=r)
        # The batch API (gateway.batches.runner): lines by how they ended, and lines still waiting (set by the runner)
        self.batch_lines = Counter("gateway_batch_lines", "Batch lines ended, by model and result (done / failed / expired).", ["model", "result"], registry=r)
        self.batch_queued = Gauge("gateway_batch_queued_lines", "Batch lines waiting to run, over every batch.", registry=r, multiprocess_mode="livesum")
        r.register(_EngineUp(registry))
        r.register(_ReplicasReady(registry))
        r.register(_Resident(registry))
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}
        self._shared_store_up: Gauge | None = None
        # the per-request series, added in batches (at once with worker processes, whose scrapes read each other's)
        self.tally = RequestTally(self, at_once=bool(self.multiprocess_dir))

    def finished(self, request: Finished) -> None:
        """Count one finished request in the per-request series (:mod:`gateway.core.request_tally`)."""
        self.tally.note(request)

    def shared_store_gauge(self) -> Gauge:
        """``gateway_shared_store_up``, registered by replicas sharing a store only (elsewhere it would say 0)."""
        if self._shared_store_up is None:
            self._shared_store_up = Gauge(
                "gateway_shared_store_up", "1 while the store shared by the replicas answers; 0 while not (each key's limits in this replica's share).",
                registry=self.registry, multiprocess_mode="livemax",
            )  # fmt: skip
        return self._shared_store_up

    def exposition(self) -> bytes:
        """The scrape: this process's series, or with worker processes the sum over all of them."""
        self.tally.flush()
        if not self.multiprocess_dir:
            return generate_latest(self.registry)
        summed = CollectorRegistry()
        MultiProcessCollector(summed, path=self.multiprocess_dir)
        summed.register(_EngineUp(self.models))
        summed.register(_ReplicasReady(self.models))
        summed.register(_Resident(self.models))
        return generate_latest(summed)

    def in_flight_count(self, model: str) -> Any:
        """What counts ``model``'s requests in flight (its gauge child's value): ``inc(1)`` and ``inc(-1)`` are the
        child's ``inc()`` and ``dec()`` less their check that a labelled child is observable, which it always is (the
        checks were a fifth of the metrics' Python a request)."""
        return self.child(self.in_flight, model)._value

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, remembered: the hot path asks for the same few children every request."""
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child


class _EngineUp(Collector):
    def __init__(self, models: Registry) -> None:
        self.models = models

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("gateway_engine_up", "1 when the model's engine is ready (managed) or answers /health (url models, probed at scrape time).", labels=["model"])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("gateway_engine_up", "1 when the model's engine is ready (managed) or answers /health (url models, probed at scrape time).", labels=["model"])
        for route in self.models.routes():
            backend = route.backend
            up = backend.unavailable_reason() is None if backend.managed else bool(backend.last_health)
            family.add_metric([route.name], 1.0 if up else 0.0)
        yield family


class _PerModelGauge(Collector):
    """A gauge with one value per model, computed from its route at scrape time (``value``)."""

    _NAME: str
    _HELP: str

    def __init__(self, models: Registry) -> None:
        self.models = models

    def value(self, route: Any) -> float:
        raise NotImplementedError

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(self._NAME, self._HELP, labels=["model"])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self._NAME, self._HELP, labels=["model"])
        for route in self.models.routes():
            family.add_metric([route.name], self.value(route))
        yield family


class _ReplicasReady(_PerModelGauge):
    """How many replicas of each model can take requests, computed at scrape time."""

    _NAME, _HELP = "gateway_replicas_ready", "Replicas of the model that can take requests now."

    def value(self, route: Any) -> float:
        return float(len(route.available()))


class _Resident(_PerModelGauge):
    """1 for a model whose engine is up or starting as configured, 0 while it is asleep (residency), at scrape time."""

    _NAME, _HELP = "gateway_model_resident", "0 while the model is asleep (residency: its engine stopped or its memory released), else 1."

    def value(self, route: Any) -> float:
        return 0.0 if route.asleep else 1.0
