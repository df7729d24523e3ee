"""``python -m benchmarks costs``: what the gateway costs against SGLang's router, every figure in one run.

Both proxies (and ``--baseline``'s gateway, another checkout's) stand in front of the same fakes, and each figure is
printed as a ratio to the router's, measured in the same rounds (the targets alternate):

- over the paced fake (:mod:`benchmarks.paced_upstream`, one event per stream every ``--step-ms``): the process CPU
  per event of one sparse stream (:func:`benchmarks.sparse.measure_stream`; every round of it, and of the idle CPU,
  before any crowd of streams), of ``--streams`` streams at once
  (:func:`benchmarks.paced.run_paced`; 16 and 1,024 by default) and, at the largest count, its TTFT and gap p99;
  the CPU per second of an idle process (:func:`benchmarks.sparse.measure_idle`); and the gateway's main-loop
  wake-ups per event (its event loop's voluntary context switches; the router has no Python loop to count);
- over the fast fake (:mod:`benchmarks.fake_upstream`, the whole answer at once): the CPU per short streamed chat
  request (16 tokens) at ``-c`` 1 and 64 (:func:`benchmarks.drive.drive`, as ``compare --router-target``).

CPU is the whole process's (every thread; ``/proc``). Medians over ``--rounds``.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from benchmarks import processes
from benchmarks.apis import APIS
from benchmarks.drive import drive
from benchmarks.loadgen import SDK_HEADERS, Workload, new_event_loop
from benchmarks.paced import run_paced
from benchmarks.report import console, machine_info
from benchmarks.sparse import measure_idle, measure_stream, process_cpu_ns, wakeups

Targets = dict[str, tuple[str, int]]  # name -> (base URL, pid)


def _proxies(stack: ExitStack, upstream_url: str, out: Path, baseline_env: dict[str, str] | None, label: str) -> Targets:
    """The gateway, the baseline's gateway (with ``baseline_env``) and the router, in front of ``upstream_url``."""
    targets: Targets = {}
    url, child = stack.enter_context(processes.gateway(upstream_url, out / f"gateway-{label}"))
    targets["gateway"] = (url, child.pid)
    if baseline_env is not None:
        url, child = stack.enter_context(processes.gateway(upstream_url, out / f"{processes.BASELINE}-{label}", baseline_env))
        targets[processes.BASELINE] = (url, child.pid)
    router_logs = out / f"router-{label}"
    router_logs.mkdir(parents=True, exist_ok=True)
    url, child = stack.enter_context(processes.router([upstream_url], router_logs))
    targets[processes.ROUTER_TARGET] = (url, child.pid)
    return targets


def _many_streams(loop: Any, url: str, pid: int, count: int, tokens: int, timeout_s: float) -> dict[str, Any]:
    """``count`` paced streams through ``url``: the process's CPU and main-loop wake-ups per event, TTFT, gaps."""
    cpu0, wake0 = process_cpu_ns(pid), wakeups(pid)
    result = loop.run_until_complete(run_paced(url, APIS["chat"], count, tokens, 1.0 if count > 64 else 0.0, timeout_s))
    cpu1, wake1 = process_cpu_ns(pid), wakeups(pid)
    events = max(result.events, 1)
    return {
        "us_per_event": (cpu1 - cpu0) / 1e3 / events,
        "wakeups_per_event": (wake1 - wake0) / events,
        "errors": result.errors,
        **{key: result.summary()[key] for key in ("events_per_s", "ttft_p50_ms", "gap_p99_ms")},
    }


def paced_figures(targets: Targets, streams: list[int], tokens: int, step_ms: float, idle_s: float, rounds: int) -> dict[str, list[dict[str, Any]]]:
    """Per target, one row per round: idle CPU and one sparse stream (every round of them first, on processes that
    have carried no crowd yet, as :mod:`benchmarks.sparse` measures them), then each count of streams."""
    timeout_s = tokens * step_ms / 1000 * 3 + 60
    rows: dict[str, list[dict[str, Any]]] = {name: [{"errors": 0} for _ in range(rounds)] for name in targets}
    loop = new_event_loop()

    def each(measure: Callable[[str, str, int], dict[str, Any]], what: str) -> None:
        for round_ in range(rounds):
            for name in list(targets) if round_ % 2 == 0 else list(reversed(targets)):
                url, pid = targets[name]
                row, figures = rows[name][round_], measure(name, url, pid)
                row["errors"] += figures.pop("errors")
                row.update(figures)
                console.print(f"{what} round {round_ + 1} {name:<16} " + "  ".join(f"{k} {v:,.2f}" for k, v in figures.items()))

    def quiet(name: str, url: str, pid: int) -> dict[str, Any]:
        idle = measure_idle(pid, idle_s)
        sparse = measure_stream(loop, url, pid, tokens, idle, timeout_s)
        return {"idle_ms_per_s": idle["idle_ms_per_s"], "sparse_us_per_event": sparse["process_us_per_event"],
                "sparse_wakeups_per_event": sparse["wakeups_per_event"], "errors": sparse["errors"]}  # fmt: skip

    def crowds(name: str, url: str, pid: int) -> dict[str, Any]:
        figures: dict[str, Any] = {"errors": 0}
        for count in streams:
            many = _many_streams(loop, url, pid, count, tokens, timeout_s)
            figures["errors"] += many.pop("errors")
            figures.update({f"{key}@{count}": value for key, value in many.items()})
            time.sleep(0.5)  # closed connections settle
        return figures

    try:
        for url, _ in targets.values():  # warm: connections, lazy imports, the relay thread
            loop.run_until_complete(run_paced(url, APIS["chat"], 4, 4, 0.0, timeout_s))
        time.sleep(1.0)
        each(quiet, "idle + sparse")
        each(crowds, "streams")
    finally:
        loop.close()
    return rows


def short_figures(
    targets: Targets, levels: list[int], requests: int, rounds: int, headers: dict[str, str] | None = None,
    workload: Workload | None = None,
) -> dict[str, dict[int, float | None]]:
    """Per target and level: CPU ms per short request (16 tokens; streamed unless ``workload`` says), alternating
    rounds (:func:`drive`); ``headers``: sent with each (the OpenAI SDK's, :data:`benchmarks.loadgen.SDK_HEADERS`)."""
    measured = drive(
        {name: url for name, (url, _) in targets.items()}, workload or Workload(), levels, requests, console, rounds=rounds, warmup=16,
        cpu_groups={name: {"proxy": pid} for name, (_, pid) in targets.items()}, quickack=True, headers=headers,
    )  # fmt: skip
    return {name: {level: measured[str(level)][name].get("cpu_ms_per_req", {}).get("proxy") for level in levels} for name in targets}


# (title, key in a target's figures, digits); the loop's wake-ups are the gateway's own (the router has no Python loop)
def _rows(streams: list[int], levels: list[int]) -> list[tuple[str, str, int]]:
    if not streams:  # (--short-only)
        return [(f"short request, c={level}: CPU ms per request", f"short_ms@{level}", 3) for level in levels]
    rows = [("one sparse stream: CPU µs per event", "sparse_us_per_event", 1)]
    rows += [(f"{count:,} streams: CPU µs per event", f"us_per_event@{count}", 1) for count in streams]
    rows += [(f"short request, c={level}: CPU ms per request", f"short_ms@{level}", 3) for level in levels]
    rows += [("idle: CPU ms per second", "idle_ms_per_s", 2)]
    rows += [("one sparse stream: main-loop wake-ups per event", "sparse_wakeups_per_event", 2)]
    rows += [(f"{count:,} streams: main-loop wake-ups per event", f"wakeups_per_event@{count}", 2) for count in streams]
    top = max(streams)
    rows += [(f"{top:,} streams: {what}", f"{key}@{top}", digits) for what, key, digits in
             (("events/s", "events_per_s", 0), ("TTFT p50 ms", "ttft_p50_ms", 1), ("gap p99 ms", "gap_p99_ms", 1))]  # fmt: skip
    return rows


def summarize(paced: dict[str, list[dict[str, Any]]], short: dict[str, dict[int, float | None]]) -> dict[str, dict[str, float | None]]:
    """Per target: the median over the rounds of every paced figure, and the short requests' CPU per level."""
    summary: dict[str, dict[str, float | None]] = {}
    for name in dict.fromkeys([*paced, *short]):  # (the floor has short requests only)
        runs = paced.get(name, [])
        figures: dict[str, float | None] = {key: statistics.median(run[key] for run in runs) for key in runs[0]} if runs else {}
        figures.update({f"short_ms@{level}": value for level, value in short.get(name, {}).items()})
        if name == processes.ROUTER_TARGET:
            figures = {key: None if "wakeups" in key else value for key, value in figures.items()}  # no Python loop
        summary[name] = figures
    return summary


def print_table(summary: dict[str, dict[str, float | None]], streams: list[int], levels: list[int]) -> None:
    names = list(summary)
    router = summary.get(processes.ROUTER_TARGET, {})
    gateways = [name for name in names if name != processes.ROUTER_TARGET]
    header = ["figure", *names, *(f"{name} / router" for name in gateways)]
    print("\n| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for title, key, digits in _rows(streams, levels):
        values = [_fmt(summary[name].get(key), digits) for name in names]
        ratios = [_ratio(summary[name].get(key), router.get(key)) for name in gateways]
        print(f"| {title} | " + " | ".join([*values, *ratios]) + " |")


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _ratio(ours: float | None, theirs: float | None) -> str:
    return f"**{ours / theirs:.2f}x**" if ours is not None and theirs else "-"


def _paced_run(
    out: Path, streams: list[int], tokens: int, step_ms: float, idle_s: float, rounds: int, baseline_env: dict[str, str] | None,
    on_phase: Callable[[str], None],
) -> dict[str, list[dict[str, Any]]]:
    """The paced figures, over the paced fake (its own processes, stopped before the short requests)."""
    with ExitStack() as stack:
        upstream_url, _ = stack.enter_context(processes.fake_upstream("paced", out, step_ms))
        targets = _proxies(stack, upstream_url, out, baseline_env, "paced")
        on_phase(f"paced fake at {upstream_url} ({step_ms:g} ms steps, {tokens} events a stream): " + ", ".join(f"{n}: pid {p}" for n, (_, p) in targets.items()))
        return paced_figures(targets, streams, tokens, step_ms, idle_s, rounds)


def run_costs(
    out: Path, *, streams: list[int], tokens: int, step_ms: float, idle_s: float, rounds: int, levels: list[int], requests: int,
    short_rounds: int, baseline_env: dict[str, str] | None = None, on_phase: Callable[[str], None] = console.print,
    sdk_headers: bool = False, agent: bool = False, plain: bool = False, short_only: bool = False, floor: bool = False,
) -> dict[str, Any]:
    """Every figure for the gateway, ``baseline_env``'s gateway when given, and the router; printed and saved.
    ``short_only``: the short requests' alone (no paced streams, no idle). ``floor``: the short requests through the
    least a Python proxy on the gateway's stack costs too (:mod:`benchmarks.floor_proxy`)."""
    paced: dict[str, list[dict[str, Any]]] = {}
    if short_only:
        streams = []
    else:
        paced = _paced_run(out, streams, tokens, step_ms, idle_s, rounds, baseline_env, on_phase)
    with ExitStack() as stack:
        stub_logs = out / "stub"
        stub_logs.mkdir(parents=True, exist_ok=True)
        stub_url, _ = stack.enter_context(processes.fake_upstream("starlette", stub_logs))
        targets = _proxies(stack, stub_url, out, baseline_env, "stub")
        if floor:
            url, child = stack.enter_context(processes.floor_proxy(stub_url, out / "floor-stub"))
            targets[processes.FLOOR_TARGET] = (url, child.pid)
        kind = ("plain" if plain else "streamed") + (" agent" if agent else "") + " chat requests"
        sent = " with the OpenAI SDK's headers" if sdk_headers else ""
        on_phase(f"fast fake at {stub_url}: short {kind}{sent} at c={','.join(map(str, levels))}")
        workload = Workload(stream=not plain, agent=agent)
        short = short_figures(targets, levels, requests, short_rounds, SDK_HEADERS if sdk_headers else None, workload)
    summary = summarize(paced, short)
    print_table(summary, streams, levels)
    result = {
        "kind": "costs", "machine": machine_info(), "streams": streams, "tokens": tokens, "step_ms": step_ms, "idle_s": idle_s,
        "rounds": rounds, "levels": levels, "requests": requests, "short_rounds": short_rounds, "sdk_headers": sdk_headers,
        "agent": agent, "plain": plain, "floor": floor,
        "paced": paced, "short": {name: {str(k): v for k, v in by.items()} for name, by in short.items()}, "summary": summary,
    }  # fmt: skip
    (out / "result.json").write_text(json.dumps(result, indent=2, default=str))
    console.print(f"results: {out / 'result.json'}")
    return result
