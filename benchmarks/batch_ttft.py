"""Interactive latency while a batch saturates the engine, and the batch's own throughput, in one run.

1. TTFT of ``--interactive`` streamed chat requests (one at a time) through the gateway, no batch running;
2. the same requests while a batch of ``--lines`` lines runs (submitted through the batch API, at its class);
3. the tokens/s of a second batch, with no interactive traffic (from its submission to its end), against the same lines sent straight to the engine at the
   same concurrency (``--concurrency``, the gateway's ``batches.max_concurrency``).

Prints the p50/p90 TTFTs, their ratio (batch / idle), and the throughput ratio (batch / direct).

    .venv/bin/python -m benchmarks.batch_ttft [--engine-url URL] [--lines 120] [--interactive 20] [--concurrency 4]

Without ``--engine-url`` it starts the real SGLang CPU engine with the tiny model (configs/tiny-cpu.yaml).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai

from benchmarks.processes import REPO, gateway, sglang_engine

MODEL = "bench"


def _body(i: int, max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"Request {i}: write about the sea."}], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": stream}  # fmt: skip


def interactive_ttfts(url: str, count: int) -> list[float]:
    """TTFT (s) of ``count`` streamed chat requests sent one after another: time to the first content event."""
    ttfts = []
    with httpx.Client(base_url=url, timeout=120) as http:
        for i in range(count):
            started = time.perf_counter()
            with http.stream("POST", "/v1/chat/completions", json=_body(10_000 + i, 8, stream=True)) as answer:
                events = answer.iter_lines()
                for line in events:
                    if line.startswith("data: {") and '"content":"' in line.replace(" ", "") and '"content":""' not in line.replace(" ", ""):
                        ttfts.append(time.perf_counter() - started)
                        break
                for _ in events:  # the rest of the stream
                    pass
    return ttfts


async def direct_tokens_per_s(engine_url: str, model: str, lines: int, concurrency: int, max_tokens: int) -> float:
    """The same lines straight to the engine, ``concurrency`` at a time: completion tokens per second."""
    queue = list(range(lines))
    tokens = 0

    async def worker(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        while queue:
            body = {**_body(queue.pop(), max_tokens), "model": model}
            answer = await http.post("/v1/chat/completions", json=body)
            tokens += answer.json()["usage"]["completion_tokens"]

    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=engine_url, timeout=300) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return tokens / (time.perf_counter() - started)


def _submit(client: openai.OpenAI, count: int, max_tokens: int) -> Any:
    lines = [{"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions", "body": _body(i, max_tokens)} for i in range(count)]
    source = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(map(json.dumps, lines)).encode())), purpose="batch")
    return client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")


def _ended(client: openai.OpenAI, batch_id: str) -> Any:
    """The batch once ended, polled every 0.2 s: on the CPU engine, a busier poll takes CPU from the engine, which the
    batch's throughput then lacks."""
    while (batch := client.batches.retrieve(batch_id)).status not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(0.2)
    return batch


def _p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


@contextmanager
def _engine(url: str | None, logs: Path) -> Iterator[str]:
    if url:
        yield url
        return
    with sglang_engine(logs) as (engine_url, _):
        yield engine_url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-url")
    parser.add_argument("--lines", type=int, default=120)
    parser.add_argument("--interactive", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="batch-ttft-"))
    settings = {"state_dir": str(logs / "state"), "batches.max_concurrency": args.concurrency, "batches.poll_interval_s": 0.2}
    with _engine(args.engine_url, logs) as engine_url, gateway(engine_url, logs, env={"PYTHONPATH": str(REPO)}, settings=settings) as (url, _):
        served = httpx.get(engine_url + "/v1/models", timeout=10).json()["data"][0]["id"]
        interactive_ttfts(url, 3)  # warm-up
        idle = interactive_ttfts(url, args.interactive)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        batch = _submit(client, args.lines, args.max_tokens)
        while client.batches.retrieve(batch.id).request_counts.completed < args.concurrency:
            time.sleep(0.05)
        loaded = interactive_ttfts(url, args.interactive)
        loaded_at = client.batches.retrieve(batch.id).request_counts
        _ended(client, batch.id)
        started = time.perf_counter()  # a second batch with no interactive traffic: the batch path's own throughput
        batch = _ended(client, _submit(client, args.lines, args.max_tokens).id)
        elapsed = time.perf_counter() - started
        out = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
        batch_rate = sum(line["response"]["body"]["usage"]["completion_tokens"] for line in out) / elapsed
        direct_rate = asyncio.run(direct_tokens_per_s(engine_url, served, args.lines, args.concurrency, args.max_tokens))
    report = {
        "lines": args.lines, "concurrency": args.concurrency, "max_tokens": args.max_tokens, "interactive": args.interactive,
        "batch_lines_done_while_measuring": f"{loaded_at.completed}/{loaded_at.total}",
        "ttft_p50_idle_ms": round(_p(idle, 50) * 1000, 1), "ttft_p50_batch_ms": round(_p(loaded, 50) * 1000, 1),
        "ttft_p90_idle_ms": round(_p(idle, 90) * 1000, 1), "ttft_p90_batch_ms": round(_p(loaded, 90) * 1000, 1),
        "ttft_p50_ratio": round(_p(loaded, 50) / _p(idle, 50), 2),
        "batch_tokens_per_s": round(batch_rate, 1), "direct_tokens_per_s": round(direct_rate, 1),
        "throughput_ratio": round(batch_rate / direct_rate, 2), "logs": str(logs),
    }  # fmt: skip
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
