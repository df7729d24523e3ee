"""``python -m benchmarks paced``: direct, the gateway and SGLang's router on the same decode-loop fake, one run.

For each stream count, each target gets the same paced load (:mod:`benchmarks.paced`) in turn: direct to
the fake (:mod:`benchmarks.paced_upstream`), through the gateway, through ``sglang_router``. CPU is read from
``/proc`` for every process before and after each run, and divided by the events the client received: the
µs per relayed event of a proxy is the figure that decides how many streams one process can carry.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from benchmarks import processes
from benchmarks.apis import APIS
from benchmarks.loadgen import new_event_loop
from benchmarks.paced import run_paced
from benchmarks.report import console, machine_info


def _cpu(pids: dict[str, int]) -> dict[str, tuple[float, float]]:
    """(user, system) CPU seconds of this client and of each process group."""
    own = os.times()
    return {"client": (own.user, own.system), **{name: processes.group_cpu_split_s(pid) for name, pid in pids.items()}}


def _spent(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """CPU seconds spent between two readings: each total, and each process's kernel part as ``NAME_system``.
    The total is the sum of the two differences (not the difference of two sums), so a run spent all in the kernel
    gives a kernel part equal to its total, not a rounding above it."""
    spent: dict[str, float] = {}
    for name, (user, system) in after.items():
        user_s, system_s = user - before[name][0], system - before[name][1]
        spent[name] = user_s + system_s
        if name != "client":
            spent[f"{name}_system"] = system_s
    return spent


def paced_run(
    streams: list[int],
    *,
    api: str,
    tokens: int,
    step_ms: float,
    ramp_s: float,
    targets: list[str],
    gateway_env: dict[str, str],
    gateway_settings: dict[str, Any],
    timeout_s: float,
    out_dir: Path,
    profile_streams: int | None = None,
    baseline_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Every stream count against every target; prints the table and returns what ``result.json`` holds.
    ``baseline_env``: one more target, ``gateway-baseline``, a single-worker gateway with that environment (another
    checkout's code), right after ``gateway``."""
    dialect = APIS[api]
    if baseline_env is not None:
        at = targets.index("gateway") + 1 if "gateway" in targets else len(targets)
        targets = [*targets[:at], processes.BASELINE, *targets[at:]]
    rows: list[dict[str, Any]] = []
    profile: dict[str, Any] | None = None
    with ExitStack() as stack:
        upstream_url, upstream = stack.enter_context(processes.fake_upstream("paced", out_dir, step_ms))
        urls = {"direct": upstream_url}
        pids = {"direct": {"upstream": upstream.pid}}
        for target in targets:
            workers = 1 if target == processes.BASELINE else gateway_workers(target)
            if workers is not None:  # the proxy's CPU is its process group's: the control process and its workers
                logs = out_dir / target
                logs.mkdir(parents=True, exist_ok=True)
                settings = {"workers": workers, **gateway_settings}
                env = baseline_env if target == processes.BASELINE and baseline_env is not None else gateway_env
                url, child = stack.enter_context(processes.gateway(upstream_url, logs, env, settings))
                urls[target], pids[target] = url, {"upstream": upstream.pid, "proxy": child.pid}
        if "router" in targets:
            url, child = stack.enter_context(processes.router([upstream_url], out_dir))
            urls["router"], pids["router"] = url, {"upstream": upstream.pid, "proxy": child.pid}
        console.print(f"paced fake at {upstream_url} ({step_ms:g} ms steps, {tokens} tokens a stream); " + ", ".join(f"{k}: {v}" for k, v in urls.items()))
        loop = new_event_loop()
        try:
            for count in streams:
                for target in targets:
                    before = _cpu(pids[target])
                    result = loop.run_until_complete(run_paced(urls[target], dialect, count, tokens, ramp_s, timeout_s))
                    after = _cpu(pids[target])
                    row = {"target": target, **result.summary()}
                    for name, spent in _spent(before, after).items():
                        row[f"cpu_s_{name}"] = spent
                        row[f"cpu_us_per_event_{name}"] = spent / result.events * 1e6 if result.events else None
                    rows.append(row)
                    _add_gap_added(row, rows)
                    console.print(_line(row))
                    time.sleep(0.5)  # closed connections settle before the next run
            if profile_streams and "gateway" in urls:  # (one process: the single-worker gateway)
                profile = _profile(loop, urls["gateway"], pids["gateway"]["proxy"], dialect, profile_streams, tokens, ramp_s, timeout_s, out_dir)
        finally:
            loop.close()
    _print_table(rows, targets)
    return {"rows": rows, "profile": profile}


def _profile(loop: Any, url: str, pid: int, dialect: Any, streams: int, tokens: int, ramp_s: float, timeout_s: float, out_dir: Path) -> dict[str, Any]:
    from benchmarks.profile import analyse

    console.print(f"profiling the gateway (pid {pid}) with py-spy at {streams} streams")
    profiler = processes.Profiler(pid, out_dir / "profile")
    try:
        loop.run_until_complete(run_paced(url, dialect, streams, tokens, ramp_s, timeout_s))
    finally:
        profiler.stop()
    report: dict[str, Any] = {"svg": str(profiler.svg), "raw": str(profiler.raw)}
    if profiler.raw.exists():
        report.update(analyse(profiler.raw))
    return report


def _add_gap_added(row: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """The gap a target adds to a stream's events: its gap p50 / p99 minus direct's at the same stream count, same
    run (None without a direct row). Direct's own gap is the fake's step plus the client's lag; what a proxy adds
    on top is its own doing."""
    direct = next((r for r in rows if r["target"] == "direct" and r["streams"] == row["streams"]), None)
    for q in ("p50", "p99"):
        ours, base = row.get(f"gap_{q}_ms"), direct.get(f"gap_{q}_ms") if direct else None
        row[f"gap_added_{q}_ms"] = ours - base if ours is not None and base is not None and row["target"] != "direct" else None


def _fmt(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _line(row: dict[str, Any]) -> str:
    return (
        f"{row['streams']:>5} {row['target']:<11} {row['events_per_s']:>9,.0f} ev/s  TTFT p50 {_fmt(row['ttft_p50_ms'])} ms  "
        f"gap p99 {_fmt(row['gap_p99_ms'])} ms (added p50/p99 {_fmt(row.get('gap_added_p50_ms'))}/{_fmt(row.get('gap_added_p99_ms'))})  errors {row['errors']}  proxy {_fmt(row.get('cpu_us_per_event_proxy'))} µs/event "
        f"({_fmt(row.get('cpu_us_per_event_proxy_system'))} in the kernel)"
    )


def _print_table(rows: list[dict[str, Any]], targets: list[str]) -> None:
    table = Table(title="paced streams: per target (CPU µs per event received by the client)")
    for column in (
        "streams", "target", "events/s", "TTFT p50/p99 ms", "gap p50/p99 ms", "added gap p50/p99 ms", "errors", "proxy µs/ev",
        "of it kernel", "upstream µs/ev", "client µs/ev",
    ):  # fmt: skip
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            str(row["streams"]), row["target"], f"{row['events_per_s']:,.0f}",
            f"{_fmt(row['ttft_p50_ms'])} / {_fmt(row['ttft_p99_ms'])}", f"{_fmt(row['gap_p50_ms'])} / {_fmt(row['gap_p99_ms'])}",
            f"{_fmt(row.get('gap_added_p50_ms'))} / {_fmt(row.get('gap_added_p99_ms'))}", str(row["errors"]), _fmt(row.get("cpu_us_per_event_proxy")), _fmt(row.get("cpu_us_per_event_proxy_system")),
            _fmt(row.get("cpu_us_per_event_upstream")),
            _fmt(row.get("cpu_us_per_event_client")),
        )  # fmt: skip
    Console(width=180).print(table)
    by = {(row["streams"], row["target"]): row for row in rows}
    for count in sorted({row["streams"] for row in rows}):
        router = by.get((count, "router"))
        for target in (t for t in targets if gateway_workers(t) is not None or t == processes.BASELINE):
            gateway = by.get((count, target))
            if gateway and router and gateway.get("cpu_us_per_event_proxy") and router.get("cpu_us_per_event_proxy"):
                ratio = gateway["cpu_us_per_event_proxy"] / router["cpu_us_per_event_proxy"]
                console.print(
                    f"{count:>5} streams: {target}/router CPU per event {ratio:.2f}x, events/s {gateway['events_per_s'] / router['events_per_s']:.2f}x, "
                    f"TTFT p50 {_ratio(gateway['ttft_p50_ms'], router['ttft_p50_ms'])}; added gap p50 {_fmt(gateway.get('gap_added_p50_ms'))} ms "
                    f"(router {_fmt(router.get('gap_added_p50_ms'))}), p99 {_fmt(gateway.get('gap_added_p99_ms'))} ms (router {_fmt(router.get('gap_added_p99_ms'))})"
                )
        single = by.get((count, "gateway"))
        for target in (t for t in targets if t.startswith("gateway-w") or t == processes.BASELINE):
            many = by.get((count, target))
            if single and many and single.get("cpu_us_per_event_proxy") and many.get("cpu_us_per_event_proxy"):
                console.print(
                    f"{count:>5} streams: {target}/gateway CPU per event {many['cpu_us_per_event_proxy'] / single['cpu_us_per_event_proxy']:.2f}x, "
                    f"events/s {many['events_per_s'] / single['events_per_s']:.2f}x"
                )


def _ratio(ours: float | None, theirs: float | None) -> str:
    return f"{ours / theirs:.2f}x" if ours is not None and theirs else "-"


def gateway_workers(target: str) -> int | None:
    """``gateway`` -> 1 worker, ``gateway-w4`` -> 4 workers (same run, same fake), anything else -> None."""
    if target == "gateway":
        return 1
    if target.startswith("gateway-w") and target[len("gateway-w"):].isdigit() and int(target[len("gateway-w"):]) >= 1:
        return int(target[len("gateway-w"):])
    return None


def parse_settings(items: list[str] | None) -> dict[str, Any]:
    """``http.max_connections=8192`` -> {"http.max_connections": 8192} (values read as YAML)."""
    settings: dict[str, Any] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"not NAME=VALUE: {item!r}")
        settings[name] = yaml.safe_load(value)
    return settings


def save(result: dict[str, Any], out_dir: Path) -> None:
    result = {**result, "machine": machine_info()}
    (out_dir / "result.json").write_text(json.dumps(result, indent=2, default=str))
    console.print(f"results: {out_dir / 'result.json'}")
