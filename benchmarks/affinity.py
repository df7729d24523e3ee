"""Prefix affinity, measured: SGLang's cached prompt tokens and latency with and without it, in one run.

A gateway (``sglang-gateway serve``, its own process) runs ``replicas: N`` of the tiny CPU engine; the engines
report each request's cached prompt tokens (``--enable-cache-report``: ``usage.prompt_tokens_details``). The
workload is K system prompts (long, distinct from their first words) x M short user messages, sent interleaved
(prompt 0, 1, ..., K-1, then again) at a fixed concurrency: the shape of many users of a few assistants. Each
batch runs under ``least_in_flight`` or ``prefix_affinity`` (switched by ``POST /admin/reload`` of the gateway's
YAML: the engines keep running), alternating over the rounds, each batch with system prompts of its own so that
no batch finds another's prefixes cached. The engines' KV cache is sized so that one replica holds the prefixes
of most prompts, not all of them: the case affinity is for (without it, every replica must cache every prompt).

Reported per policy: cached tokens per request and the cached share of prompt tokens (from the answers, and
from each engine's ``sglang:cached_tokens_total`` as a cross-check), time to first token and latency
percentiles, requests per second, requests per replica; and the ratios affinity / no affinity.
"""

from __future__ import annotations

import asyncio
import re
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from benchmarks.apis import CHAT
from benchmarks.loadgen import Connection, StreamParser, new_event_loop
from benchmarks.replica_rig import DEFAULT_POLICY, MODEL, ReplicaRig, metric_sum

__all__ = [
    "AffinityWorkload",
    "measure_affinity",
    "metric_sum",
    "ratios",
    "summarize",
]  # metric_sum: tests import it here

POLICIES = (DEFAULT_POLICY, "prefix_affinity")
_WORDS = "The quick brown fox jumps over the lazy dog while a careful clerk files each report.".split()
_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')


@dataclass(frozen=True)
class AffinityWorkload:
    """K system prompts x M user messages, interleaved by prompt."""

    prompts: int = 8
    per_prompt: int = 8
    system_words: int = 100  # ~330 tokens with the tiny model's tokenizer
    output_tokens: int = 8

    def system_prompt(self, batch: str, prompt: int) -> str:
        """A long system prompt that differs from its first words on (so no two share a cached prefix)."""
        shift = prompt % len(_WORDS)
        words = (_WORDS[shift:] + _WORDS[:shift]) * (1 + self.system_words // len(_WORDS))
        return f"Assistant {prompt} of batch {batch}. " + " ".join(words[: self.system_words])

    def bodies(self, batch: str) -> list[bytes]:
        """Streamed chat requests, prompt by prompt in turn (0, 1, ..., K-1, 0, 1, ...)."""
        out = []
        for message in range(self.per_prompt):
            for prompt in range(self.prompts):
                body = {
                    "model": MODEL,
                    "messages": [
                        {"role": "system", "content": self.system_prompt(batch, prompt)},
                        {"role": "user", "content": f"Question {message}: what does the clerk file?"},
                    ],
                    "max_tokens": self.output_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                out.append(orjson.dumps(body))
        return out


@dataclass
class Answer:
    """One request as the client saw it."""

    ok: bool
    latency_s: float
    ttft_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # None: the engine reported none (started without --enable-cache-report)
    error: str | None = None


@dataclass
class Batch:
    policy: str
    answers: list[Answer] = field(default_factory=list)
    wall_s: float = 0.0
    per_replica: dict[str, float] = field(default_factory=dict)  # requests each replica served (gateway metrics)
    engine_cached: float = 0.0  # cached prompt tokens counted by the engines themselves
    engine_prompt: float = 0.0  # prompt tokens counted by the engines themselves


async def _send_all(url: str, bodies: list[bytes], concurrency: int, timeout_s: float) -> tuple[list[Answer], float]:
    """Every body once, ``concurrency`` at a time over keep-alive connections, in order of the list."""
    host_port = url.split("//", 1)[1]
    host, port = host_port.rsplit(":", 1)
    connections = [Connection(host, int(port), quickack=True) for _ in range(concurrency)]
    answers: list[Answer | None] = [None] * len(bodies)
    queue = iter(range(len(bodies)))

    async def one(conn: Connection, body: bytes) -> Answer:
        head = (
            f"POST {CHAT.path} HTTP/1.1\r\nhost: {host_port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode()
        parser = StreamParser(CHAT, stream=True)
        tail = bytearray()  # the end of the stream: its usage chunk comes last, before [DONE]

        def feed(data: bytes, now: float) -> None:
            parser.feed_stream(data, now)
            tail.extend(data)
            del tail[:-8192]

        start = time.perf_counter()
        try:
            status = await asyncio.wait_for(conn.request(head, body, feed), timeout_s)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError) as error:
            conn.close()
            return Answer(False, time.perf_counter() - start, error=f"{type(error).__name__}: {error}"[:200])
        latency = time.perf_counter() - start
        problem = f"HTTP {status}" if status != 200 else parser.stream_problem()
        cached, prompt = _CACHED.findall(bytes(tail)), _PROMPT.findall(bytes(tail))
        return Answer(
            problem is None,
            latency,
            ttft_s=parser.first - start if parser.first is not None else None,
            prompt_tokens=int(prompt[-1]) if prompt else 0,
            cached_tokens=int(cached[-1]) if cached else None,
            error=problem,
        )

    async def worker(conn: Connection) -> None:
        for index in queue:
            answers[index] = await one(conn, bodies[index])

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(worker(conn) for conn in connections))
    finally:
        for conn in connections:
            conn.close()
    return [answer for answer in answers if answer is not None], time.perf_counter() - t0


def counters(rig: ReplicaRig) -> tuple[dict[str, float], float, float]:
    """Requests per replica (gateway), and cached / prompt tokens summed over the engines (their own counts)."""
    text = rig.http.get(rig.url + "/metrics").text
    per_replica = {
        sample.labels["replica"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "gateway_replica_requests_total" and sample.labels.get("model") == MODEL
    }
    cached = sum(rig.engine_metric("sglang:cached_tokens_total").values())  # by source: device, host, storage
    prompt = sum(rig.engine_metric("sglang:prompt_tokens_total").values())
    return per_replica, cached, prompt


def run_policy_batch(
    rig: ReplicaRig, policy: str, bodies: list[bytes], concurrency: int, timeout_s: float = 300
) -> Batch:
    """``bodies`` through the gateway under ``policy``, with what the gateway and the engines counted meanwhile."""
    rig.set_policy(policy)
    replicas_before, cached_before, prompt_before = counters(rig)
    loop = new_event_loop()
    try:
        answers, wall = loop.run_until_complete(_send_all(rig.url, bodies, concurrency, timeout_s))
    finally:
        loop.close()
    replicas_after, cached_after, prompt_after = counters(rig)
    per_replica = {r: replicas_after[r] - replicas_before.get(r, 0.0) for r in sorted(replicas_after)}
    return Batch(policy, answers, wall, per_replica, cached_after - cached_before, prompt_after - prompt_before)


def measure_affinity(
    rig: ReplicaRig, workload: AffinityWorkload, concurrency: int, rounds: int, console: Console
) -> dict[str, Any]:
    """Every policy over ``rounds`` alternating (ABBA) batches after a warm-up: summaries and ratios."""
    batches: dict[str, list[Batch]] = {policy: [] for policy in POLICIES}
    warm = AffinityWorkload(min(workload.prompts, 2), 1, workload.system_words, workload.output_tokens)
    run_policy_batch(rig, POLICIES[0], warm.bodies("warm-up"), concurrency)  # not counted
    for index in range(rounds):
        for policy in POLICIES if index % 2 == 0 else POLICIES[::-1]:
            batch = run_policy_batch(rig, policy, workload.bodies(f"{index}-{policy}"), concurrency)
            batches[policy].append(batch)
            console.print(
                f"round {index + 1}/{rounds} {policy:<16} {len(batch.answers)} requests in {batch.wall_s:.1f}s, "
                f"per replica {batch.per_replica}"
            )
    summaries = {policy: summarize(found) for policy, found in batches.items()}
    return {"policies": summaries, "ratios": ratios(summaries[POLICIES[0]], summaries[POLICIES[1]])}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summarize(batches: list[Batch]) -> dict[str, Any]:
    """One policy's batches pooled: cached tokens, latency, throughput, spread over replicas."""
    answers = [answer for batch in batches for answer in batch.answers]
    ok = [answer for answer in answers if answer.ok]
    cached = [answer.cached_tokens for answer in ok if answer.cached_tokens is not None]
    prompt = sum(answer.prompt_tokens for answer in ok)
    wall = sum(batch.wall_s for batch in batches)
    per_replica: dict[str, float] = {}
    for batch in batches:
        for replica, count in batch.per_replica.items():
            per_replica[replica] = per_replica.get(replica, 0.0) + count
    engine_prompt = sum(batch.engine_prompt for batch in batches)
    return {
        "requests": len(answers),
        "errors": len(answers) - len(ok),
        "error_examples": sorted({answer.error or "?" for answer in answers if not answer.ok})[:3],
        "cache_reported": len(cached) == len(ok) and bool(ok),
        "cached_tokens_per_request": statistics.fmean(cached) if cached else None,
        "prompt_tokens_per_request": prompt / len(ok) if ok else None,
        "cached_share": sum(cached) / prompt if cached and prompt else None,
        "engine_cached_share": sum(b.engine_cached for b in batches) / engine_prompt if engine_prompt else None,
        "ttft_p50_ms": _pct([a.ttft_s for a in ok if a.ttft_s is not None], 50),
        "ttft_p90_ms": _pct([a.ttft_s for a in ok if a.ttft_s is not None], 90),
        "latency_p50_ms": _pct([a.latency_s for a in ok], 50),
        "latency_p90_ms": _pct([a.latency_s for a in ok], 90),
        "req_s": len(ok) / wall if wall else None,
        "per_replica": per_replica,
        "rounds_req_s": [
            round(len([a for a in b.answers if a.ok]) / b.wall_s, 2) if b.wall_s else None for b in batches
        ],
        # each request's cached prompt tokens, in the order sent (prompt 0, 1, ..., K-1, 0, 1, ...), per batch
        "cached_tokens_by_request": [[a.cached_tokens for a in b.answers] for b in batches],
    }


RATIO_KEYS = (
    "cached_tokens_per_request",
    "cached_share",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "latency_p50_ms",
    "latency_p90_ms",
    "req_s",
)


def ratios(without: dict[str, Any], with_affinity: dict[str, Any]) -> dict[str, float | None]:
    """affinity / no affinity, per figure (None where either side has no value or the baseline is 0)."""
    out: dict[str, float | None] = {}
    for key in RATIO_KEYS:
        base, value = without.get(key), with_affinity.get(key)
        out[key] = value / base if base and value is not None else None
    return out
