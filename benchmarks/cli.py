"""``python -m benchmarks``: load runs against a URL, gateway-vs-direct side by side, MLflow wrapper cost.

Every run is bounded (a request count per level and a wall-clock cap per batch) and stops every process
it started. Results go to ``benchmarks/results/<time>-<name>/`` as ``result.json`` and ``plot.png``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from importlib import metadata
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from benchmarks import processes
from benchmarks.loadgen import BatchResult, Workload, new_event_loop, run_batch
from benchmarks.progress import progress_bar
from benchmarks.stats import FIGURES, compare, evaluate_targets, summarize

app = typer.Typer(
    name="benchmarks",
    help="Benchmarks of sglang-gateway: load runs, gateway vs direct side by side, MLflow wrapper cost.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)
out_console = Console(width=max(Console().width, 220))  # tables stay readable in logs and pipes
RESULTS = Path(__file__).resolve().parent / "results"

Levels = Annotated[str, typer.Option("--concurrency", "-c", help="Comma-separated concurrency levels.")]
Requests = Annotated[
    int, typer.Option("--requests", "-n", help="Requests per target per level (split over the rounds).")
]
Stream = Annotated[bool, typer.Option("--stream/--no-stream", help="Streaming (SSE) chat completions or plain JSON.")]
PromptTokens = Annotated[int, typer.Option("--prompt-tokens", help="Approximate prompt length in tokens.")]
OutputTokens = Annotated[
    int, typer.Option("--output-tokens", help="max_tokens (with ignore_eos: exact output length).")
]
MaxSeconds = Annotated[
    float, typer.Option("--max-seconds", help="Wall-clock cap of one batch (stops issuing requests).")
]
Out = Annotated[
    Path | None, typer.Option("--out", help="Results directory (default: benchmarks/results/<time>-<name>).")
]


# ------------------------------------------------------------------------------------ helpers
def _levels(text: str) -> list[int]:
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise typer.BadParameter(f"not a list of integers: {text!r}") from None
    if not values or min(values) < 1:
        raise typer.BadParameter("concurrency levels must be >= 1")
    return values


def _out_dir(out: Path | None, name: str) -> Path:
    path = out or RESULTS / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    packages = [
        "sglang-gateway",
        "sglang",
        "torch",
        "uvicorn",
        "starlette",
        "fastapi",
        "httpx",
        "httpcore",
        "h11",
        "httptools",
        "uvloop",
        "openai",
        "mlflow",
        "orjson",
    ]
    try:  # which gateway code was measured (other work may be in progress in the tree)
        import subprocess

        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=processes.REPO, capture_output=True, text=True, timeout=5
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "gateway"],
                cwd=processes.REPO,
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
        )
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", False
    return {
        "git_commit": commit,
        "gateway_tree_dirty": dirty,
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_at_start": load,
        "versions": {name: _version(name) for name in packages},
    }


def _progress() -> Progress:
    return progress_bar(console)


def drive(
    targets: dict[str, str],
    workload: Workload,
    levels: list[int],
    requests: int,
    *,
    rounds: int = 1,
    warmup: int = 0,
    max_seconds: float = 60.0,
    between_levels: Callable[[int], None] | None = None,
    headers: dict[str, str] | None = None,
    cpu_groups: dict[str, dict[str, int]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Run every level against every target; with several targets, batches alternate (ABBA order per round)."""
    loop = new_event_loop()
    names = list(targets)
    per_round = max(1, -(-requests // rounds))
    out: dict[str, dict[str, Any]] = {}
    try:
        with _progress() as progress:
            for level in levels:
                batches: dict[str, list[BatchResult]] = {name: [] for name in names}
                if warmup:
                    task = progress.add_task(f"c={level:<4} warm-up", total=warmup * len(names))
                    for name in names:
                        loop.run_until_complete(
                            run_batch(
                                targets[name],
                                workload,
                                min(level, warmup),
                                warmup,
                                target=name,
                                max_seconds=max_seconds,
                                on_done=lambda t=task: progress.advance(t),
                                headers=headers,
                            )
                        )
                    progress.remove_task(task)
                task = progress.add_task(f"c={level:<4} {' vs '.join(names)}", total=per_round * rounds * len(names))
                for r in range(rounds):
                    order = names if r % 2 == 0 else names[::-1]
                    for name in order:
                        progress.update(task, description=f"c={level:<4} round {r + 1}/{rounds} {name:<8}")
                        groups = (cpu_groups or {}).get(name, {})
                        before = {label: processes.group_cpu_s(pgid) for label, pgid in groups.items()}
                        client_before = time.process_time()
                        batch = loop.run_until_complete(
                            run_batch(
                                targets[name],
                                workload,
                                level,
                                per_round,
                                target=name,
                                max_seconds=max_seconds,
                                on_done=lambda t=task: progress.advance(t),
                                headers=headers,
                            )
                        )
                        batch.cpu_s = {
                            label: processes.group_cpu_s(pgid) - before[label] for label, pgid in groups.items()
                        }
                        batch.cpu_s["client"] = time.process_time() - client_before
                        batches[name].append(batch)
                entry: dict[str, Any] = {name: summarize(batches[name]) for name in names}
                if "direct" in entry and "gateway" in entry:
                    entry["vs"] = compare(entry["direct"], entry["gateway"])
                    # rounds run back to back (ABBA): the median of per-round ratios resists load spikes on a shared machine
                    pairs = [
                        g.samples and d.samples and (len(g.samples) / g.wall_s) / (len(d.samples) / d.wall_s)
                        for d, g in zip(batches["direct"], batches["gateway"], strict=True)
                        if d.wall_s and g.wall_s
                    ]
                    entry["vs"]["req_s"]["paired_median_ratio"] = float(statistics.median(pairs)) if pairs else None
                entry["rounds"] = {
                    name: [
                        round(len([s for s in b.samples if s.ok]) / b.wall_s, 1) if b.wall_s else 0
                        for b in batches[name]
                    ]
                    for name in names
                }
                out[str(level)] = entry
                if between_levels is not None:
                    between_levels(level)
    finally:
        loop.close()
    return out


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def print_levels(levels: dict[str, dict[str, Any]], targets: list[str]) -> None:
    table = Table(title="per level", show_lines=False)
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
                *(_fmt(s[key], 2 if key.endswith("_ms") else 1) for key, _, _ in FIGURES),
                str(s["errors"]),
                cpu,
            )
        if "vs" in entry:
            cells = []
            for key, _, _ in FIGURES:
                vs = entry["vs"][key]
                ratio = _fmt(vs["ratio"], 3) if vs["ratio"] is not None else "-"
                extra = f" (paired {vs['paired_median_ratio']:.3f})" if vs.get("paired_median_ratio") else ""
                cells.append(ratio + extra + (f" ({vs['added_ms']:+.2f})" if vs.get("added_ms") is not None else ""))
            table.add_row(level, "[bold]gw/direct[/]", *cells, "")
    out_console.print(table)


def print_targets(checks: list[dict[str, Any]]) -> None:
    if not checks:
        return
    table = Table(title="targets (issue 6)")
    for column in ("target", "measured", "limit", "met"):
        table.add_column(column)
    for check in checks:
        value = _fmt(check["value"], 3 if check["unit"] == "x" else 2)
        met = {True: "[green]met[/]", False: "[red]MISSED[/]", None: "-"}[check["met"]]
        table.add_row(
            check["target"], f"{value} {check['unit']}", f"{check['op']} {check['limit']} {check['unit']}", met
        )
    out_console.print(table)


def _save(result: dict[str, Any], out_dir: Path, plot: bool = True) -> None:
    (out_dir / "result.json").write_text(json.dumps(result, indent=2, default=str))
    console.print(f"results: {out_dir / 'result.json'}")
    if plot:
        try:
            from benchmarks.plot import plot as make_plot

            png = make_plot(result, out_dir / "plot.png")
            console.print(f"plot:    {png}")
        except ImportError:
            console.print("[yellow]matplotlib is not installed: no plot[/]")


# ------------------------------------------------------------------------------------ commands
@app.command()
def run(
    url: Annotated[str, typer.Argument(help="Base URL of an OpenAI-compatible server (e.g. http://127.0.0.1:8000).")],
    concurrency: Levels = "1,4,16",
    requests: Requests = 200,
    stream: Stream = True,
    prompt_tokens: PromptTokens = 32,
    output_tokens: OutputTokens = 16,
    model: Annotated[str, typer.Option(help="The request's model field.")] = "bench",
    api_key: Annotated[str | None, typer.Option(help="Bearer key to send.", envvar="BENCH_API_KEY")] = None,
    warmup: Annotated[int, typer.Option(help="Warm-up requests per level (not counted).")] = 8,
    max_seconds: MaxSeconds = 60.0,
    out: Out = None,
    plot: Annotated[bool, typer.Option(help="Write plot.png.")] = True,
) -> None:
    """Drive one target URL with a fixed workload and report each concurrency level."""
    workload = Workload(model=model, stream=stream, prompt_tokens=prompt_tokens, output_tokens=output_tokens)
    out_dir = _out_dir(out, "run")
    headers = {"authorization": f"Bearer {api_key}"} if api_key else None
    levels = drive(
        {"target": url},
        workload,
        _levels(concurrency),
        requests,
        warmup=warmup,
        max_seconds=max_seconds,
        headers=headers,
    )
    result = {
        "title": f"load run: {url}",
        "kind": "run",
        "url": url,
        "machine": machine_info(),
        "workload": workload.__dict__,
        "requests_per_level": requests,
        "targets_measured": ["target"],
        "levels": levels,
    }
    print_levels(levels, ["target"])
    _save(result, out_dir, plot)


@app.command("compare")
def compare_command(
    upstream: Annotated[
        str,
        typer.Option(
            help="stub (fake upstream, own process) | sglang (real CPU engine, tiny model) | a URL of a running engine."
        ),
    ] = "stub",
    stub_kind: Annotated[str, typer.Option(help="Fake upstream implementation: starlette | raw.")] = "starlette",
    concurrency: Levels = "1,16,64,256",
    requests: Requests = 1200,
    rounds: Annotated[int, typer.Option(help="Alternating direct/gateway rounds per level.")] = 4,
    stream: Stream = True,
    prompt_tokens: PromptTokens = 32,
    output_tokens: OutputTokens = 16,
    warmup: Annotated[int, typer.Option(help="Warm-up requests per target per level.")] = 16,
    max_seconds: MaxSeconds = 60.0,
    profile: Annotated[
        bool, typer.Option(help="Profile the gateway with py-spy during an extra gateway-only load.")
    ] = False,
    profile_concurrency: Annotated[int, typer.Option(help="Concurrency of the profiled load.")] = 64,
    profile_requests: Annotated[int, typer.Option(help="Requests of the profiled load.")] = 3000,
    label: Annotated[
        str | None, typer.Option(help="Upstream label for a URL upstream (sglang or stub-...: picks the targets).")
    ] = None,
    gateway_env: Annotated[
        list[str] | None,
        typer.Option(
            "--gateway-env",
            help="KEY=VALUE for the gateway process (repeatable), e.g. PYTHONPATH=... to try httptools.",
        ),
    ] = None,
    out: Out = None,
    plot: Annotated[bool, typer.Option(help="Write plot.png.")] = True,
) -> None:
    """The same workload against the upstream directly and through the gateway, alternating, with ratios."""
    levels_list = _levels(concurrency)
    workload = Workload(
        stream=stream, prompt_tokens=prompt_tokens, output_tokens=output_tokens, timeout_s=max(60.0, max_seconds)
    )
    name = f"compare-{upstream if upstream in ('stub', 'sglang') else 'url'}"
    out_dir = _out_dir(out, name)
    env = dict(item.split("=", 1) for item in gateway_env or [])
    info = machine_info()
    upstream_label = f"stub-{stub_kind}" if upstream == "stub" else upstream
    with ExitStack() as stack:
        if upstream == "stub":
            console.print(f"starting the fake upstream ({stub_kind})")
            direct_url, upstream_proc = stack.enter_context(processes.fake_upstream(stub_kind, out_dir))
        elif upstream == "sglang":
            console.print("starting the SGLang CPU engine (tiny model; 30-60 s)")
            t = time.monotonic()
            direct_url, upstream_proc = stack.enter_context(processes.sglang_engine(out_dir))
            console.print(f"engine ready at {direct_url} after {time.monotonic() - t:.0f}s")
        else:
            direct_url, upstream_proc = upstream.rstrip("/"), None
            upstream_label = label or "url"
        gateway_url, gateway_child = stack.enter_context(processes.gateway(direct_url, out_dir, env))
        console.print(
            f"direct: {direct_url}   gateway: {gateway_url} (pid {gateway_child.pid}, {' '.join(gateway_child.argv)})"
        )
        upstream_pgid = upstream_proc.pid if upstream_proc is not None else None
        groups = {"direct": {}, "gateway": {"gateway": gateway_child.pid}}
        if upstream_pgid:
            groups["direct"]["upstream"] = upstream_pgid
            groups["gateway"]["upstream"] = upstream_pgid
        levels = drive(
            {"direct": direct_url, "gateway": gateway_url},
            workload,
            levels_list,
            requests,
            rounds=rounds,
            warmup=warmup,
            max_seconds=max_seconds,
            cpu_groups=groups,
        )
        profile_report = None
        (out_dir / "levels.json").write_text(json.dumps(levels, indent=2, default=str))  # kept if profiling fails
        if profile:
            try:
                profile_report = _profile_gateway(
                    gateway_url,
                    gateway_child.pid,
                    workload,
                    profile_concurrency,
                    profile_requests,
                    max_seconds,
                    out_dir,
                )
            except Exception as error:  # a missing or refused profiler must not lose the measurements
                console.print(f"[red]profiling failed:[/] {error}")
                profile_report = {"error": str(error)}
    checks = evaluate_targets(upstream_label, {int(k): v for k, v in levels.items()})
    result = {
        "title": f"gateway vs direct ({upstream_label})",
        "kind": "compare",
        "upstream": upstream_label,
        "machine": info,
        "workload": workload.__dict__,
        "requests_per_level": requests,
        "rounds": rounds,
        "targets_measured": ["direct", "gateway"],
        "levels": levels,
        "targets": checks,
        "profile": profile_report,
        "gateway_env": env,
    }
    print_levels(levels, ["direct", "gateway"])
    print_targets(checks)
    if profile_report and "error" not in profile_report:
        print_profile(profile_report)
    _save(result, out_dir, plot)


def _profile_gateway(
    url: str, pid: int, workload: Workload, concurrency: int, requests: int, max_seconds: float, out_dir: Path
) -> dict[str, Any]:
    from benchmarks.profile import analyse

    console.print(f"profiling the gateway (pid {pid}) with py-spy at concurrency {concurrency}")
    profiler = processes.Profiler(pid, out_dir / "profile")
    loop = new_event_loop()
    try:
        with _progress() as progress:
            task = progress.add_task(f"c={concurrency:<4} gateway (profiled)", total=requests)
            batch = loop.run_until_complete(
                run_batch(
                    url,
                    workload,
                    concurrency,
                    requests,
                    target="gateway",
                    max_seconds=max_seconds,
                    on_done=lambda: progress.advance(task),
                )
            )
    finally:
        loop.close()
        profiler.stop()
    report: dict[str, Any] = {"load": summarize([batch]), "svg": str(profiler.svg), "raw": str(profiler.raw)}
    if profiler.raw.exists():
        report.update(analyse(profiler.raw))
    return report


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


@app.command("mlflow")
def mlflow_command(
    upstream: Annotated[
        str, typer.Option(help="stub (fake upstream) | sglang (real CPU engine) | a URL of a running engine.")
    ] = "sglang",
    stub_kind: Annotated[str, typer.Option(help="Fake upstream implementation: starlette | raw.")] = "starlette",
    flavors: Annotated[
        str, typer.Option(help="Comma-separated: chat_model, chat_agent, responses_agent.")
    ] = "chat_model,chat_agent,responses_agent",
    requests: Annotated[
        int, typer.Option("--requests", "-n", help="Sequential calls per flavour and mode for each side.")
    ] = 60,
    rounds: Annotated[int, typer.Option(help="Alternating raw/wrapper rounds.")] = 4,
    output_tokens: OutputTokens = 16,
    trace_sink: Annotated[
        str,
        typer.Option(
            help="store (sqlite tracking store, like a notebook) | serving (Model Serving's in-memory buffer)."
        ),
    ] = "store",
    out: Out = None,
) -> None:
    """MLflow wrapper cost: ``load_model(...).predict`` / ``predict_stream`` vs the raw openai client, same engine."""
    from benchmarks.mlflow_bench import run_mlflow_bench

    out_dir = _out_dir(out, f"mlflow-{upstream if upstream in ('stub', 'sglang') else 'url'}-{trace_sink}")
    with ExitStack() as stack:
        if upstream == "stub":
            url, _ = stack.enter_context(processes.fake_upstream(stub_kind, out_dir))
            label = f"stub-{stub_kind}"
        elif upstream == "sglang":
            console.print("starting the SGLang CPU engine (tiny model; 30-60 s)")
            url, _ = stack.enter_context(processes.sglang_engine(out_dir))
            label = "sglang"
        else:
            url, label = upstream.rstrip("/"), "url"
        result = run_mlflow_bench(
            url,
            [f.strip() for f in flavors.split(",") if f.strip()],
            requests,
            rounds,
            output_tokens,
            out_dir,
            console,
            trace_sink=trace_sink,
        )
    result.update(
        {
            "title": f"MLflow wrapper vs raw openai ({label})",
            "kind": "mlflow",
            "upstream": label,
            "machine": machine_info(),
        }
    )
    (out_dir / "result.json").write_text(json.dumps(result, indent=2, default=str))
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
    for row in result["rows"]:
        met = row.get("met")
        table.add_row(
            row["flavor"],
            row["mode"],
            _fmt(row["raw_p50_ms"], 2),
            _fmt(row["wrapper_p50_ms"], 2),
            _fmt(row["added_p50_ms"], 2),
            _fmt(row["raw_p99_ms"], 2),
            _fmt(row["wrapper_p99_ms"], 2),
            _fmt(row["added_p99_ms"], 2),
            _fmt(row["added_ttft_p50_ms"], 2),
            f"{_fmt(row['added_caller_cpu_ms'], 2)} / {_fmt(row['added_process_cpu_ms'], 2)}",
            {True: "[green]met[/]", False: "[red]MISSED[/]", None: "-"}[met],
        )
    out_console.print(table)
    console.print(f"results: {out_dir / 'result.json'}")


@app.command("clients")
def clients_command(
    stub_kind: Annotated[str, typer.Option(help="Fake upstream implementation: starlette | raw.")] = "raw",
    concurrency: Annotated[int, typer.Option("--concurrency", "-c")] = 16,
    requests: Annotated[int, typer.Option("--requests", "-n")] = 1000,
    output_tokens: OutputTokens = 16,
    out: Out = None,
) -> None:
    """CPU per streamed request of candidate upstream clients (aiohttp as the gateway uses it, httpx as it did, raw asyncio)."""
    from benchmarks.clients import measure

    out_dir = _out_dir(out, "clients")
    with processes.fake_upstream(stub_kind, out_dir) as (url, _):
        rows = measure(url, concurrency, requests, output_tokens)
    table = Table(
        title=f"upstream client CPU per streamed request (c={concurrency}, {output_tokens} tokens, fake upstream {stub_kind})"
    )
    for column in ("client", "round", "CPU ms/req", "wall s"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["client"], str(row["round"]), f"{row['cpu_ms_per_req']:.3f}", f"{row['wall_s']:.2f}")
    out_console.print(table)
    (out_dir / "result.json").write_text(
        json.dumps(
            {
                "kind": "clients",
                "machine": machine_info(),
                "concurrency": concurrency,
                "requests": requests,
                "output_tokens": output_tokens,
                "rows": rows,
            },
            indent=2,
        )
    )
    console.print(f"results: {out_dir / 'result.json'}")


def main() -> None:
    from loguru import logger

    logger.remove()  # loguru's default handler prints every engine log line (DEBUG): costly in the load generator
    logger.add(
        sys.stderr, level=os.environ.get("BENCH_LOG_LEVEL", "INFO"), format="{time:HH:mm:ss} | {level: <7} | {message}"
    )
    app()


if __name__ == "__main__":
    sys.exit(main())
