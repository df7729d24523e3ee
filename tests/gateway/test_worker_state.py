"""The routing state the control process sends its workers, and how a worker applies it (no processes here:
the channel and the processes are tested end to end in test_workers.py)."""

from __future__ import annotations

import pickle

import pytest

from gateway.config import GatewaySettings, LimitSettings, auto_workers
from gateway.control.snapshot import RemoteBackend, apply_state, capture_state
from gateway.core.backends import UrlBackend
from gateway.core.errors import GatewayError
from gateway.core.limits import ConcurrencyLimiter
from gateway.core.poison import Quarantine
from gateway.core.registry import ModelRoute, Registry
from gateway.edge.auth import KeyPolicy

KEYS = KeyPolicy(client=(b"k1",))


def control_registry() -> Registry:
    a0, a1 = UrlBackend("a", "http://127.0.0.1:1", api_key="up-key"), UrlBackend("a", "http://127.0.0.1:2", replica=1)
    b = UrlBackend("served-b", "http://127.0.0.1:3")
    return Registry([ModelRoute("a", (a0, a1), ("alias-a",)), ModelRoute("b", b, adapters=("fine-tune",))])


@pytest.mark.parametrize(("cpus", "workers"), [(1, 1), (2, 1), (3, 1), (4, 1), (8, 2), (16, 4), (32, 8), (48, 8), (192, 8)])
def test_auto_workers_leave_the_cores_of_a_small_machine_to_the_engines(cpus: int, workers: int) -> None:
    assert auto_workers(cpus) == workers


def test_an_explicit_worker_count_is_taken_as_given() -> None:
    assert GatewaySettings(workers=3).worker_count() == 3
    assert GatewaySettings().worker_count() == auto_workers(len(__import__("os").sched_getaffinity(0)))


def test_a_worker_routes_as_the_control_does() -> None:
    control, quarantine = control_registry(), Quarantine()
    routing = pickle.loads(pickle.dumps(capture_state(GatewaySettings(), KEYS, control, quarantine)))  # as sent
    worker = Registry()
    apply_state(routing, worker, Quarantine(), GatewaySettings())
    route = worker.resolve("alias-a")
    assert route is not None and route.name == "a" and [b.url for b in route.replicas] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert all(isinstance(b, RemoteBackend) for b in route.replicas)
    assert [b.identity for b in route.replicas] == [b.identity for b in control.route("a").replicas]  # type: ignore[union-attr]
    assert route.replicas[0].upstream_headers() == {"authorization": "Bearer up-key"}
    assert worker.route("b").backend.served_name == "served-b"  # type: ignore[union-attr]
    adapter = worker.resolve("b:fine-tune")  # a LoRA adapter of b: routed by the worker too
    assert adapter is not None and adapter.name == "b" and adapter.adapter_for("b:fine-tune") == "fine-tune"


def test_a_new_state_keeps_the_workers_backends_and_limiters_and_takes_their_new_condition() -> None:
    control, quarantine = control_registry(), Quarantine()
    worker, worker_quarantine = Registry(), Quarantine()
    settings = GatewaySettings(limits=LimitSettings(max_concurrent=4))
    apply_state(capture_state(settings, KEYS, control, quarantine), worker, worker_quarantine, GatewaySettings())
    before = worker.route("a")
    assert before is not None
    before.replicas[0].in_flight = 2  # requests this worker has upstream now
    control.route("a").replicas[1].failure = "engine is not running"  # type: ignore[union-attr]
    changed = capture_state(settings, KEYS, control, quarantine)
    assert changed != capture_state(GatewaySettings(limits=LimitSettings(max_concurrent=4)), KEYS, control_registry(), quarantine)
    apply_state(changed, worker, worker_quarantine, settings)
    after = worker.route("a")
    assert after is not None and after.replicas[0] is before.replicas[0] and after.replicas[0].in_flight == 2
    assert after.replicas[1].unavailable_reason() == "engine is not running" and [b.replica for b in after.available()] == [0]
    assert after.limiter is before.limiter  # same limits: the limiter (and its count) stays
    apply_state(capture_state(GatewaySettings(limits=LimitSettings(max_concurrent=1)), KEYS, control, quarantine), worker, worker_quarantine, settings)
    assert worker.route("a").limiter is not before.limiter  # type: ignore[union-attr]


def test_the_same_state_compares_equal_so_nothing_is_sent() -> None:
    control, quarantine = control_registry(), Quarantine()
    assert capture_state(GatewaySettings(), KEYS, control, quarantine) == capture_state(GatewaySettings(), KEYS, control, quarantine)


def test_a_shape_quarantined_by_the_control_is_refused_by_the_worker() -> None:
    control, quarantine = control_registry(), Quarantine()
    quarantine.engine_failed("a", ["/v1/completions {prompt:[int]}"], "crashed: IndexError")
    worker_quarantine = Quarantine()
    apply_state(capture_state(GatewaySettings(), KEYS, control, quarantine), Registry(), worker_quarantine, GatewaySettings())
    assert worker_quarantine
    with pytest.raises(GatewayError) as refused:
        worker_quarantine.check("a", "/v1/completions {prompt:[int]}")
    assert refused.value.code == "request_quarantined"
    worker_quarantine.check("b", "/v1/completions {prompt:[int]}")  # another model: not refused
    quarantine.clear("a")
    apply_state(capture_state(GatewaySettings(), KEYS, control, quarantine), Registry(), worker_quarantine, GatewaySettings())
    assert not worker_quarantine
    worker_quarantine.check("a", "/v1/completions {prompt:[int]}")


def test_limiter_is_per_worker() -> None:
    """Each worker's route has a limiter of the full ``max_concurrent`` (the per-worker semantics of docs/serving.md)."""
    worker = Registry()
    apply_state(capture_state(GatewaySettings(limits=LimitSettings(max_concurrent=3)), KEYS, control_registry(), Quarantine()), worker, Quarantine(), GatewaySettings())
    limiter = worker.route("a").limiter  # type: ignore[union-attr]
    assert isinstance(limiter, ConcurrencyLimiter) and limiter.settings.max_concurrent == 3
