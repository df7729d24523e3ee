"""Summaries of samples, gateway/direct ratios and the gateway's performance targets."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from benchmarks.loadgen import BatchResult, Sample

# Figures of a summary: (key, label, higher is better)
FIGURES: list[tuple[str, str, bool]] = [
    ("req_s", "req/s", True),
    ("out_tok_s", "out tok/s", True),
    ("latency_p50_ms", "lat p50 ms", False),
    ("latency_p90_ms", "lat p90 ms", False),
    ("latency_p99_ms", "lat p99 ms", False),
    ("ttft_p50_ms", "TTFT p50 ms", False),
    ("ttft_p90_ms", "TTFT p90 ms", False),
    ("ttft_p99_ms", "TTFT p99 ms", False),
    ("itl_p50_ms", "ITL p50 ms", False),
    ("itl_p99_ms", "ITL p99 ms", False),
]


def percentile_ms(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) * 1000 if values else None


def summarize(batches: Iterable[BatchResult]) -> dict[str, Any]:
    """Pool the samples of several batches (rounds) of one target at one concurrency."""
    samples: list[Sample] = []
    wall = 0.0
    truncated = False
    cpu: dict[str, float] = {}
    for batch in batches:
        for name, seconds in batch.cpu_s.items():
            cpu[name] = cpu.get(name, 0.0) + seconds
        samples += batch.samples
        wall += batch.wall_s
        truncated = truncated or batch.truncated
    ok = [s for s in samples if s.ok]
    errors = [s for s in samples if not s.ok]
    latency = [s.latency for s in ok]
    ttft = [s.ttft for s in ok if s.ttft is not None]
    itl = [s.itl for s in ok if s.itl is not None]
    tokens = sum(s.tokens for s in ok)
    return {
        "requests": len(samples),
        "ok": len(ok),
        "errors": len(errors),
        "error_examples": sorted({s.error or "?" for s in errors})[:3],
        "wall_s": round(wall, 3),
        "truncated": truncated,
        "req_s": len(ok) / wall if wall else 0.0,
        "out_tok_s": tokens / wall if wall else 0.0,
        "mean_out_tokens": tokens / len(ok) if ok else 0.0,
        "latency_p50_ms": percentile_ms(latency, 50),
        "latency_p90_ms": percentile_ms(latency, 90),
        "latency_p99_ms": percentile_ms(latency, 99),
        "ttft_p50_ms": percentile_ms(ttft, 50),
        "ttft_p90_ms": percentile_ms(ttft, 90),
        "ttft_p99_ms": percentile_ms(ttft, 99),
        "itl_p50_ms": percentile_ms(itl, 50),
        "itl_p99_ms": percentile_ms(itl, 99),
        # CPU milliseconds per completed request, per process (noise-robust: CPU time, not wall time)
        "cpu_ms_per_req": {name: 1000 * seconds / len(ok) for name, seconds in cpu.items()} if ok else {},
    }


def compare(direct: dict[str, Any], gateway: dict[str, Any]) -> dict[str, Any]:
    """gateway/direct ratio of each figure, and gateway-direct in ms for the latency figures."""
    out: dict[str, Any] = {}
    for key, _, _ in FIGURES:
        d, g = direct.get(key), gateway.get(key)
        out[key] = {"ratio": (g / d) if d and g is not None else None}
        if key.endswith("_ms"):
            out[key]["added_ms"] = (g - d) if d is not None and g is not None else None
    return out


def _check(name: str, value: float | None, limit: float, *, at_most: bool, unit: str) -> dict[str, Any]:
    met = None if value is None else (value <= limit if at_most else value >= limit)
    return {"target": name, "value": value, "limit": limit, "op": "<=" if at_most else ">=", "unit": unit, "met": met}


def evaluate_targets(upstream: str, levels: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """The gateway's performance targets for what this run measured (``levels``: concurrency -> {direct, gateway, vs})."""
    checks: list[dict[str, Any]] = []
    if upstream.startswith("router"):  # the gateway's own connections to a router must not stall on delayed ACKs
        for c, entry in sorted(levels.items()):
            added = entry["vs"]["ttft_p50_ms"].get("added_ms")
            checks.append(_check(f"router c={c}: added p50 TTFT", added, 2.0, at_most=True, unit="ms"))
    elif upstream.startswith("stub"):
        if 1 in levels:
            vs = levels[1]["vs"]
            checks.append(
                _check(
                    "stub c=1: added p50 latency", vs["latency_p50_ms"].get("added_ms"), 1.0, at_most=True, unit="ms"
                )
            )
            checks.append(
                _check("stub c=1: added p50 TTFT", vs["ttft_p50_ms"].get("added_ms"), 1.0, at_most=True, unit="ms")
            )
            checks.append(
                _check(
                    "stub c=1: added p99 latency", vs["latency_p99_ms"].get("added_ms"), 3.0, at_most=True, unit="ms"
                )
            )
            checks.append(
                _check("stub c=1: added p99 TTFT", vs["ttft_p99_ms"].get("added_ms"), 3.0, at_most=True, unit="ms")
            )
        for c in (16, 64, 256):
            if c in levels:
                checks.append(
                    _check(f"stub c={c}: req/s kept", levels[c]["vs"]["req_s"]["ratio"], 0.5, at_most=False, unit="x")
                )
                # the stricter reading of that target: gateway CPU per request <= the stub's own CPU per request
                gw = levels[c]["gateway"].get("cpu_ms_per_req", {}).get("gateway")
                up = levels[c]["direct"].get("cpu_ms_per_req", {}).get("upstream")
                ratio = gw / up if gw is not None and up else None
                checks.append(
                    _check(f"stub c={c}: gateway CPU/req vs stub CPU/req", ratio, 1.0, at_most=True, unit="x")
                )
    else:
        for c in (1, 4, 16):
            if c in levels:
                vs = levels[c]["vs"]
                checks.append(
                    _check(f"sglang c={c}: out tok/s kept", vs["out_tok_s"]["ratio"], 0.98, at_most=False, unit="x")
                )
                checks.append(
                    _check(
                        f"sglang c={c}: added p50 TTFT", vs["ttft_p50_ms"].get("added_ms"), 2.0, at_most=True, unit="ms"
                    )
                )
    return checks


TENANT_ADDED_P50_MS = 0.1  # keys + ledger: at most this much p50 latency at c=1 over the plain gateway
TENANT_REQ_S_KEPT = 0.97  # ... and req/s at c=64 within noise of it (paired median of the rounds' ratios)


def evaluate_tenant_targets(
    levels: dict[int, dict[str, Any]], target: str = "gateway-keys", twin: str = "gateway-twin"
) -> list[dict[str, Any]]:
    """The bar set for named keys + the usage ledger (+0.1 ms p50 at c=1, no drop at c=64 beyond noise), against the plain gateway of the same run (``vs_gateway``).

    ``twin``: an identical plain gateway measured alongside (an A/A control), where the run has one. Its distance from
    the plain gateway is the run's noise, shown next to each check; at c=64 the keyed gateway may keep as little
    req/s as the twin kept ("no drop beyond noise"), and at least :data:`TENANT_REQ_S_KEPT` of it in any case."""
    checks: list[dict[str, Any]] = []
    for c, entry in sorted(levels.items()):
        versus = entry.get("vs_gateway", {})
        vs, control = versus.get(target), versus.get(twin)
        if vs is None:
            continue
        if c == 1:
            for what, key in (("p50 latency", "latency_p50_ms"), ("p50 TTFT", "ttft_p50_ms")):
                checks.append(_check(f"keys+ledger c=1: added {what}", vs[key].get("added_ms"), TENANT_ADDED_P50_MS, at_most=True, unit="ms"))
                if control is not None:
                    checks.append(_noise(f"noise: twin c=1: added {what}", control[key].get("added_ms"), 0.0, "ms"))
        if c == 64:
            kept = _kept(vs)
            limit = TENANT_REQ_S_KEPT
            if control is not None:
                twin_kept = _kept(control)
                checks.append(_noise("noise: twin c=64: req/s kept (paired median)", twin_kept, 1.0, "x"))
                limit = round(min(limit, 1 - abs(1 - twin_kept)), 3)
            checks.append(_check("keys+ledger c=64: req/s kept (paired median)", kept, limit, at_most=False, unit="x"))
    return checks


def _kept(vs: dict[str, Any]) -> float:
    return vs["req_s"].get("paired_median_ratio") or vs["req_s"]["ratio"]


def _noise(name: str, value: float | None, ideal: float, unit: str) -> dict[str, Any]:
    """A figure shown for comparison, not a target (the A/A twin: how far an identical gateway lands)."""
    return {"target": name, "value": value, "limit": ideal, "op": "~", "unit": unit, "met": None}


TRACING_ADDED_P50_MS = 0.2  # tracing on, every request sampled: at most this much p50 latency at c=1 over the plain gateway


def evaluate_tracing_targets(levels: dict[int, dict[str, Any]], target: str = "gateway-traced") -> list[dict[str, Any]]:
    """The bar set for tracing at ratio 1.0 (+0.2 ms p50 at c=1), against the plain gateway of the same run (``vs_gateway``)."""
    checks: list[dict[str, Any]] = []
    entry = levels.get(1, {})
    vs = entry.get("vs_gateway", {}).get(target)
    if vs is not None:
        checks.append(_check("tracing c=1: added p50 latency", vs["latency_p50_ms"].get("added_ms"), TRACING_ADDED_P50_MS, at_most=True, unit="ms"))
        checks.append(_check("tracing c=1: added p50 TTFT", vs["ttft_p50_ms"].get("added_ms"), TRACING_ADDED_P50_MS, at_most=True, unit="ms"))
    return checks


SHARED_ADDED_P50_MS = 0.3  # a replica sharing a store: at most this much p50 latency at c=1 over the same gateway alone (chat)


def evaluate_shared_targets(levels: dict[int, dict[str, Any]], api: str, target: str = "gateway-shared") -> list[dict[str, Any]]:
    """The bar set for a replica sharing a store: +0.3 ms p50 latency at c=1 for chat, against the same keyed gateway
    alone in the same run (``vs_reference``). The other figures are shown beside it: TTFT, the other APIs (a Responses
    API create publishes its id to the store; a plain answer waits for that insert) and req/s kept at c=64; the run's
    noise is the twin's, in the tenants' checks."""
    checks: list[dict[str, Any]] = []
    for c, entry in sorted(levels.items()):
        vs = entry.get("vs_reference", {}).get(target)
        if vs is None:
            continue
        if c == 1:
            for what, key in (("p50 latency", "latency_p50_ms"), ("p50 TTFT", "ttft_p50_ms")):
                name, added = f"shared store c=1: added {what} ({api})", vs[key].get("added_ms")
                if api == "chat" and key == "latency_p50_ms":
                    checks.append(_check(name, added, SHARED_ADDED_P50_MS, at_most=True, unit="ms"))
                else:
                    checks.append(_noise(name, added, 0.0, "ms"))
        if c == 64:
            checks.append(_noise(f"shared store c=64: req/s kept (paired median, {api})", _kept(vs), 1.0, "x"))
    return checks
