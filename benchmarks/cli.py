"""``python -m benchmarks``: load runs against a URL, gateway-vs-direct side by side, MLflow wrapper cost.

The commands start and stop the processes and wire the parts: ``benchmarks.drive`` sends the load,
``benchmarks.report`` prints and saves what it measured. Every run is bounded (a request count per level and
a wall-clock cap per batch) and stops every process it started. Results go to
``benchmarks/results/<time>-<name>/`` as ``result.json`` and one ``plot-<api>.png`` per API.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import typer

from benchmarks import processes, report
from benchmarks import tenants as tenant_rig
from benchmarks.apis import APIS, parse_apis
from benchmarks.drive import drive, profile_gateway
from benchmarks.loadgen import Workload
from benchmarks.postgres import postgres_missing, running_postgres
from benchmarks.processes import BASELINE, ROUTER_TARGET
from benchmarks.report import console
from benchmarks.stats import (
    evaluate_shared_targets,
    evaluate_targets,
    evaluate_tenant_targets,
    evaluate_tracing_targets,
)
from benchmarks.tenants import KEYED, SHARED, TWIN
from benchmarks.tracing import TRACED, OTLPSink, traced_settings

app = typer.Typer(
    name="benchmarks",
    help="Benchmarks of sglang-gateway: load runs, gateway vs direct side by side, MLflow wrapper cost.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
RESULTS = Path(__file__).resolve().parent / "results"

Levels = Annotated[str, typer.Option("--concurrency", "-c", help="Comma-separated concurrency levels.")]
Requests = Annotated[
    int, typer.Option("--requests", "-n", help="Requests per target per level (split over the rounds).")
]
Stream = Annotated[bool, typer.Option("--stream/--no-stream", help="Streaming (SSE) answers or plain JSON.")]
ApiNames = Annotated[
    str,
    typer.Option(
        "--api",
        help=f"Comma-separated APIs, measured one after the other: {', '.join(APIS)} "
        "(POST /v1/chat/completions, /v1/responses, /v1/messages).",
    ),
]
PromptTokens = Annotated[int, typer.Option("--prompt-tokens", help="Approximate prompt length in tokens.")]
OutputTokens = Annotated[
    int,
    typer.Option("--output-tokens", help="max_tokens / max_output_tokens (chat also sends ignore_eos: exact length)."),
]
MaxSeconds = Annotated[
    float, typer.Option("--max-seconds", help="Wall-clock cap of one batch (stops issuing requests).")
]
Out = Annotated[
    Path | None, typer.Option("--out", help="Results directory (default: benchmarks/results/<time>-<name>).")
]


def _baseline_env(env: dict[str, str], baseline: Path | None) -> dict[str, str] | None:
    """The gateway environment ``env`` for ``--baseline`` (None without it); a bad path is refused before anything starts."""
    if baseline is None:
        return None
    try:
        return processes.baseline_env(env, baseline)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--baseline") from None


Baseline = Annotated[
    Path | None,
    typer.Option(
        help="Also run a gateway from the checkout at this path (its PYTHONPATH), with the same settings, in the "
        "same run: before / after (git worktree add /tmp/before <commit>).",
    ),
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


def _apis(text: str) -> list[str]:
    try:
        return [api.name for api in parse_apis(text)]
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None


def _out_dir(out: Path | None, name: str) -> Path:
    path = out or RESULTS / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _read_store(url: str, into: dict[str, Any]) -> None:
    """``into``: what the shared replica left in the store at ``url`` (an error in its place: the run's figures stay)."""
    try:
        into.update(tenant_rig.store_rows(url))
    except Exception as error:
        into["error"] = f"{type(error).__name__}: {error}"


# ------------------------------------------------------------------------------------ commands
@app.command()
def run(
    url: Annotated[str, typer.Argument(help="Base URL of an OpenAI-compatible server (e.g. http://127.0.0.1:8000).")],
    concurrency: Levels = "1,4,16",
    requests: Requests = 200,
    api: ApiNames = "chat",
    stream: Stream = True,
    prompt_tokens: PromptTokens = 32,
    output_tokens: OutputTokens = 16,
    model: Annotated[str, typer.Option(help="The request's model field.")] = "bench",
    api_key: Annotated[str | None, typer.Option(help="Bearer key to send.", envvar="BENCH_API_KEY")] = None,
    warmup: Annotated[int, typer.Option(help="Warm-up requests per level (not counted).")] = 8,
    max_seconds: MaxSeconds = 60.0,
    out: Out = None,
    plot: Annotated[bool, typer.Option(help="Write plot-<api>.png.")] = True,
) -> None:
    """Drive one target URL with a fixed workload and report each concurrency level."""
    apis = _apis(api)
    levels = _levels(concurrency)
    out_dir = _out_dir(out, "run")
    headers = {"authorization": f"Bearer {api_key}"} if api_key else None
    measured: dict[str, dict[str, Any]] = {}
    for name in apis:
        workload = Workload(
            model=model, stream=stream, prompt_tokens=prompt_tokens, output_tokens=output_tokens, api=name
        )
        by_level = drive(
            {"target": url},
            workload,
            levels,
            requests,
            console,
            warmup=warmup,
            max_seconds=max_seconds,
            headers=headers,
        )
        measured[name] = {"workload": {**workload.__dict__, "path": workload.path}, "levels": by_level}
        report.print_levels(by_level, ["target"], title=f"{name}: per level")
    result = {
        "title": f"load run: {url}",
        "kind": "run",
        "url": url,
        "machine": report.machine_info(),
        "requests_per_level": requests,
        "targets_measured": ["target"],
        "apis": measured,
    }
    report.save(result, out_dir, plot)


@app.command("compare")
def compare_command(
    upstream: Annotated[
        str,
        typer.Option(
            help="stub (fake upstream, own process) | sglang (real CPU engine, tiny model) | sglang-default (real CPU "
            "engine, the default model SmolLM2-135M-Instruct) | a URL of a running engine."
        ),
    ] = "stub",
    stub_kind: Annotated[str, typer.Option(help="Fake upstream implementation: starlette | raw.")] = "starlette",
    concurrency: Levels = "1,16,64,256",
    requests: Requests = 1200,
    rounds: Annotated[int, typer.Option(help="Alternating direct/gateway rounds per level.")] = 4,
    api: ApiNames = "chat",
    stream: Stream = True,
    prompt_tokens: PromptTokens = 32,
    output_tokens: OutputTokens = 16,
    warmup: Annotated[int, typer.Option(help="Warm-up requests per target per level.")] = 16,
    max_seconds: MaxSeconds = 60.0,
    profile: Annotated[
        bool, typer.Option(help="Profile the gateway (with --tenants, the keyed one) with py-spy during an extra load (first API).")
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
    router: Annotated[
        bool,
        typer.Option(
            "--router/--no-router",
            help="Put SGLang's router (sglang-router) in front of the upstream: direct = client -> router, "
            "gateway = client -> gateway -> router.",
        ),
    ] = False,
    router_target: Annotated[
        bool,
        typer.Option(
            "--router-target/--no-router-target",
            help="Also measure SGLang's router (sglang-router) as a target of its own, client -> router -> upstream, "
            "beside the gateway: the reference proxy's ratios to direct on the same machine in the same run.",
        ),
    ] = False,
    quickack: Annotated[
        bool,
        typer.Option(
            "--quickack/--no-quickack",
            help="The load generator acknowledges every read at once (TCP_QUICKACK): a client that never "
            "stalls a server without TCP_NODELAY (the router) on its delayed ACKs.",
        ),
    ] = False,
    tenants: Annotated[
        bool,
        typer.Option(
            "--tenants/--no-tenants",
            help="Also run a gateway with one named key (limits that never bite) and the usage ledger (SQLite in the "
            "results directory), the load sending that key: keys+ledger vs the plain gateway (ledger off) in one run; "
            "and a twin of the plain gateway (an A/A control: the run's noise).",
        ),
    ] = False,
    shared: Annotated[
        bool,
        typer.Option(
            "--shared/--no-shared",
            help="With --tenants: also run the keyed gateway as a replica sharing a store (gateway.replicas.shared, its "
            "ledger and shared state in a PostgreSQL server this run starts), measured against the keyed gateway alone "
            "in the same rounds; every gateway of the run is one process (workers: 1), as a shared replica is.",
        ),
    ] = False,
    tracing: Annotated[
        bool,
        typer.Option(
            "--tracing/--no-tracing",
            help="Also run a gateway with gateway.tracing on (every request sampled, OTLP/HTTP to a sink in this "
            "process): traced vs the plain gateway in one run.",
        ),
    ] = False,
    baseline: Baseline = None,
    out: Out = None,
    plot: Annotated[bool, typer.Option(help="Write plot-<api>.png.")] = True,
) -> None:
    """The same workload against the upstream directly and through the gateway, alternating, with ratios."""
    env = dict(item.split("=", 1) for item in gateway_env or [])
    base_env = _baseline_env(env, baseline)
    if router and router_target:
        raise typer.BadParameter("--router puts the router in front of the upstream; --router-target measures it beside the gateway: pick one", param_hint="--router-target")
    if shared and not tenants:
        raise typer.BadParameter("--shared measures the keyed gateway of --tenants as a replica sharing a store: add --tenants", param_hint="--shared")
    if shared and (why := postgres_missing()) is not None:
        raise typer.BadParameter(f"no PostgreSQL server can run here: {why}", param_hint="--shared")
    levels_list = _levels(concurrency)
    workloads = [
        Workload(
            stream=stream,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            timeout_s=max(60.0, max_seconds),
            api=name,
        )
        for name in _apis(api)
    ]
    out_dir = _out_dir(out, f"compare-{upstream if upstream == 'stub' or upstream in processes.ENGINES else 'url'}")
    info = report.machine_info()
    upstream_label = f"stub-{stub_kind}" if upstream == "stub" else upstream
    measured: dict[str, dict[str, Any]] = {}
    profile_report = None
    stored: dict[str, Any] = {}  # --shared: what the replica left in the store
    with ExitStack() as stack:
        if upstream == "stub":
            console.print(f"starting the fake upstream ({stub_kind})")
            direct_url, upstream_proc = stack.enter_context(processes.fake_upstream(stub_kind, out_dir))
        elif upstream in processes.ENGINES:
            console.print(f"starting the SGLang CPU engine ({processes.ENGINES[upstream][2]})")
            t = time.monotonic()
            direct_url, upstream_proc = stack.enter_context(processes.sglang_engine(out_dir, upstream))
            console.print(f"engine ready at {direct_url} after {time.monotonic() - t:.0f}s")
        else:
            direct_url, upstream_proc = upstream.rstrip("/"), None
            upstream_label = label or "url"
        router_proc = None
        if router:
            direct_url, router_proc = stack.enter_context(processes.router([direct_url], out_dir))
            upstream_label = f"router({upstream_label})"
            console.print(f"sglang-router at {direct_url} (pid {router_proc.pid}) in front of the upstream")
        plain = tenant_rig.plain_settings(out_dir) if tenants else None
        if shared:  # a shared replica is one process: so is every gateway it is compared with
            plain = tenant_rig.one_process(plain or {})
        gateway_url, gateway_child = stack.enter_context(processes.gateway(direct_url, out_dir, env, plain))
        console.print(
            f"direct: {direct_url}   gateway: {gateway_url} (pid {gateway_child.pid}, {' '.join(gateway_child.argv)})"
        )
        urls = {"direct": direct_url, "gateway": gateway_url}
        groups: dict[str, dict[str, int | Callable[[], float]]] = {"direct": {}, "gateway": {"gateway": gateway_child.pid}}
        sink = None
        if tracing:  # its own config and log next to the plain gateway's
            sink = stack.enter_context(OTLPSink())
            traced_url, traced_child = stack.enter_context(
                processes.gateway(direct_url, out_dir / TRACED, env, traced_settings(sink.url, out_dir))
            )
            console.print(f"{TRACED}: {traced_url} (pid {traced_child.pid}; spans to {sink.url})")
            urls[TRACED], groups[TRACED] = traced_url, {"gateway": traced_child.pid}
        if tenants:  # its own config and log next to the plain gateway's
            keyed = tenant_rig.keyed_settings(out_dir)
            keyed_url, keyed_child = stack.enter_context(
                processes.gateway(direct_url, out_dir / KEYED, env, tenant_rig.one_process(keyed) if shared else keyed)
            )
            console.print(f"{KEYED}: {keyed_url} (pid {keyed_child.pid}; a named key, the ledger in {out_dir})")
            urls[KEYED], groups[KEYED] = keyed_url, {"gateway": keyed_child.pid}
        if shared:  # right after the keyed gateway: its batches next to that gateway's in every round
            console.print("starting PostgreSQL (the shared store)")
            store = stack.enter_context(running_postgres())
            store_pid = store.postmaster_pid()
            stack.callback(_read_store, store.url, stored)  # once the replica stopped (it flushes its ledger), before the store does
            shared_url, shared_child = stack.enter_context(
                processes.gateway(direct_url, out_dir / SHARED, env, tenant_rig.shared_settings(out_dir, store.url))
            )
            console.print(f"{SHARED}: {shared_url} (pid {shared_child.pid}; the keyed gateway sharing PostgreSQL pid {store_pid}, {store.root})")
            urls[SHARED], groups[SHARED] = shared_url, {"gateway": shared_child.pid}
            if store_pid is not None:  # its backends are sessions of their own: the postmaster and its children
                groups[SHARED]["postgres"] = partial(processes.server_tree_cpu_s, store_pid)
        if tenants:  # the plain gateway's twin, settings and all
            twin = tenant_rig.twin_settings(out_dir)
            twin_url, twin_child = stack.enter_context(
                processes.gateway(direct_url, out_dir / TWIN, env, tenant_rig.one_process(twin) if shared else twin)
            )
            console.print(f"{TWIN}: {twin_url} (pid {twin_child.pid}; the plain gateway's twin: the run's noise)")
            urls[TWIN], groups[TWIN] = twin_url, {"gateway": twin_child.pid}
        if base_env is not None:  # the same gateway settings, another checkout's code
            base_url, base_child = stack.enter_context(processes.gateway(direct_url, out_dir / BASELINE, base_env, plain))
            console.print(f"{BASELINE}: {base_url} (pid {base_child.pid}; the code of {baseline})")
            urls[BASELINE], groups[BASELINE] = base_url, {"gateway": base_child.pid}
        if router_target:  # the reference proxy in front of the same upstream, measured like the gateway
            reference_url, reference_child = stack.enter_context(processes.router([direct_url], out_dir))
            console.print(f"{ROUTER_TARGET}: {reference_url} (pid {reference_child.pid}; SGLang's router, the reference)")
            urls[ROUTER_TARGET], groups[ROUTER_TARGET] = reference_url, {"router": reference_child.pid}
        for name in urls:
            if upstream_proc is not None:
                groups[name]["upstream"] = upstream_proc.pid
            if router_proc is not None:
                groups[name]["router"] = router_proc.pid
        for workload in workloads:
            levels = drive(
                urls,
                workload,
                levels_list,
                requests,
                console,
                rounds=rounds,
                warmup=warmup,
                max_seconds=max_seconds,
                target_headers={KEYED: tenant_rig.headers(), SHARED: tenant_rig.headers()} if tenants else None,
                cpu_groups=groups,
                quickack=quickack,
                references={SHARED: KEYED} if shared else None,
            )
            by_level = {int(k): v for k, v in levels.items()}
            measured[workload.api] = {
                "workload": {**workload.__dict__, "path": workload.path},
                "levels": levels,
                "targets": evaluate_targets(upstream_label, by_level)
                + (evaluate_tenant_targets(by_level) if tenants else [])
                + (evaluate_shared_targets(by_level, workload.api) if shared else [])
                + (evaluate_tracing_targets(by_level) if tracing else []),
            }
            (out_dir / "levels.json").write_text(
                json.dumps(measured, indent=2, default=str)
            )  # kept if a later step fails
        if profile:  # with --tenants, the keyed gateway: the run is about its cost
            try:
                profiled_url, profiled_pid = (keyed_url, keyed_child.pid) if tenants else (gateway_url, gateway_child.pid)
                profile_report = profile_gateway(
                    profiled_url,
                    profiled_pid,
                    workloads[0],
                    profile_concurrency,
                    profile_requests,
                    max_seconds,
                    out_dir,
                    console,
                    headers=tenant_rig.headers() if tenants else None,
                )
            except Exception as error:  # a missing or refused profiler must not lose the measurements
                console.print(f"[red]profiling failed:[/] {error}")
                profile_report = {"error": str(error)}
    summary = report.api_summary_rows(measured)
    targets = [
        "direct", "gateway", *([TRACED] if tracing else []), *([KEYED] if tenants else []), *([SHARED] if shared else []),
        *([TWIN] if tenants else []), *([BASELINE] if baseline else []),
        *([ROUTER_TARGET] if router_target else []),
    ]  # fmt: skip
    result = {
        "title": f"gateway vs direct ({upstream_label})" + (", keys+ledger vs plain gateway" if tenants else "")
        + (", shared replica vs keys+ledger" if shared else ""),
        "kind": "compare",
        "upstream": upstream_label,
        "machine": info,
        "requests_per_level": requests,
        "rounds": rounds,
        "targets_measured": targets,
        "apis": measured,
        "summary": summary,
        "profile": profile_report,
        "gateway_env": env,
        "client_quickack": quickack,
    }
    if sink is not None:  # read once the traced gateway stopped (it exports what is queued on SIGTERM)
        result["tracing"] = {"summary": report.tenant_summary_rows(measured, TRACED), "spans_exported": sink.span_count()}
    if baseline is not None:
        result["baseline"] = {"checkout": str(baseline), "summary": report.tenant_summary_rows(measured, BASELINE)}
    if router_target:
        result["router_target"] = {"summary": report.router_summary_rows(measured, ROUTER_TARGET)}
    if tenants:  # read once the keyed gateway stopped (it writes its last rows on SIGTERM)
        result["tenants"] = {"summary": report.tenant_summary_rows(measured, KEYED), "ledger_rows": tenant_rig.ledger_rows(out_dir)}
    if shared:
        result["shared"] = {"summary": report.shared_summary_rows(measured, SHARED, KEYED), **stored}
    for name, entry in measured.items():
        report.print_levels(entry["levels"], targets, title=f"{name}: per level")
        report.print_targets(entry["targets"], title=f"{name}: targets")
    report.print_api_summary(summary)
    if sink is not None:
        report.print_tenant_summary(result["tracing"]["summary"], "traced / plain gateway per API", "traced CPU ms/req")
        console.print(f"spans exported ({TRACED}, by name): {result['tracing']['spans_exported']}")
    if baseline is not None:
        report.print_tenant_summary(result["baseline"]["summary"], f"{BASELINE} ({baseline}) / this gateway per API", "baseline CPU ms/req")
    if router_target:
        report.print_router_summary(result["router_target"]["summary"])
    if tenants:
        report.print_tenant_summary(result["tenants"]["summary"])
        console.print(f"usage ledger rows ({KEYED}, by key:status): {result['tenants']['ledger_rows']}")
    if shared:
        report.print_shared_summary(result["shared"]["summary"])
        console.print(f"in the shared store ({SHARED}): {stored}")
    if profile_report and "error" not in profile_report:
        report.print_profile(profile_report)
    report.save(result, out_dir, plot)


@app.command("paced")
def paced_command(
    streams: Annotated[str, typer.Option("--streams", "-s", help="Comma-separated counts of concurrent streams.")] = "256,1024,2048",
    tokens: Annotated[int, typer.Option(help="Tokens (events) per stream.")] = 100,
    step_ms: Annotated[float, typer.Option(help="Decode step of the fake: one event to each running stream per step.")] = 20.0,
    ramp_s: Annotated[float, typer.Option(help="The streams start evenly over this many seconds.")] = 1.0,
    api: Annotated[str, typer.Option(help="chat | responses | messages.")] = "chat",
    targets: Annotated[
        str, typer.Option(help="Comma-separated: direct, gateway (1 worker), gateway-wN (N worker processes), router (sglang_router).")
    ] = "direct,gateway,router",
    gateway_env: Annotated[list[str] | None, typer.Option("--gateway-env", help="KEY=VALUE for the gateway process.")] = None,
    gateway_setting: Annotated[
        list[str] | None, typer.Option("--gateway-setting", help="NAME=VALUE gateway setting (dotted, e.g. http.max_connections=8192).")
    ] = None,
    timeout_s: Annotated[float, typer.Option(help="Wall-clock cap of one run.")] = 120.0,
    profile: Annotated[int | None, typer.Option(help="py-spy on the gateway during one more run of this many streams.")] = None,
    baseline: Baseline = None,
    out: Out = None,
) -> None:
    """Long streams fed one event per decode step, as a GPU engine at high batch sends them: direct vs gateway vs router."""
    from benchmarks import paced_cli

    names = [name.strip() for name in targets.split(",") if name.strip()]
    unknown = sorted(name for name in set(names) - {"direct", "router"} if paced_cli.gateway_workers(name) is None)
    if unknown or not names:
        raise typer.BadParameter(f"unknown target {', '.join(unknown) or repr(targets)} (choose from direct, gateway, gateway-wN, router)")
    try:
        settings = paced_cli.parse_settings(gateway_setting)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    _apis(api)
    env = dict(item.split("=", 1) for item in gateway_env or [])
    base_env = _baseline_env(env, baseline)
    out_dir = _out_dir(out, "paced")
    result = paced_cli.paced_run(
        _levels(streams), api=api, tokens=tokens, step_ms=step_ms, ramp_s=ramp_s, targets=names, gateway_env=env,
        gateway_settings=settings, timeout_s=timeout_s, out_dir=out_dir, profile_streams=profile, baseline_env=base_env,
    )  # fmt: skip
    paced_cli.save({"kind": "paced", "api": api, "tokens": tokens, "step_ms": step_ms, "ramp_s": ramp_s, "gateway_settings": settings, **result}, out_dir)


@app.command("costs")
def costs_command(
    streams: Annotated[str, typer.Option("--streams", "-s", help="Comma-separated counts of paced streams at once.")] = "16,1024",
    tokens: Annotated[int, typer.Option(help="Events of each paced stream (the sparse one too).")] = 100,
    step_ms: Annotated[float, typer.Option(help="The paced fake's decode step: one event per stream per step.")] = 50.0,
    idle_s: Annotated[float, typer.Option(help="Seconds of idle measured per target per round.")] = 5.0,
    rounds: Annotated[int, typer.Option(help="Rounds over the paced figures (targets alternating).")] = 3,
    concurrency: Levels = "1,64",
    # (the old 2,400 over 4 rounds: 600 requests, ~0.5 s at c=1, a round; the figure moved by a quarter between runs of the same code)
    requests: Requests = 12000,
    short_rounds: Annotated[int, typer.Option(help="Alternating rounds of the short requests per level.")] = 8,
    sdk_headers: Annotated[bool, typer.Option(help="Send the OpenAI Python SDK's 17 headers with each short request (else 4).")] = False,
    agent: Annotated[bool, typer.Option(help="Short requests as an agent loop sends them: 8 tools, 16 messages of calls and results.")] = False,
    plain: Annotated[bool, typer.Option(help="Short requests unstreamed (the answer whole, as a plain chat call).")] = False,
    short_only: Annotated[bool, typer.Option(help="Only the short requests' figures (no paced streams, no idle).")] = False,
    floor: Annotated[bool, typer.Option(help="The short requests through the least a Python proxy on uvloop and httptools costs too.")] = False,
    baseline: Baseline = None,
    out: Out = None,
) -> None:
    """The gateway's costs as ratios to SGLang's router, one run: CPU per event (one sparse stream, many streams),
    per short request, per idle second, and the main loop's wake-ups per event."""
    from benchmarks.costs import run_costs

    if sglang_router_missing():
        raise typer.BadParameter("costs measures against SGLang's router: pip install sglang-router")
    base_env = _baseline_env({}, baseline)
    run_costs(
        _out_dir(out, "costs"), streams=_levels(streams), tokens=tokens, step_ms=step_ms, idle_s=idle_s, rounds=rounds,
        levels=_levels(concurrency), requests=requests, short_rounds=short_rounds, baseline_env=base_env, sdk_headers=sdk_headers,
        agent=agent, plain=plain, short_only=short_only, floor=floor,
    )  # fmt: skip


def sglang_router_missing() -> bool:
    from importlib.util import find_spec

    return find_spec("sglang_router") is None


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
            "machine": report.machine_info(),
        }
    )
    report.save(result, out_dir, plot=False)
    report.print_mlflow(result["rows"], trace_sink)


@app.command("mlflow-serving")
def mlflow_serving_command(
    stub_kind: Annotated[str, typer.Option(help="Fake upstream implementation: starlette | raw.")] = "starlette",
    workers: Annotated[int, typer.Option("--workers", "-w", help="mlflow models serve -w N.")] = 2,
    concurrency: Annotated[int, typer.Option("--concurrency", "-c", help="Clients at once.")] = 2,
    requests: Annotated[int, typer.Option("--requests", "-n", help="Measured requests per server and route.")] = 40,
    output_tokens: OutputTokens = 256,
    out: Out = None,
) -> None:
    """Serving throughput of a logged model: ``mlflow models serve -w N`` vs ``sglang-gateway serve --model-uri``
    (``/invocations`` and the OpenAI route), fake upstream: tokens/s and server CPU per token."""
    from benchmarks.serving_bench import run_serving_bench

    out_dir = _out_dir(out, "mlflow-serving")
    with processes.fake_upstream(stub_kind, out_dir) as (url, _):
        result = run_serving_bench(url, workers, concurrency, requests, output_tokens, out_dir, console)
    result.update({"title": f"MLflow serving throughput (stub-{stub_kind})", "kind": "mlflow-serving", "machine": report.machine_info()})
    (out_dir / "result.json").write_text(json.dumps(result, indent=2))
    for row in result["rows"]:
        console.print(
            f"{row['server']:34} {row['route']:32} {row['tokens_per_s']:9.0f} tokens/s  "
            f"{row['cpu_us_per_token']:7.1f} µs CPU/token  ({row['requests']} requests, {row['tokens']} tokens)"
        )


@app.command("affinity")
def affinity_command(
    replicas: Annotated[int, typer.Option(help="Engines behind the model (replicas: N of the tiny CPU engine).")] = 2,
    prompts: Annotated[int, typer.Option(help="Distinct long system prompts (K).")] = 8,
    per_prompt: Annotated[int, typer.Option(help="User messages per system prompt (M).")] = 8,
    system_words: Annotated[int, typer.Option(help="Words of each system prompt (100: ~330 tokens here).")] = 100,
    output_tokens: OutputTokens = 8,
    concurrency: Annotated[int, typer.Option("--concurrency", "-c", help="Requests in flight.")] = 2,
    rounds: Annotated[int, typer.Option(help="Batches per policy, alternating (ABBA).")] = 2,
    max_total_tokens: Annotated[
        int, typer.Option(help="KV cache of each replica in tokens: room for most, not all, of the prompts' prefixes.")
    ] = 2048,
    max_imbalance: Annotated[int, typer.Option(help="gateway.balancing.max_imbalance under prefix_affinity.")] = 4,
    out: Out = None,
) -> None:
    """Prefix affinity on vs off: SGLang's cached prompt tokens, TTFT and latency over replicas, in one run."""
    from benchmarks.affinity import AffinityWorkload, measure_affinity
    from benchmarks.replica_rig import replica_gateway, tiny_deployment

    if min(replicas, prompts, per_prompt, system_words, concurrency, rounds) < 1:
        raise typer.BadParameter("replicas, prompts, per-prompt, system-words, concurrency and rounds must be >= 1")
    workload = AffinityWorkload(prompts, per_prompt, system_words, output_tokens)
    out_dir = _out_dir(out, "affinity")
    deployment, _ = tiny_deployment(out_dir, replicas, max_total_tokens, max_imbalance)
    info = report.machine_info()
    with replica_gateway(deployment, out_dir, console) as rig:
        measured = measure_affinity(rig, workload, concurrency, rounds, console)
    result = {
        "title": f"prefix affinity over {replicas} replicas (tiny CPU engine)",
        "kind": "affinity",
        "machine": info,
        "workload": {**workload.__dict__, "concurrency": concurrency, "rounds": rounds},
        "engines": {"replicas": replicas, "max_total_tokens": max_total_tokens, "max_imbalance": max_imbalance},
        **measured,
    }
    report.print_affinity(measured["policies"], measured["ratios"])
    report.save(result, out_dir, plot=False)


@app.command("cluster")
def cluster_command(
    concurrency: Levels = "1,8",
    requests: Requests = 400,
    rounds: Annotated[int, typer.Option(help="Alternating rounds over the three targets per level (ABBA).")] = 4,
    prompt_tokens: PromptTokens = 32,
    output_tokens: OutputTokens = 16,
    warmup: Annotated[int, typer.Option(help="Warm-up requests per target per level.")] = 8,
    max_seconds: MaxSeconds = 120.0,
    replicas: Annotated[int, typer.Option(help="Engines behind the model (replicas: N of the tiny CPU engine).")] = 2,
    out: Out = None,
) -> None:
    """The same replicas three ways: direct (client round robin), gateway -> replicas, gateway -> router -> replicas."""
    from benchmarks.cluster import LABELS, ROUTER_POLICY, measure_cluster, summary_rows
    from benchmarks.replica_rig import MODEL, forget_keys, replica_gateway, tapped_engine_key, tiny_deployment

    levels = _levels(concurrency)
    if min(requests, rounds, replicas) < 1:
        raise typer.BadParameter("requests, rounds and replicas must be >= 1")
    workload = Workload(
        model=MODEL, stream=True, prompt_tokens=prompt_tokens, output_tokens=output_tokens, timeout_s=max_seconds
    )
    out_dir = _out_dir(out, "cluster")
    deployment, keys = tiny_deployment(out_dir, replicas, tap_keys=True)
    info = report.machine_info()
    try:
        with replica_gateway(deployment, out_dir, console) as rig:
            measured = measure_cluster(
                rig, tapped_engine_key(keys), workload, levels, requests, rounds, console,
                warmup=warmup, max_seconds=max_seconds,
            )  # fmt: skip
    finally:
        forget_keys(keys)
    rows = summary_rows(measured["levels"])
    result = {
        "title": f"cluster path over {replicas} replicas (tiny CPU engine): {', '.join(LABELS.values())}",
        "kind": "cluster",
        "machine": info,
        "workload": {**workload.__dict__, "path": workload.path, "rounds": rounds, "requests_per_level": requests},
        "targets": LABELS,
        **measured,
        "summary": rows,
    }
    report.print_cluster(
        rows, f"cluster path, {replicas} replicas, router policy {ROUTER_POLICY} (pooled over {rounds} rounds)"
    )
    report.save(result, out_dir, plot=False)


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
    report.print_clients(
        rows,
        f"upstream client CPU per streamed request (c={concurrency}, {output_tokens} tokens, fake upstream {stub_kind})",
    )
    result = {
        "kind": "clients",
        "machine": report.machine_info(),
        "concurrency": concurrency,
        "requests": requests,
        "output_tokens": output_tokens,
        "rows": rows,
    }
    report.save(result, out_dir, plot=False)


def main() -> None:
    from loguru import logger

    logger.remove()  # loguru's default handler prints every engine log line (DEBUG): costly in the load generator
    logger.add(
        sys.stderr, level=os.environ.get("BENCH_LOG_LEVEL", "INFO"), format="{time:HH:mm:ss} | {level: <7} | {message}"
    )
    app()


if __name__ == "__main__":
    sys.exit(main())
