"""What a cut stream is charged against what the engine generated for it: the real tiny CPU engine behind a gateway
(in this process) with one named key; ``--streams`` chat streams (``ignore_eos``, ``max_tokens`` far above the cut)
each read to ``--events`` events, then cut by the client, ``--concurrency`` at a time. The engine's own counter
(``sglang:generation_tokens_total``, nothing else runs on it) gives what it generated; the usage ledger gives what
the key was charged. Prints both, and the tokens generated but not charged, per stream and as a share.

    .venv/bin/python -m benchmarks.cut_streams --streams 20 --events 100 --concurrency 1
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from launch.config import load_config
from launch.lifecycle import start_ready
from launch.tiny_model import build_tiny_model

REPO = Path(__file__).resolve().parents[1]
KEY, ADMIN = "sk-cut-streams", "sk-cut-admin"


def _generated(engine_url: str) -> float:
    text = httpx.get(engine_url + "/metrics", timeout=30).text
    return sum(float(m.group(1)) for m in re.finditer(r"^sglang:generation_tokens_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))


def _cut(url: str, events: int) -> float:
    """One stream read to ``events`` events and cut: the events a second it was read at, after its first."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 2000,
            "stream": True, "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as answer:
        seen, first = 0, 0.0
        for line in answer.iter_lines():
            seen += line.startswith("data: ")
            if seen == 1:
                first = time.perf_counter()
            if seen >= events:
                return (seen - 1) / max(time.perf_counter() - first, 1e-9)
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=20)
    parser.add_argument("--events", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=1)
    args = parser.parse_args()
    from tests.gateway_server import serve  # the test suite's in-thread gateway (the serve command's listener)

    os.environ.setdefault("SGLANG_GATEWAY_TINY_MODEL", str(build_tiny_model(REPO / ".cache" / "tiny-model")))
    with tempfile.TemporaryDirectory() as state:
        engine = start_ready("tiny", load_config(REPO / "configs" / "tiny-cpu.yaml").engine("tiny"), log_dir=state)
        try:
            gateway = {"keys": [{"name": "meter", "key": KEY, "limits": {"tokens_per_minute": 10**9}}], "admin_keys": [ADMIN],
                       "state_dir": state, "usage": {"flush_interval_s": 0.05}}  # fmt: skip
            with serve({"tiny": {"url": engine.url}}, gateway) as server:
                before = _generated(engine.url)
                with ThreadPoolExecutor(args.concurrency) as pool:
                    rates = list(pool.map(lambda _: _cut(server.url, args.events), range(args.streams)))
                time.sleep(3)  # the engine aborted the last streams; the ledger wrote their rows
                generated = _generated(engine.url) - before
                rows = httpx.get(server.url + "/admin/usage", params={"key": "meter"}, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
                charged = rows.json()["rows"][0]["completion_tokens"]
        finally:
            engine.stop()
    unseen = generated - charged
    print(f"streams {args.streams} cut after {args.events} events, {args.concurrency} at a time")
    print(f"engine generated {generated:.0f} tokens; ledger charged {charged} completion tokens")
    print(f"events a second per stream while read: median {sorted(rates)[len(rates) // 2]:.0f}")
    print(f"not charged: {unseen:.0f} tokens, {unseen / args.streams:.1f} per stream, {unseen / max(generated, 1):.1%} of what was generated")


if __name__ == "__main__":
    main()
