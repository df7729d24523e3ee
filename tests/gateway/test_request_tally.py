"""The per-request series are added in batches: a scrape is never behind what the process answered, a batch adds what
its requests would have added one by one, and with worker processes every request is added as it ends."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.metrics import Metrics
from gateway.core.registry import Registry
from gateway.core.request_tally import Finished


def _sample(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def _requests() -> list[Finished]:
    return [
        Finished("m", "/v1/chat/completions", 200, 0.02, 0.004, 10, 5, None, "unnamed"),
        Finished("m", "/v1/chat/completions", 200, 0.3, None, 7, None, 1, "alice"),
        Finished("m", "/v1/chat/completions", 503, 0.001, None, None, None, None, "alice"),
        Finished("other", "/v1/responses", 200, 2.0, 0.2, 3, 4, None, "unnamed"),
    ]


def test_a_scrape_adds_what_waits_and_counts_it_as_one_by_one() -> None:
    metrics = Metrics(Registry(), multiprocess_dir="")

    async def scenario() -> str:  # requests end in the server's loop
        for request in _requests():
            metrics.finished(request)
        assert _sample(metrics, "gateway_requests_total", model="m", route="/v1/chat/completions", status="200") is None  # waiting
        return metrics.exposition().decode()

    text = asyncio.run(scenario())
    assert 'gateway_requests_total{model="m",route="/v1/chat/completions",status="200"} 2.0' in text
    assert _sample(metrics, "gateway_requests_total", model="m", route="/v1/chat/completions", status="503") == 1
    assert _sample(metrics, "gateway_key_requests_total", key="alice", model="m", status_class="2xx") == 1
    assert _sample(metrics, "gateway_key_requests_total", key="alice", model="m", status_class="5xx") == 1
    assert _sample(metrics, "gateway_tokens_total", model="m", kind="prompt") == 17
    assert _sample(metrics, "gateway_tokens_total", model="m", kind="completion") == 5
    assert _sample(metrics, "gateway_key_tokens_total", key="unnamed", model="other", kind="completion") == 4
    assert _sample(metrics, "gateway_replica_requests_total", model="m", replica="1") == 1
    latency = "gateway_request_duration_seconds"
    assert _sample(metrics, latency + "_count", model="m", route="/v1/chat/completions") == 3
    assert _sample(metrics, latency + "_bucket", model="m", route="/v1/chat/completions", le="0.025") == 2
    assert abs(_sample(metrics, latency + "_sum", model="m", route="/v1/chat/completions") - 0.321) < 1e-9  # type: ignore[operator]
    assert _sample(metrics, "gateway_time_to_first_token_seconds_count", model="m") == 1
    assert _sample(metrics, "gateway_time_to_first_token_seconds_bucket", model="other", le="0.1") == 0


def test_waiting_requests_are_added_within_the_flush_interval_without_a_scrape(monkeypatch) -> None:
    monkeypatch.setattr("gateway.core.request_tally.FLUSH_S", 0.05)
    metrics = Metrics(Registry(), multiprocess_dir="")

    async def scenario() -> None:
        metrics.finished(_requests()[0])
        assert _sample(metrics, "gateway_requests_total", model="m", route="/v1/chat/completions", status="200") is None
        await asyncio.sleep(0.2)

    asyncio.run(scenario())
    assert _sample(metrics, "gateway_requests_total", model="m", route="/v1/chat/completions", status="200") == 1


def test_with_worker_processes_every_request_is_added_as_it_ends(tmp_path) -> None:
    metrics = Metrics(Registry(), multiprocess_dir=str(tmp_path))  # (their scrapes read each other's series)
    metrics.finished(_requests()[1])
    assert _sample(metrics, "gateway_requests_total", model="m", route="/v1/chat/completions", status="200") == 1


def test_a_batch_fills_each_histogram_bucket_as_observing_one_by_one_does() -> None:
    values = [0.0, 0.005, 0.0051, 0.01, 0.3, 0.5, 0.50001, 29.9, 30.0, 601.0, 1e9, 0.025, 0.025000001]
    one_by_one, batched = Metrics(Registry(), multiprocess_dir=""), Metrics(Registry(), multiprocess_dir="")
    for value in values:
        one_by_one.latency.labels("m", "/v1/responses").observe(value)

    async def batch() -> None:  # in a loop: kept, then added together
        for value in values:
            batched.tally.note(Finished("m", "/v1/responses", 200, value, None, None, None, None, "unnamed"))
        assert len(batched.tally._pending) == len(values)
        batched.tally.flush()

    asyncio.run(batch())

    def latency_samples(metrics: Metrics) -> dict[tuple[str, str], float]:
        family = next(f for f in metrics.registry.collect() if f.name == "gateway_request_duration_seconds")
        return {(sample.name, sample.labels.get("le", "")): sample.value for sample in family.samples if not sample.name.endswith("_created")}

    assert latency_samples(batched) == latency_samples(one_by_one)


_finished = st.builds(
    Finished,
    model=st.sampled_from(["m", "other"]),
    route=st.sampled_from(["/v1/chat/completions", "/v1/responses"]),
    status=st.sampled_from([200, 200, 200, 400, 429, 503, 101, 302, 600]),
    elapsed_s=st.floats(0, 700, allow_nan=False),
    ttft_s=st.none() | st.floats(0, 100, allow_nan=False),
    prompt_tokens=st.none() | st.integers(0, 5000),
    completion_tokens=st.none() | st.integers(0, 5000),
    replica=st.none() | st.sampled_from([0, 1]),
    key=st.sampled_from(["unnamed", "alice"]),
)


def _samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in metrics.registry.collect() for sample in family.samples if not sample.name.endswith("_created")
    }  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(st.lists(_finished, min_size=1, max_size=40) | st.lists(_finished, min_size=1, max_size=1).map(lambda one: one * 30))
def test_a_batch_adds_what_its_requests_add_one_at_a_time(requests: list[Finished]) -> None:
    """Whatever the batch (one client's series many times over, or a mix of models, routes, keys and replicas), flushed
    together it leaves every series as each of its requests flushed alone does."""
    alone, together = Metrics(Registry(), multiprocess_dir=""), Metrics(Registry(), multiprocess_dir="")
    for request in requests:
        alone.tally._pending.append(request)
        alone.tally.flush()
    together.tally._pending.extend(requests)
    together.tally.flush()
    assert _samples(together) == pytest.approx(_samples(alone), rel=1e-9, abs=1e-9)
