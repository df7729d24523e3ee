"""The cluster path, measured: the same replicas reached three ways in one run, with ratios against the first.

- ``direct``: the client spreads its requests over the replicas' engines itself (round robin, request by
  request), with the engines' API key (see :func:`benchmarks.replica_rig.key_tap_python`);
- ``gateway``: through the gateway's own balancing over the replicas (``least_in_flight``);
- ``router``: through the gateway to SGLang's router (``router: {policy: round_robin}`` added to the model by
  a reload: the engines keep running) and on to the replicas.

One streamed chat workload for all three, batches alternating (ABBA) per round. After each batch the engines'
own request counters say which engines served it, and the CPU of every process on the target's path is charged
to it (the router is a new process each time it is put in front, so its pid is read per batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Console

from benchmarks.drive import drive
from benchmarks.loadgen import BatchResult, Workload
from benchmarks.processes import group_cpu_s
from benchmarks.replica_rig import DEFAULT_POLICY, MODEL, ReplicaRig

TARGETS = ("direct", "gateway", "router")
LABELS = {"direct": "direct", "gateway": "gateway -> replicas", "router": "gateway -> router -> replicas"}
ROUTER_POLICY = "round_robin"
ENGINE_REQUESTS = "sglang:num_requests_total"


class ClusterHooks:
    """Puts each target in place before its batch; after it, records the requests each engine counted and the
    CPU seconds of the processes on the target's path (gateway, router, engines)."""

    def __init__(self, rig: ReplicaRig) -> None:
        self.rig = rig
        self.engines = rig.engines()
        self.per_engine: dict[str, dict[str, float]] = {name: {} for name in TARGETS}  # this level's, so far
        self.spread: dict[str, dict[str, dict[str, float]]] = {}  # level -> target -> engine URL -> requests
        self._counts: dict[str, float] = {}
        self._cpu: dict[str, tuple[list[int], float]] = {}

    def before(self, target: str) -> None:
        self.rig.set_router(ROUTER_POLICY if target == "router" else None)
        groups: dict[str, list[int]] = {"engines": [engine.pid for engine in self.engines]}
        if target != "direct":
            groups["gateway"] = [self.rig.gateway_pid]
        router = self.rig.router_pid() if target == "router" else None
        if router is not None:
            groups["router"] = [router]
        self._cpu = {label: (pgids, _cpu_s(pgids)) for label, pgids in groups.items()}
        self._counts = self.rig.engine_metric(ENGINE_REQUESTS)

    def after(self, target: str, batch: BatchResult) -> None:
        counts = self.rig.engine_metric(ENGINE_REQUESTS)
        seen = self.per_engine[target]
        for url, count in counts.items():
            seen[url] = seen.get(url, 0.0) + count - self._counts.get(url, 0.0)
        for label, (pgids, before) in self._cpu.items():
            batch.cpu_s[label] = _cpu_s(pgids) - before

    def level_done(self, level: int) -> None:
        self.spread[str(level)] = {name: dict(counts) for name, counts in self.per_engine.items()}
        for counts in self.per_engine.values():
            counts.clear()


def _cpu_s(pgids: list[int]) -> float:
    return sum(group_cpu_s(pgid) for pgid in pgids)


def measure_cluster(
    rig: ReplicaRig,
    engine_key: str,
    workload: Workload,
    levels: list[int],
    requests: int,
    rounds: int,
    console: Console,
    *,
    warmup: int = 8,
    max_seconds: float = 120.0,
) -> dict[str, Any]:
    """Every level over the three targets; per level the summaries, the ratios against ``direct``, and the
    requests each engine counted per target. Leaves the gateway as it found it (no router, its own policy)."""
    if workload.model != MODEL:
        raise ValueError(f"the workload's model must be {MODEL!r}, the rig's")
    rig.set_policy(DEFAULT_POLICY)
    hooks = ClusterHooks(rig)
    targets: dict[str, str | Sequence[str]] = {
        "direct": [engine.url for engine in hooks.engines],
        "gateway": rig.url,
        "router": rig.url,
    }
    try:
        by_level = drive(
            targets,
            workload,
            levels,
            requests,
            console,
            rounds=rounds,
            warmup=warmup,
            max_seconds=max_seconds,
            # the engines require their key; the gateway (no client keys here) ignores it: the same bytes everywhere
            headers={"authorization": f"Bearer {engine_key}"},
            quickack=True,
            hooks=hooks,
            between_levels=hooks.level_done,
        )
    finally:
        rig.set_router(None)
    for level, entry in by_level.items():
        entry["requests_per_engine"] = hooks.spread.get(level, {})
    return {"levels": by_level, "engines": [engine.url for engine in hooks.engines], "router_policy": ROUTER_POLICY}


def summary_rows(levels: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per level and target: the figures the benchmark README tabulates, and each against ``direct``."""
    rows = []
    for level, entry in levels.items():
        for name in TARGETS:
            summary = entry[name]
            vs = entry.get("vs_direct", {}).get(name)
            row = {
                "c": int(level),
                "target": LABELS[name],
                "requests": summary["requests"],
                "errors": summary["errors"],
                "ttft_p50_ms": summary["ttft_p50_ms"],
                "ttft_p90_ms": summary["ttft_p90_ms"],
                "latency_p50_ms": summary["latency_p50_ms"],
                "req_s": summary["req_s"],
                "cpu_ms_per_req": summary.get("cpu_ms_per_req", {}),
                "requests_per_engine": list(entry.get("requests_per_engine", {}).get(name, {}).values()),
            }
            if vs is not None:
                row["ratios"] = {
                    key: vs[key]["ratio"] for key in ("ttft_p50_ms", "ttft_p90_ms", "latency_p50_ms", "req_s")
                }
                row["req_s_paired_median_ratio"] = vs["req_s"].get("paired_median_ratio")
                row["added_ttft_p50_ms"] = vs["ttft_p50_ms"].get("added_ms")
            rows.append(row)
    return rows
