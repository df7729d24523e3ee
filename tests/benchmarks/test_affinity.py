"""The replica benchmarks run end to end on a tiny workload, on one shared rig: a gateway (its own process) over
``replicas: 2`` of the tiny CPU engine (two engine starts, in parallel, for both tests).

- ``affinity``: both balancing policies, cached tokens read from every answer;
- ``cluster``: the same engines reached directly (the client's own round robin, with the engines' key), through
  the gateway's balancing, and through SGLang's router put in front of them by a reload.

No timing is asserted: only that every request of every policy or target succeeded, that the engines' own
counters saw them where they were meant to go, and that with prefix affinity each repeated system prompt was
served from the cache.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from benchmarks.affinity import AffinityWorkload, measure_affinity
from benchmarks.cluster import TARGETS, measure_cluster, summary_rows
from benchmarks.loadgen import Workload
from benchmarks.replica_rig import MODEL, ReplicaRig, forget_keys, replica_gateway, tapped_engine_key, tiny_deployment
from benchmarks.report import print_affinity, print_cluster


@pytest.fixture(scope="module")
def rig(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, starts_engine: None
) -> Iterator[tuple[ReplicaRig, str]]:
    """The gateway over two replicas whose API key the benchmark can read (for the direct target)."""
    os.environ.setdefault("SGLANG_GATEWAY_TINY_MODEL", str(tiny_model_dir))
    out = tmp_path_factory.mktemp("replica-rig")
    deployment, keys = tiny_deployment(out, replicas=2, tap_keys=True)
    assert keys is not None
    try:
        with replica_gateway(deployment, out, Console(stderr=True)) as running:
            yield running, tapped_engine_key(keys)
    finally:
        forget_keys(keys)
    assert not keys.exists()


def test_affinity_benchmark_end_to_end(rig: tuple[ReplicaRig, str], capsys: pytest.CaptureFixture[str]) -> None:
    workload = AffinityWorkload(prompts=2, per_prompt=3, system_words=60, output_tokens=2)
    result = measure_affinity(rig[0], workload, concurrency=1, rounds=1, console=Console(stderr=True))
    assert set(result["policies"]) == {"least_in_flight", "prefix_affinity"}
    for policy, summary in result["policies"].items():
        assert summary["requests"] == 6 and summary["errors"] == 0, (policy, summary)
        assert summary["cache_reported"] and sum(summary["per_replica"].values()) == 6, (policy, summary)
        assert summary["cached_share"] == pytest.approx(summary["engine_cached_share"], abs=0.01), (policy, summary)
    affinity = result["policies"]["prefix_affinity"]
    (cached,) = affinity["cached_tokens_by_request"]  # prompt 0, prompt 1, prompt 0, prompt 1, ...
    system_tokens = affinity["prompt_tokens_per_request"] - 30  # the user message and the chat template: < 30
    assert all(tokens >= system_tokens for tokens in cached[2:]), cached  # repeats found their prefix cached
    assert set(result["ratios"]) >= {"cached_tokens_per_request", "ttft_p50_ms", "latency_p50_ms", "req_s"}
    print_affinity(result["policies"], result["ratios"])
    assert "affinity / none" in capsys.readouterr().out


def test_cluster_benchmark_end_to_end(rig: tuple[ReplicaRig, str], capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("sglang_router")  # SGLang's router goes in front of the replicas
    gateway, engine_key = rig
    workload = Workload(model=MODEL, prompt_tokens=16, output_tokens=2)
    result = measure_cluster(gateway, engine_key, workload, [2], 4, 2, Console(stderr=True), warmup=2)
    (level,) = result["levels"].values()
    for target in TARGETS:
        summary = level[target]
        assert summary["requests"] == 4 and summary["errors"] == 0, (target, summary)
        assert summary["ttft_p50_ms"] is not None and summary["mean_out_tokens"] == 2, (target, summary)
        served = level["requests_per_engine"][target]  # what the engines themselves counted
        assert len(served) == 2 and sum(served.values()) >= 4, (target, served)
    # the client's round robin and the router's reach both engines, request by request
    assert all(count >= 2 for count in level["requests_per_engine"]["direct"].values()), level["requests_per_engine"]
    assert all(count >= 1 for count in level["requests_per_engine"]["router"].values()), level["requests_per_engine"]
    assert "cpu_ms_per_req" in level["router"] and "router" in level["router"]["cpu_ms_per_req"], level["router"]
    assert set(level["vs_direct"]) == {"gateway", "router"}
    assert "router" not in gateway.model_status()  # the gateway is left as it was: no router in front
    rows = summary_rows(result["levels"])
    print_cluster(rows, "cluster")
    assert [row["target"] for row in rows] == [
        "direct",
        "gateway -> replicas",
        "gateway -> router -> replicas",
    ]
    assert "gateway -> router -> replicas" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["affinity", "cluster"])
def test_replica_commands_refuse_zero_rounds(command: str) -> None:
    """The commands' wiring (their imports run first) and their one-line refusal, without starting anything."""
    from typer.testing import CliRunner

    from benchmarks.cli import app

    answer = CliRunner().invoke(app, [command, "--rounds", "0"])
    assert answer.exit_code == 2, answer.output
    assert "must be >= 1" in answer.output
