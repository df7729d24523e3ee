"""One key against the batch API, and what another key (or /health) sees meanwhile: a key that floods uploads, creates and message batches.

Each scenario runs a real gateway process (``sglang-gateway serve``) in front of the FAKE upstream
(:mod:`benchmarks.fake_upstream`), with two named keys, and prints its numbers with a baseline measured in the same
run (the same calls with nothing else going on):

- ``creates``: 8 concurrent creates of one 50,000-line file by key A with ``max_active_batches_per_key: 3``; key B's
  ``GET /v1/batches`` latency (p50, p99) meanwhile, against B's alone; how many of A's creates were accepted.
- ``message-body``: one 100 MB ``POST /v1/messages/batches`` (more than ``max_lines`` requests: refused
  ``too_many_lines``); ``/health`` latency meanwhile, against ``/health`` alone; the gateway's RSS growth.
- ``disk-full`` (root: mounts a 60 MB tmpfs as the state_dir): key A uploads 5 MB files until refused; the disk's free
  space then; the disk filled to the last byte by something else; A's DELETE still works; key B's 50-line batch
  completes with one ledger row per line.

Run: ``python -m benchmarks.batch_abuse [creates|message-body|disk-full ...]``.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import sqlite3
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from benchmarks.processes import baseline_env, fake_upstream, gateway

A, B = "sk-bench-a", "sk-bench-b"
BASELINE: Path | None = None  # --baseline: the gateway's code from this checkout instead (before / after, one script)


def _keys(**limits: Any) -> list[dict[str, Any]]:
    return [{"name": "a", "key": A, "limits": limits} if limits else {"name": "a", "key": A}, {"name": "b", "key": B}]


@contextmanager
def _gateway(logs: Path, state: Path, **settings: Any) -> Iterator[tuple[str, int]]:
    env = baseline_env(dict(os.environ), BASELINE) if BASELINE is not None else None
    with fake_upstream("starlette", logs) as (upstream, _):
        with gateway(upstream, logs, env=env, settings={"state_dir": str(state), "usage.flush_interval_s": 0.1, **settings}) as (url, child):
            yield url, child.pid


def _lines(count: int, pad: int = 0) -> bytes:
    body = {"model": "bench", "messages": [{"role": "user", "content": "x" * pad or "hi"}], "max_tokens": 2}
    return b"".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}).encode() + b"\n" for i in range(count))


def _upload(http: httpx.Client, key: str, data: bytes) -> httpx.Response:
    return http.post("/v1/files", headers={"Authorization": f"Bearer {key}"}, data={"purpose": "batch"}, files={"file": ("in.jsonl", io.BytesIO(data))})


def _latencies(call: Callable[[], object], until: threading.Event, every_s: float = 0.01) -> list[float]:
    taken: list[float] = []
    while not until.is_set():
        start = time.perf_counter()
        call()
        taken.append((time.perf_counter() - start) * 1000)
        time.sleep(every_s)
    return taken


def _pct(values: list[float], q: int) -> float:
    """The ``q``-th percentile, nearest rank (never beyond the largest value)."""
    ranked = sorted(values)
    return ranked[max(0, math.ceil(q / 100 * len(ranked)) - 1)] if ranked else float("nan")


def _report(name: str, during: list[float], alone: list[float]) -> None:
    p50, p99, b50, b99 = _pct(during, 50), _pct(during, 99), _pct(alone, 50), _pct(alone, 99)
    print(f"{name}: n={len(during)} p50 {p50:.1f} ms p99 {p99:.1f} ms max {max(during):.1f} ms | alone n={len(alone)} p50 {b50:.1f} ms "
          f"p99 {b99:.1f} ms | p99 ratio {p99 / b99:.2f}x")  # fmt: skip


def _baseline(call: Callable[[], object], seconds: float = 3.0) -> list[float]:
    stop = threading.Event()
    threading.Timer(seconds, stop.set).start()
    return _latencies(call, stop)


def creates(logs: Path) -> None:
    settings = {"log_requests": True, "keys": _keys(), "batches.max_active_batches_per_key": 3, "batches.max_queued_lines_per_key": 10**6, "batches.max_concurrency": 1}
    with _gateway(logs, Path(tempfile.mkdtemp(prefix="state-", dir=logs)), **settings) as (url, _), httpx.Client(base_url=url, timeout=300) as http:
        file_id = _upload(http, A, _lines(50_000)).json()["id"]
        other = httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {B}"})
        alone = _baseline(lambda: other.get("/v1/batches").raise_for_status())
        outcomes: list[int] = []
        refusals: list[str] = []

        def create() -> None:
            with httpx.Client(base_url=url, timeout=300) as own:
                body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
                answer = own.post("/v1/batches", headers={"Authorization": f"Bearer {A}"}, json=body)
                outcomes.append(answer.status_code)
                if answer.status_code != 200:
                    refusals.append(answer.json()["error"]["message"])

        threads = [threading.Thread(target=create) for _ in range(8)]
        done = threading.Event()
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        watcher = threading.Thread(target=lambda: ([t.join() for t in threads], done.set()))
        watcher.start()
        during = _latencies(lambda: other.get("/v1/batches").raise_for_status(), done)
        print(f"creates: 8 concurrent creates of one 50,000-line file, limit 3: {outcomes.count(200)} created, "
              f"{outcomes.count(429)} refused 429, others {[s for s in outcomes if s not in (200, 429)]}; {time.perf_counter() - start:.1f} s")  # fmt: skip
        print(f"creates: refusals {sorted(set(refusals))}")
        _report("creates: key b's GET /v1/batches during them", during, alone)


def _create(http: httpx.Client, file_id: str) -> str:
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    return str(http.post("/v1/batches", headers={"Authorization": f"Bearer {B}"}, json=body).raise_for_status().json()["id"])


def _batch(http: httpx.Client, batch_id: str) -> dict[str, Any]:
    return dict(http.get(f"/v1/batches/{batch_id}", headers={"Authorization": f"Bearer {B}"}).json())


def _wait(http: httpx.Client, batch_id: str, timeout_s: float = 300) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while (status := _batch(http, batch_id))["status"] not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, status
        time.sleep(0.2)
    return status


def _run_batch(http: httpx.Client, file_id: str) -> dict[str, Any]:
    return _wait(http, _create(http, file_id))


def _rss_kb(pid: int) -> int:
    """The RSS of ``pid`` and its children (a gateway with workers: all of them)."""
    total = 0
    pids = [pid, *(int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split())]
    for one in pids:
        try:
            for line in Path(f"/proc/{one}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def message_body(logs: Path) -> None:
    with _gateway(logs, Path(tempfile.mkdtemp(prefix="state-", dir=logs)), keys=_keys()) as (url, pid), httpx.Client(base_url=url, timeout=600) as http:
        health = httpx.Client(base_url=url, timeout=60)
        alone = _baseline(lambda: health.get("/health").raise_for_status())
        request = json.dumps({"custom_id": "r{}", "params": {"model": "bench", "max_tokens": 2, "messages": [{"role": "user", "content": "y" * 1900}]}})
        count = (100 * 2**20 - 64) // (len(request) + 8)  # just under max_file_bytes (100 MiB), over max_lines

        whole = b'{"requests": [' + b",".join(request.replace("r{}", f"r{i}").encode() for i in range(count)) + b"]}"
        size = len(whole)  # made before: the client's own work is not in /health's times

        def body() -> Iterator[bytes]:
            view = memoryview(whole)
            for start in range(0, size, 65536):
                yield bytes(view[start : start + 65536])

        rss_before = _rss_kb(pid)
        peak = rss_before
        done = threading.Event()
        answer: list[httpx.Response] = []

        def send() -> None:
            headers = {"x-api-key": A, "anthropic-version": "2023-06-01", "content-type": "application/json", "content-length": str(size)}
            answer.append(http.post("/v1/messages/batches", headers=headers, content=body()))
            done.set()

        def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, _rss_kb(pid))
                time.sleep(0.05)

        start = time.perf_counter()
        threading.Thread(target=send).start()
        threading.Thread(target=sample).start()
        during = _latencies(lambda: health.get("/health").raise_for_status(), done)
        took = time.perf_counter() - start
        error = answer[0].json().get("error", {})
        print(f"message-body: {size / 2**20:.1f} MB, {count} requests: {answer[0].status_code} {error.get('message', '')[:90]!r} in {took:.1f} s; "
              f"RSS {rss_before / 1024:.0f} MB before, peak {peak / 1024:.0f} MB (+{(peak - rss_before) / 1024:.0f} MB)")  # fmt: skip
        _report("message-body: /health during it", during, alone)


def disk_full(logs: Path) -> None:
    if os.geteuid() != 0:
        raise SystemExit("disk-full mounts a tmpfs: run it as root")
    state = Path(tempfile.mkdtemp(prefix="batch-disk-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=60m", "tmpfs", str(state)], check=True)
    try:
        settings = {"keys": _keys(), "batches.min_free_bytes": 10 * 2**20, "batches.max_concurrency": 1, "batches.poll_interval_s": 0.2}
        with _gateway(logs, state, **settings) as (url, _), httpx.Client(base_url=url, timeout=120) as http:
            five = _lines(2600, pad=1900)[: 5 * 2**20].rsplit(b"\n", 1)[0] + b"\n"
            kept, refused = [], None
            for _ in range(20):
                answer = _upload(http, A, five)
                if answer.status_code != 200:
                    refused = answer
                    break
                kept.append(answer.json()["id"])
            free = os.statvfs(state).f_bavail * os.statvfs(state).f_frsize
            print(f"disk-full: key a's 5 MB uploads: {len(kept)} kept, then {refused.status_code if refused else '-'} "
                  f"{refused.json()['error']['code'] if refused else ''}; free then {free / 2**20:.1f} MB (floor 10 MB) of 60 MB")  # fmt: skip
            b_small, b_big = _upload(http, B, _lines(50)).json()["id"], _upload(http, B, _lines(3000)).json()["id"]
            first = _run_batch(http, b_small)
            print(f"disk-full: key b's 50-line batch {first['status']}, {first['request_counts']}")
            big = _create(http, b_big)
            while _batch(http, big)["request_counts"]["completed"] < 200:
                time.sleep(0.05)
            filler = state / "filler"
            subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=1M", "count=100"], capture_output=True)  # another writer fills the disk
            free = os.statvfs(state).f_bavail * os.statvfs(state).f_frsize
            at_full = _batch(http, big)["request_counts"]["completed"]
            time.sleep(3)
            paused = _batch(http, big)
            upload = _upload(http, A, b"{}\n" * 10)
            deleted = http.delete(f"/v1/files/{kept[0]}", headers={"Authorization": f"Bearer {A}"})
            after = os.statvfs(state).f_bavail * os.statvfs(state).f_frsize
            listed = [item["id"] for item in http.get("/v1/files", headers={"Authorization": f"Bearer {A}"}).json()["data"]]
            print(f"disk-full: disk filled by another writer ({free} bytes free) while key b's 3,000-line batch ran: {at_full} lines recorded "
                  f"then, {paused['request_counts']['completed']} 3 s later ({paused['status']}); an upload: {upload.status_code}; key a's DELETE: "
                  f"{deleted.status_code}, free after {after / 2**20:.1f} MB, file still listed: {kept[0] in listed}")  # fmt: skip
            ended = _wait(http, big)
            time.sleep(1)  # the ledger's last flush
            with sqlite3.connect(state / "usage.sqlite3") as conn:
                rows = conn.execute("SELECT request_id, count(*) FROM usage_rows WHERE batch_id IN (?, ?) GROUP BY request_id", (first["id"], big)).fetchall()
            print(f"disk-full: key b's 3,000-line batch {ended['status']}, {ended['request_counts']}; ledger: {len(rows)} request ids for "
                  f"{50 + 3000} lines, at most {max(n for _, n in rows)} row each")  # fmt: skip
            filler.unlink()
    finally:
        subprocess.run(["umount", "-l", str(state)], check=False)
        state.rmdir()


SCENARIOS = {"creates": creates, "message-body": message_body, "disk-full": disk_full}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenarios", nargs="*", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--logs", type=Path, default=None, help="where the processes' logs go (default: a new temporary directory)")
    parser.add_argument("--baseline", type=Path, default=None, help="run the gateway of this checkout instead (e.g. one of main)")
    args = parser.parse_args(argv)
    global BASELINE
    BASELINE = args.baseline
    for name in args.scenarios:
        logs = (args.logs or Path(tempfile.mkdtemp(prefix="batch-abuse-"))) / name
        logs.mkdir(parents=True, exist_ok=True)
        SCENARIOS[name](logs)


if __name__ == "__main__":
    main()
