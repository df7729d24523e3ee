"""Reporting what a benchmark measured: the tables printed to the terminal, and ``result.json`` / plots on disk.

A result records the machine it ran on (CPU, load, package versions, the measured commit) next to the
figures, so that numbers read weeks later still say where they came from.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks import processes
from benchmarks.stats import FIGURES

console = Console(stderr=True)
out_console = Console(width=max(Console().width, 220))  # tables stay readable in logs and pipes

_PACKAGES = (
    "sglang-gateway",
    "sglang",
    "torch",
    "uvicorn",
    "starlette",
    "fastapi",
    "aiohttp",
    "httpx",
    "httpcore",
    "h11",
    "httptools",
    "uvloop",
    "openai",
    "mlflow",
    "orjson",
)
_MET = {True: "[green]met[/]", False: "[red]MISSED[/]", None: "-"}


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], cwd=processes.REPO, capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info() -> dict[str, Any]:
    """The machine, its load and the code a result was measured on."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "git_commit": _git("rev-parse", "--short", "HEAD"),  # other work may be in progress in the tree:
        "gateway_tree_dirty": bool(_git("status", "--porcelain", "gateway")),
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "python": platform.python_version(),
        "python_build": f"{sys.version} at {sys.base_prefix}",  # builds of one version differ (docs/development.md)
        "platform": platform.platform(),
        "loadavg_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "versions": {name: _version(name) for name in _PACKAGES},
    }


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def print_levels(levels: dict[str, dict[str, Any]], targets: list[str], title: str = "per level") -> None:
    """Every figure per level and target, and the gateway/direct ratios when both were measured."""
    table = Table(title=title, show_lines=False)
    table.add_column("c", justify="right")
    table.add_column("target")
    for _, label, _ in FIGURES:
        table.add_column(label, justify="right")
    table.add_column("err", justify="right")
    table.add_column("CPU ms/req")
    for level, entry in levels.items():
        for name in targets:
            s = entry[name]
            cpu = " ".join(f"{k} {v:.2f}" for k, v in s.get("cpu_ms_per_req", {}).items())
            table.add_row(
                level,
                name,
                *(fmt(s[key], 2 if key.endswith("_ms") else 1) for key, _, _ in FIGURES),
                str(s["errors"]),
                cpu,
            )
        if "vs" in entry:
            table.add_row(level, "[bold]gw/direct[/]", *_ratio_cells(entry["vs"]), "")
        for name, vs in entry.get("vs_gateway", {}).items():
            if name in targets:
                table.add_row(level, f"[bold]{name}/gw[/]", *_ratio_cells(vs), "")
        for name, vs in entry.get("vs_reference", {}).items():
            if name in targets:
                table.add_row(level, f"[bold]{name}/{entry['references'][name]}[/]", *_ratio_cells(vs), "")
    out_console.print(table)


def _ratio_cells(vs: dict[str, Any]) -> list[str]:
    """One cell per figure: the ratio, the paired median of req/s, the added ms of latencies."""
    cells = []
    for key, _, _ in FIGURES:
        one = vs[key]
        ratio = fmt(one["ratio"], 3) if one["ratio"] is not None else "-"
        extra = f" (paired {one['paired_median_ratio']:.3f})" if one.get("paired_median_ratio") else ""
        cells.append(ratio + extra + (f" ({one['added_ms']:+.2f})" if one.get("added_ms") is not None else ""))
    return cells


def _compared(api: str, level: str, vs: dict[str, Any]) -> dict[str, Any]:
    """What a row says of one target against another: req/s ratio (paired median too), added p50 TTFT and latency."""
    return {
        "api": api,
        "c": int(level),
        "req_s_ratio": vs["req_s"]["ratio"],
        "req_s_paired_median_ratio": vs["req_s"].get("paired_median_ratio"),
        "added_ttft_p50_ms": vs["ttft_p50_ms"].get("added_ms"),
        "added_latency_p50_ms": vs["latency_p50_ms"].get("added_ms"),
    }


def api_summary_rows(apis: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per API and level: the figures the benchmark README tabulates (gateway/direct)."""
    rows = []
    for api, measured in apis.items():
        for level, entry in measured["levels"].items():
            if "vs" not in entry:
                continue
            vs, gateway, direct = entry["vs"], entry["gateway"], entry["direct"]
            rows.append(
                {
                    **_compared(api, level, vs),
                    "gateway_cpu_ms_per_req": gateway.get("cpu_ms_per_req", {}).get("gateway"),
                    "upstream_cpu_ms_per_req": direct.get("cpu_ms_per_req", {}).get("upstream"),
                    "errors": direct["errors"] + gateway["errors"],
                }
            )
    return rows


def tenant_summary_rows(apis: dict[str, dict[str, Any]], target: str) -> list[dict[str, Any]]:
    """Per API and level: ``target`` (the gateway with keys and the ledger) against the plain gateway."""
    rows = []
    for api, measured in apis.items():
        for level, entry in measured["levels"].items():
            vs = entry.get("vs_gateway", {}).get(target)
            if vs is None:
                continue
            rows.append(
                {
                    **_compared(api, level, vs),
                    "plain_cpu_ms_per_req": entry["gateway"].get("cpu_ms_per_req", {}).get("gateway"),
                    "keyed_cpu_ms_per_req": entry[target].get("cpu_ms_per_req", {}).get("gateway"),
                    "errors": entry[target]["errors"],
                }
            )
    return rows


def shared_summary_rows(apis: dict[str, dict[str, Any]], target: str, reference: str) -> list[dict[str, Any]]:
    """Per API and level: ``target`` (the keyed gateway as a replica sharing a store) against ``reference`` (the same
    gateway alone), with the CPU per request of each and of the store's server (PostgreSQL, charged to ``target``)."""
    rows = []
    for api, measured in apis.items():
        for level, entry in measured["levels"].items():
            vs = entry.get("vs_reference", {}).get(target)
            if vs is None:
                continue
            cpu = entry[target].get("cpu_ms_per_req", {})
            rows.append(
                {
                    **_compared(api, level, vs),
                    "reference_cpu_ms_per_req": entry[reference].get("cpu_ms_per_req", {}).get("gateway"),
                    "shared_cpu_ms_per_req": cpu.get("gateway"),
                    "store_cpu_ms_per_req": cpu.get("postgres"),
                    "errors": entry[target]["errors"],
                }
            )
    return rows


def print_shared_summary(rows: list[dict[str, Any]]) -> None:
    measures = (
        ("added p50 latency ms", "added_latency_p50_ms"), ("added p50 TTFT ms", "added_ttft_p50_ms"),
        ("keys+ledger CPU ms/req", "reference_cpu_ms_per_req"), ("shared replica CPU ms/req", "shared_cpu_ms_per_req"),
        ("PostgreSQL CPU ms/req", "store_cpu_ms_per_req"),
    )  # fmt: skip
    _print_per_api("shared replica / keys + ledger alone per API (the store on this host)", rows, measures, digits=3)


def router_summary_rows(apis: dict[str, dict[str, Any]], target: str) -> list[dict[str, Any]]:
    """Per API and level: SGLang's router (``target``) against direct, with the gateway's figures of the same rounds."""
    rows = []
    for api, measured in apis.items():
        for level, entry in measured["levels"].items():
            vs = entry.get("vs_direct", {}).get(target)
            if vs is None or "vs" not in entry:
                continue
            rows.append(
                {
                    **_compared(api, level, vs),
                    "gateway_req_s_ratio": entry["vs"]["req_s"]["ratio"],
                    "gateway_added_latency_p50_ms": entry["vs"]["latency_p50_ms"].get("added_ms"),
                    "router_cpu_ms_per_req": entry[target].get("cpu_ms_per_req", {}).get("router"),
                    "gateway_cpu_ms_per_req": entry["gateway"].get("cpu_ms_per_req", {}).get("gateway"),
                    "errors": entry[target]["errors"],
                }
            )
    return rows


def print_router_summary(rows: list[dict[str, Any]]) -> None:
    """The reference proxy beside the gateway: what each keeps of direct on the same machine in the same run."""
    measures = (
        ("added p50 latency ms", "added_latency_p50_ms"), ("gateway req/s ratio", "gateway_req_s_ratio"),
        ("gateway added p50 latency ms", "gateway_added_latency_p50_ms"),
        ("router CPU ms/req", "router_cpu_ms_per_req"), ("gateway CPU ms/req", "gateway_cpu_ms_per_req"),
    )  # fmt: skip
    _print_per_api("SGLang's router / direct per API (the gateway's figures of the same rounds beside)", rows, measures, digits=3)


def print_tenant_summary(
    rows: list[dict[str, Any]], title: str = "keys + ledger / plain gateway per API", heading: str = "keys+ledger CPU ms/req"
) -> None:
    """A second gateway (``keyed_cpu_ms_per_req``: its CPU) against the plain one: keys + ledger, or tracing."""
    measures = (
        ("added p50 latency ms", "added_latency_p50_ms"), ("added p50 TTFT ms", "added_ttft_p50_ms"),
        ("plain gateway CPU ms/req", "plain_cpu_ms_per_req"), (heading, "keyed_cpu_ms_per_req"),
    )  # fmt: skip
    _print_per_api(title, rows, measures, digits=3)


def print_api_summary(rows: list[dict[str, Any]]) -> None:
    measures = (
        ("added p50 TTFT ms", "added_ttft_p50_ms"), ("added p50 latency ms", "added_latency_p50_ms"),
        ("gateway CPU ms/req", "gateway_cpu_ms_per_req"), ("upstream CPU ms/req", "upstream_cpu_ms_per_req"),
    )  # fmt: skip
    _print_per_api("gateway/direct per API", rows, measures, digits=2)


def _print_per_api(title: str, rows: list[dict[str, Any]], measures: tuple[tuple[str, str], ...], digits: int) -> None:
    """One row per API and concurrency: the req/s ratio (with its paired median), ``measures`` (heading, key), errors."""
    table = Table(title=title)
    for column in ("API", "c", "req/s ratio (paired median)", *(heading for heading, _ in measures), "errors"):
        table.add_column(column, justify="right")
    for row in rows:
        paired = row["req_s_paired_median_ratio"]
        table.add_row(
            row["api"],
            str(row["c"]),
            fmt(row["req_s_ratio"], digits) + (f" ({paired:.{digits}f})" if paired is not None else ""),
            *(fmt(row[key], digits) for _, key in measures),
            str(row["errors"]),
        )
    out_console.print(table)


def print_targets(checks: list[dict[str, Any]], title: str = "targets") -> None:
    if not checks:
        return
    table = Table(title=title)
    for column in ("target", "measured", "limit", "met"):
        table.add_column(column)
    for check in checks:
        value = fmt(check["value"], 3 if check["unit"] == "x" else 2)
        table.add_row(
            check["target"],
            f"{value} {check['unit']}",
            f"{check['op']} {check['limit']} {check['unit']}",
            _MET[check["met"]],
        )
    out_console.print(table)


def print_profile(report: dict[str, Any]) -> None:
    console.print(f"profile: {report.get('svg')} ({report.get('samples', 0)} samples while busy)")
    for key, title in (
        ("self_by_component_pct", "self time by component"),
        ("inclusive_by_component_pct", "inclusive time by component"),
        ("self_by_function_pct", "self time by function"),
        ("inclusive_by_function_pct", "inclusive time by function"),
    ):
        table = Table(title=title)
        table.add_column("where")
        table.add_column("% of busy samples", justify="right")
        for name, pct in report.get(key, []):
            table.add_row(name, f"{pct:.1f}")
        out_console.print(table)


def print_mlflow(rows: list[dict[str, Any]], trace_sink: str = "store") -> None:
    table = Table(title=f"MLflow wrapper vs raw openai client (sequential calls, traces to: {trace_sink})")
    for column in (
        "flavour",
        "mode",
        "raw p50 ms",
        "wrapper p50 ms",
        "added p50 ms",
        "raw p99 ms",
        "wrapper p99 ms",
        "added p99 ms",
        "added TTFT p50 ms",
        "added CPU ms caller / all",
        "target",
    ):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            row["flavor"],
            row["mode"],
            fmt(row["raw_p50_ms"], 2),
            fmt(row["wrapper_p50_ms"], 2),
            fmt(row["added_p50_ms"], 2),
            fmt(row["raw_p99_ms"], 2),
            fmt(row["wrapper_p99_ms"], 2),
            fmt(row.get("added_p99_ms"), 2),
            fmt(row.get("added_ttft_p50_ms"), 2),
            f"{fmt(row.get('added_caller_cpu_ms'), 2)} / {fmt(row.get('added_process_cpu_ms'), 2)}",
            _MET[row.get("met")],
        )
    out_console.print(table)


def print_affinity(summaries: dict[str, dict[str, Any]], ratios: dict[str, float | None]) -> None:
    """One row per balancing policy, then affinity / no affinity."""
    table = Table(title="prefix affinity: the same workload under each policy (pooled over rounds)")
    columns = (
        ("cached tokens/req", "cached_tokens_per_request", 1),
        ("prompt tokens/req", "prompt_tokens_per_request", 1),
        ("cached share", "cached_share", 3),
        ("engine cached share", "engine_cached_share", 3),
        ("TTFT p50 ms", "ttft_p50_ms", 1),
        ("TTFT p90 ms", "ttft_p90_ms", 1),
        ("lat p50 ms", "latency_p50_ms", 1),
        ("lat p90 ms", "latency_p90_ms", 1),
        ("req/s", "req_s", 2),
    )
    table.add_column("policy")
    for label, _, _ in columns:
        table.add_column(label, justify="right")
    table.add_column("requests per replica")
    table.add_column("errors", justify="right")
    for policy, summary in summaries.items():
        spread = " ".join(f"{replica}:{count:.0f}" for replica, count in summary["per_replica"].items())
        table.add_row(
            policy, *(fmt(summary[key], digits) for _, key, digits in columns), spread, str(summary["errors"])
        )
    table.add_row(
        "[bold]affinity / none[/]", *(fmt(ratios.get(key), 3) if key in ratios else "" for _, key, _ in columns), "", ""
    )
    out_console.print(table)


def print_clients(rows: list[dict[str, Any]], title: str) -> None:
    table = Table(title=title)
    for column in ("client", "round", "CPU ms/req", "wall s"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["client"], str(row["round"]), f"{row['cpu_ms_per_req']:.3f}", f"{row['wall_s']:.2f}")
    out_console.print(table)


def save(result: dict[str, Any], out_dir: Path, plot: bool = True) -> None:
    """``result.json``, and with ``plot`` one ``plot-<api>.png`` per API measured (needs matplotlib)."""
    (out_dir / "result.json").write_text(json.dumps(result, indent=2, default=str))
    console.print(f"results: {out_dir / 'result.json'}")
    if not plot or "apis" not in result:
        return
    try:
        from benchmarks.plot import plot as make_plot

        for api, measured in result["apis"].items():
            view = {**result, **measured, "title": f"{result['title']}, {api}"}
            console.print(f"plot:    {make_plot(view, out_dir / f'plot-{api}.png')}")
    except ImportError:
        console.print("[yellow]matplotlib is not installed: no plot[/]")


def print_cluster(rows: list[dict[str, Any]], title: str) -> None:
    """One row per concurrency level and target, then that target against ``direct``."""
    table = Table(title=title)
    for column in (
        "c", "target", "TTFT p50 ms", "TTFT p90 ms", "lat p50 ms", "req/s", "x direct: TTFT p50 / p90",
        "lat p50", "req/s (paired)", "requests per engine", "errors", "CPU ms/req",
    ):  # fmt: skip
        table.add_column(column, justify="right")
    for row in rows:
        ratios = row.get("ratios")
        paired = row.get("req_s_paired_median_ratio")
        table.add_row(
            str(row["c"]),
            row["target"],
            fmt(row["ttft_p50_ms"], 2),
            fmt(row["ttft_p90_ms"], 2),
            fmt(row["latency_p50_ms"], 2),
            fmt(row["req_s"], 2),
            f"{fmt(ratios['ttft_p50_ms'], 3)} / {fmt(ratios['ttft_p90_ms'], 3)}" if ratios else "",
            fmt(ratios["latency_p50_ms"], 3) if ratios else "",
            (fmt(ratios["req_s"], 3) + (f" ({paired:.3f})" if paired is not None else "")) if ratios else "",
            " ".join(f"{count:.0f}" for count in row["requests_per_engine"]),
            str(row["errors"]),
            " ".join(f"{k} {v:.2f}" for k, v in row["cpu_ms_per_req"].items()),
        )
    out_console.print(table)
