"""What a gateway costs when little happens: one sparse stream, and no stream at all.

A GPU engine serving one user sends an event every decode step (tens of milliseconds); a gateway that wakes its
event loop on timers of its own (probes, polls, ticks) pays for each of those wake-ups whether events come or not.
This measures, for one stream whose events come ``--step-ms`` apart (the paced fake, :mod:`benchmarks.paced_upstream`)
and for an idle process:

- **wake-ups per event** of the gateway's main thread (the event loop): the thread's voluntary context switches
  (``/proc/<pid>/task/<tid>/status``), one each time it blocks in ``epoll_wait`` and is woken (by an event, a timer,
  a thread); with ``--strace``, also its ``epoll_pwait`` calls (the loop's passes) and ``getpid`` calls (asyncio's
  running-loop check) per event, counted by ``strace -f`` over one more stream (strace slows what it traces: these
  runs are not timed);
- **main-thread CPU per event** (``/proc/<pid>/task/<tid>/schedstat``: nanoseconds on a CPU), raw and net of the
  thread's idle rate over the same time, and the whole process's CPU per event (the native relay thread included);
- **idle CPU per second** of the whole process (every thread's schedstat), over ``--idle-s``.

Targets: this checkout's gateway, ``--baseline <checkout>`` (another commit's, same settings, same run) and, when
``sglang_router`` is installed, SGLang's router in front of the same fake (``--no-router`` leaves it out; it has no
Python event loop: its wake-ups are not counted, its CPU is its whole process's). Rounds alternate the targets.

Run: ``python -m benchmarks.sparse [--baseline <checkout>] [--tokens 200] [--step-ms 50] [--idle-s 10] [--rounds 2]
[--strace]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from benchmarks import processes
from benchmarks.apis import APIS
from benchmarks.loadgen import new_event_loop
from benchmarks.paced import run_paced

REPO = processes.REPO


def thread_cpu_ns(pid: int, tid: int | None = None) -> int:
    """Nanoseconds thread ``tid`` of ``pid`` (its main thread by default) ran on a CPU (0 once it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/task/{tid or pid}/schedstat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def process_cpu_ns(pid: int) -> int:
    """Nanoseconds every live thread of ``pid`` ran on a CPU."""
    try:
        tids = [int(name) for name in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return 0
    return sum(thread_cpu_ns(pid, tid) for tid in tids)


def wakeups(pid: int) -> int:
    """The main thread's voluntary context switches: each a block (in ``epoll_wait``, mostly) that ended in a wake-up."""
    try:
        for line in Path(f"/proc/{pid}/task/{pid}/status").read_text().splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _reading(pid: int) -> tuple[float, int, int, int]:
    return time.monotonic(), thread_cpu_ns(pid), process_cpu_ns(pid), wakeups(pid)


def measure_idle(pid: int, seconds: float) -> dict[str, float]:
    """The process's CPU and its main thread's over ``seconds`` of nothing asked of it."""
    t0, main0, all0, wake0 = _reading(pid)
    time.sleep(seconds)
    t1, main1, all1, wake1 = _reading(pid)
    wall = t1 - t0
    return {
        "idle_ms_per_s": (all1 - all0) / 1e6 / wall,
        "idle_main_ms_per_s": (main1 - main0) / 1e6 / wall,
        "idle_wakeups_per_s": (wake1 - wake0) / wall,
    }


def measure_stream(loop: asyncio.AbstractEventLoop, url: str, pid: int, tokens: int, idle: dict[str, float], timeout_s: float) -> dict[str, Any]:
    """One stream of ``tokens`` events through ``url``: what the process behind it spent per event."""
    t0, main0, all0, wake0 = _reading(pid)
    result = loop.run_until_complete(run_paced(url, APIS["chat"], 1, tokens, 0.0, timeout_s))
    t1, main1, all1, wake1 = _reading(pid)
    events, wall = max(result.events, 1), t1 - t0
    main_us, all_us = (main1 - main0) / 1e3, (all1 - all0) / 1e3
    return {
        "events": result.events,
        "errors": result.errors,
        "wall_s": wall,
        "wakeups_per_event": (wake1 - wake0) / events,
        "main_us_per_event": main_us / events,
        "main_us_per_event_net": (main_us - idle["idle_main_ms_per_s"] * 1e3 * wall) / events,
        "process_us_per_event": all_us / events,
        "process_us_per_event_net": (all_us - idle["idle_ms_per_s"] * 1e3 * wall) / events,
    }


def strace_stream(loop: asyncio.AbstractEventLoop, url: str, pid: int, tokens: int, out: Path, timeout_s: float) -> dict[str, float]:
    """One more stream with ``strace -f`` on the process: the main thread's epoll_pwait / getpid calls per event."""
    trace = out / f"strace-{pid}.txt"
    tracer = subprocess.Popen(
        ["strace", "-f", "-qq", "-e", "trace=epoll_wait,epoll_pwait,getpid", "-o", str(trace), "-p", str(pid)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    time.sleep(1.0)  # attached before the stream starts
    result = loop.run_until_complete(run_paced(url, APIS["chat"], 1, tokens, 0.0, timeout_s))
    os.killpg(tracer.pid, signal.SIGINT)  # (its own session: only strace)
    tracer.wait(30)
    polls = pids = 0
    for line in trace.read_text(errors="replace").splitlines():
        thread, _, call = line.partition(" ")
        if thread.strip() != str(pid):
            continue
        call = call.lstrip()
        if call.startswith("epoll_pwait(") or call.startswith("epoll_wait("):
            polls += 1
        elif call.startswith("getpid("):
            pids += 1
    events = max(result.events, 1)
    return {"epoll_per_event": polls / events, "getpid_per_event": pids / events}


_LOOP_ONLY = ("wakeups_per_event", "main_us_per_event", "main_us_per_event_net", "idle_wakeups_per_s")  # a Python loop's figures


def _fmt(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sparse", description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="another checkout (git worktree add /tmp/before <commit>, its extension built)")
    parser.add_argument("--tokens", type=int, default=200, help="events of the sparse stream")
    parser.add_argument("--step-ms", type=float, default=50.0, help="time between the stream's events")
    parser.add_argument("--idle-s", type=float, default=10.0, help="seconds of idle measured per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-router", action="store_true", help="leave SGLang's router out")
    parser.add_argument("--strace", action="store_true", help="count epoll_pwait / getpid per event with strace (one more stream)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / f"{time.strftime('%Y%m%d-%H%M%S')}-sparse")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    use_router = not args.no_router and find_spec("sglang_router") is not None
    if args.strace and shutil.which("strace") is None:
        raise SystemExit("sparse: --strace needs strace (apt-get install strace)")
    timeout_s = args.tokens * args.step_ms / 1000 * 3 + 30
    rows: dict[str, list[dict[str, Any]]] = {}
    with ExitStack() as stack:
        upstream_url, _ = stack.enter_context(processes.fake_upstream("paced", args.out, args.step_ms))
        targets: dict[str, tuple[str, int]] = {}
        url, child = stack.enter_context(processes.gateway(upstream_url, args.out / "gateway"))
        targets["gateway"] = (url, child.pid)
        if args.baseline is not None:
            env = processes.baseline_env({}, args.baseline)
            url, child = stack.enter_context(processes.gateway(upstream_url, args.out / "gateway-baseline", env))
            targets["gateway-baseline"] = (url, child.pid)
        if use_router:
            url, child = stack.enter_context(processes.router([upstream_url], args.out))
            targets["router"] = (url, child.pid)
        print(f"paced fake at {upstream_url} ({args.step_ms:g} ms between events, {args.tokens} events); "
              + ", ".join(f"{name}: pid {pid}" for name, (_, pid) in targets.items()), flush=True)  # fmt: skip
        loop = new_event_loop()
        try:
            for url, _ in targets.values():  # warm: a first stream each (connections, lazy imports, the relay thread)
                loop.run_until_complete(run_paced(url, APIS["chat"], 1, 4, 0.0, timeout_s))
            time.sleep(2.0)
            for round_ in range(args.rounds):
                order = list(targets) if round_ % 2 == 0 else list(reversed(targets))
                for name in order:
                    url, pid = targets[name]
                    idle = measure_idle(pid, args.idle_s)
                    row = {**idle, **measure_stream(loop, url, pid, args.tokens, idle, timeout_s)}
                    if args.strace and name != "router":
                        row.update(strace_stream(loop, url, pid, args.tokens, args.out, timeout_s))
                    rows.setdefault(name, []).append(row)
                    print(f"round {round_ + 1} {name:<16} " + "  ".join(f"{k} {_fmt(v, 2)}" for k, v in row.items()), flush=True)
        finally:
            loop.close()
    summary = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in rows.items()}
    print_summary(summary, args.step_ms)
    (args.out / "result.json").write_text(json.dumps({"rows": rows, "summary": summary, "argv": sys.argv[1:]}, indent=2))
    print(f"results: {args.out / 'result.json'}")
    return 0


def print_summary(summary: dict[str, dict[str, float]], step_ms: float) -> None:
    columns = [
        ("wake-ups/event", "wakeups_per_event", 2), ("epoll_pwait/event", "epoll_per_event", 1), ("getpid/event", "getpid_per_event", 1),
        ("main µs/event", "main_us_per_event", 0), ("main µs/event net", "main_us_per_event_net", 0),
        ("process µs/event", "process_us_per_event", 0), ("process µs/event net", "process_us_per_event_net", 0),
        ("idle ms/s", "idle_ms_per_s", 2), ("idle wake-ups/s", "idle_wakeups_per_s", 1),
    ]  # fmt: skip
    print(f"\none stream, {step_ms:g} ms between events; medians over the rounds (main: the event loop's thread)")
    print("| target | " + " | ".join(title for title, _, _ in columns) + " |")
    print("|---|" + "---|" * len(columns))
    for name, row in summary.items():
        wake_free = name == "router"  # no Python event loop: its main thread's switches say nothing
        cells = ["-" if wake_free and key in _LOOP_ONLY else _fmt(row.get(key), digits) for _, key, digits in columns]
        print(f"| {name} | " + " | ".join(cells) + " |")
    ours = summary.get("gateway")
    for versus in ("gateway-baseline", "router"):
        base = summary.get(versus)
        if ours is None or base is None:
            continue
        for title, key in (("process CPU per event", "process_us_per_event"), ("idle CPU per second", "idle_ms_per_s")):
            ratio = f"{ours[key] / base[key]:.2f}x" if base.get(key) else "- (none measured)"
            print(f"gateway / {versus}: {title} {ratio}")


if __name__ == "__main__":
    sys.exit(main())
