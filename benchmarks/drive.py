"""Driving load: every concurrency level against every target, rounds alternating, CPU of each process counted.

The commands of ``benchmarks.cli`` start the processes; this module sends the requests and pools what came
back into per-level summaries (``benchmarks.stats``); ``benchmarks.report`` prints and saves them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console

from benchmarks import processes
from benchmarks.loadgen import BatchResult, Workload, new_event_loop, run_batch
from benchmarks.progress import progress_bar
from benchmarks.stats import compare, summarize


class BatchHooks(Protocol):
    """What a command does around each batch: put a target in place (e.g. reload the gateway's YAML) before it,
    record what the servers counted (requests per engine, CPU of processes that come and go) after it."""

    def before(self, target: str) -> None: ...

    def after(self, target: str, batch: BatchResult) -> None: ...


def drive(
    targets: dict[str, str | Sequence[str]],
    workload: Workload,
    levels: list[int],
    requests: int,
    console: Console,
    *,
    rounds: int = 1,
    warmup: int = 0,
    max_seconds: float = 60.0,
    between_levels: Callable[[int], None] | None = None,
    headers: dict[str, str] | None = None,
    target_headers: dict[str, dict[str, str]] | None = None,
    cpu_groups: dict[str, dict[str, int | Callable[[], float]]] | None = None,
    quickack: bool = False,
    hooks: BatchHooks | None = None,
    references: dict[str, str] | None = None,
) -> dict[str, dict[str, Any]]:
    """Run every level against every target; with several targets, batches alternate (ABBA order per round).

    A target is a base URL, or several that its requests are spread over (round robin, see ``run_batch``).
    ``headers``: sent with every request; ``target_headers``: per target, sent instead (a key only one target needs).
    ``cpu_groups``: per target, the process groups whose CPU time each of its batches is charged with (or, for a
    server whose processes are not one group, a function giving its CPU seconds so far).
    ``quickack``: the client acknowledges every read at once (see ``benchmarks.loadgen.Connection``).
    ``hooks``: called before every batch (warm-up too) and after every measured one.
    ``references``: per target, another target it is also measured against (``vs_reference``; e.g. the keyed
    gateway as a shared replica against the keyed gateway alone).
    """
    loop = new_event_loop()
    names = list(targets)
    per_round = max(1, -(-requests // rounds))
    tag = f"{workload.api:<9}"
    out: dict[str, dict[str, Any]] = {}

    def batch_of(name: str, concurrency: int, count: int, task: Any) -> BatchResult:
        """One batch of ``count`` requests against target ``name``."""
        return loop.run_until_complete(
            run_batch(
                targets[name],
                workload,
                concurrency,
                count,
                target=name,
                max_seconds=max_seconds,
                on_done=lambda: progress.advance(task),
                headers=(target_headers or {}).get(name, headers),
                quickack=quickack,
            )
        )

    try:
        with progress_bar(console) as progress:
            for level in levels:
                batches: dict[str, list[BatchResult]] = {name: [] for name in names}
                if warmup:
                    task = progress.add_task(f"{tag} c={level:<4} warm-up", total=warmup * len(names))
                    for name in names:
                        if hooks is not None:
                            hooks.before(name)
                        batch_of(name, min(level, warmup), warmup, task)
                    progress.remove_task(task)
                task = progress.add_task(
                    f"{tag} c={level:<4} {' vs '.join(names)}", total=per_round * rounds * len(names)
                )
                for r in range(rounds):
                    order = names if r % 2 == 0 else names[::-1]
                    for name in order:
                        progress.update(task, description=f"{tag} c={level:<4} round {r + 1}/{rounds} {name:<8}")
                        if hooks is not None:
                            hooks.before(name)  # before the CPU snapshot: a reload is not the batch's cost
                        groups = (cpu_groups or {}).get(name, {})
                        before = {label: _cpu_s(source) for label, source in groups.items()}
                        client_before = time.process_time()
                        batch = batch_of(name, level, per_round, task)
                        batch.cpu_s = {
                            label: _cpu_s(source) - before[label] for label, source in groups.items()
                        }
                        batch.cpu_s["client"] = time.process_time() - client_before
                        if hooks is not None:
                            hooks.after(name, batch)
                        batches[name].append(batch)
                out[str(level)] = _level_entry(names, batches, references)
                if between_levels is not None:
                    between_levels(level)
    finally:
        loop.close()
    return out


def _cpu_s(source: int | Callable[[], float]) -> float:
    """CPU seconds so far of a process group (its id) or of what ``source()`` counts."""
    return source() if callable(source) else processes.group_cpu_s(source)


def _versus(direct: list[BatchResult], other: list[BatchResult]) -> dict[str, Any]:
    """other/direct (or other/any baseline) per figure, with the median of per-round req/s ratios."""
    vs = compare(summarize(direct), summarize(other))
    # rounds run back to back (ABBA): the median of per-round ratios resists load spikes on a shared machine
    pairs = [
        o.samples and d.samples and (len(o.samples) / o.wall_s) / (len(d.samples) / d.wall_s)
        for d, o in zip(direct, other, strict=True)
        if d.wall_s and o.wall_s
    ]
    vs["req_s"]["paired_median_ratio"] = float(statistics.median(pairs)) if pairs else None
    return vs


def _level_entry(
    names: list[str], batches: dict[str, list[BatchResult]], references: dict[str, str] | None = None
) -> dict[str, Any]:
    """Summaries per target, ratios of every other target against ``direct`` (``vs``: the gateway's, when the
    targets are direct and gateway), of every other gateway against the plain ``gateway`` (``vs_gateway``: what
    its settings cost) and of each target of ``references`` against its reference (``vs_reference``, and which
    reference in ``references``), and each round's req/s."""
    entry: dict[str, Any] = {name: summarize(batches[name]) for name in names}
    if "direct" in entry and len(names) > 1:
        entry["vs_direct"] = {name: _versus(batches["direct"], batches[name]) for name in names if name != "direct"}
        if "gateway" in entry:
            entry["vs"] = entry["vs_direct"]["gateway"]
    others = [name for name in names if name not in ("direct", "gateway")]
    if "gateway" in entry and others:
        entry["vs_gateway"] = {name: _versus(batches["gateway"], batches[name]) for name in others}
    paired = {name: reference for name, reference in (references or {}).items() if name in entry and reference in entry}
    if paired:
        entry["vs_reference"] = {name: _versus(batches[reference], batches[name]) for name, reference in paired.items()}
        entry["references"] = paired
    entry["rounds"] = {
        name: [round(len([s for s in b.samples if s.ok]) / b.wall_s, 1) if b.wall_s else 0 for b in batches[name]]
        for name in names
    }
    return entry


def profile_gateway(
    url: str,
    pid: int,
    workload: Workload,
    concurrency: int,
    requests: int,
    max_seconds: float,
    out_dir: Path,
    console: Console,
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    """py-spy on the gateway during an extra gateway-only load; the load's summary and the profile's shares.
    ``headers``: sent with every request (a keyed gateway's key)."""
    from benchmarks.profile import analyse

    console.print(f"profiling the gateway (pid {pid}) with py-spy at concurrency {concurrency}")
    profiler = processes.Profiler(pid, out_dir / "profile")
    loop = new_event_loop()
    try:
        with progress_bar(console) as progress:
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
                    headers=headers,
                )
            )
    finally:
        loop.close()
        profiler.stop()
    report: dict[str, Any] = {"load": summarize([batch]), "svg": str(profiler.svg), "raw": str(profiler.raw)}
    if profiler.raw.exists():
        report.update(analyse(profiler.raw))
    return report
