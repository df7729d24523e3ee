"""The ledger equals the engine: a seeded random mix of requests through ``workers: 2`` to the real tiny engine, and
the ledger's token sums against the engine's own counters (``sglang:prompt_tokens_total``,
``sglang:generation_tokens_total``), within the bound docs/tenants.md states for cut streams; the limited keys'
token rate and day budget held within their stated overshoot.

The mix: chat, completions, Responses and Messages; streamed or not; ``include_usage`` on and off; ``n`` 1-3 where
the route has it; a third of the streams cut by the client after a few events. Every request carries its own
``X-Request-Id``, so each ledger row is matched to what the test sent.

How SGLang counts, measured on this engine: each request's prompt once per finished (or aborted) request, and a
request with ``n > 1`` is ``n`` requests plus one that caches the prompt first (so ``n + 1`` prompts), while its
usage (what OpenAI bills and the ledger keeps) says the prompt once.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.servers import CLI, server_process

pytestmark = pytest.mark.engine

SEED = 20261204
REQUESTS = 300
CONCURRENCY = 8
KEYS = {  # name -> (key, limits)
    "alpha": ("sk-alpha-ledger", {"tokens_per_minute": 2500, "tokens_per_day": 4000}),
    "beta": ("sk-beta-ledger", {"tokens_per_minute": 1500}),
    "gamma": ("sk-gamma-ledger", {}),
}
WORKERS = 2
WORDS = "the quick brown fox jumps over a lazy dog while seven tired owls watch quietly".split()
# A cut stream's completion is its events relayed. Over the engine's count by the framing events (a role event per
# choice on chat; on Responses and Messages a few events before and after the text); under it by the tokens the
# engine made after the gateway's last read and before the abort reached it (per choice). docs/tenants.md states both.
FRAMING_EVENTS = {"chat": 3, "completions": 0, "responses": 6, "messages": 6}
TOKENS_AFTER_THE_CUT_PER_CHOICE = 16


@dataclass
class Sent:
    """One request of the mix and what came of it."""

    request_id: str
    key: str
    route: str
    body: dict[str, Any]
    cut_after: int | None  # events read before the client closed a stream it cut
    status: int = 0

    @property
    def choices(self) -> int:
        return int(self.body.get("n", 1))


def _mix(rng: random.Random) -> list[Sent]:
    mix = []
    for i in range(REQUESTS):
        route = rng.choice(["chat", "completions", "responses", "messages"])
        stream = rng.random() < 0.6
        cut = stream and rng.random() < 1 / 3
        limit = rng.randint(40, 120) if cut else rng.randint(1, 16)  # a cut stream is cut while it generates
        text = " ".join(rng.choices(WORDS, k=rng.randint(2, 12)))
        if route == "chat":
            body: dict[str, Any] = {"messages": [{"role": "user", "content": text}], "max_tokens": limit, "n": rng.randint(1, 3)}
        elif route == "completions":
            body = {"prompt": text, "max_tokens": limit, "n": rng.randint(1, 3)}
        elif route == "responses":
            body = {"input": text, "max_output_tokens": limit}
        else:
            body = {"messages": [{"role": "user", "content": text}], "max_tokens": limit}
        body.update(model="tiny", stream=stream)
        if route in ("chat", "completions"):
            body["ignore_eos"] = True
            if stream and rng.random() < 0.5:
                body["stream_options"] = {"include_usage": True}
        key = rng.choice(list(KEYS))
        mix.append(Sent(f"mix-{i:04d}", key, route, body, rng.randint(1, 6) if cut else None))
    return mix


PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses", "messages": "/v1/messages"}


async def _send(http: httpx.AsyncClient, sent: Sent, gate: asyncio.Semaphore) -> None:
    headers = {"Authorization": f"Bearer {KEYS[sent.key][0]}", "X-Request-Id": sent.request_id}
    async with gate:
        if not sent.body["stream"]:
            sent.status = (await http.post(PATHS[sent.route], json=sent.body, headers=headers)).status_code
            return
        async with http.stream("POST", PATHS[sent.route], json=sent.body, headers=headers) as answer:
            sent.status = answer.status_code
            events = 0
            async for line in answer.aiter_lines():
                events += line.startswith("data:")
                if sent.cut_after is not None and events >= sent.cut_after:
                    break  # leaving the block closes the connection: the client cut the stream


async def _run(url: str, mix: list[Sent]) -> None:
    gate = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        await asyncio.gather(*(_send(http, sent, gate) for sent in mix))


def _engine_totals(url: str) -> tuple[float, float]:
    """The engine's (prompt, generation) token counters, summed over their labels."""
    text = httpx.get(url + "/metrics", timeout=10).text

    def total(name: str) -> float:
        return sum(float(value) for value in re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M))

    return total("sglang:prompt_tokens_total"), total("sglang:generation_tokens_total")


def _settled_engine_totals(url: str) -> tuple[float, float]:
    """The counters once aborted requests have been counted too (two equal reads 0.5 s apart)."""
    last = _engine_totals(url)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = _engine_totals(url)
        if now == last:
            return now
        last = now
    return last


def _ledger_rows(database: Path, count: int) -> dict[str, tuple[str | None, int | None, int | None, int]]:
    """request id -> (key, prompt, completion, status) once ``count`` rows of the mix are written."""
    deadline = time.monotonic() + 30
    while True:
        with sqlite3.connect(database) as db:
            rows = db.execute(
                "SELECT request_id, key_name, prompt_tokens, completion_tokens, status FROM usage_rows "
                "WHERE request_id LIKE 'mix-%'"
            ).fetchall()
        if len(rows) >= count or time.monotonic() > deadline:
            return {row[0]: (row[1], row[2], row[3], row[4]) for row in rows}
        time.sleep(0.2)


def _cost_bound(sent: Sent) -> int:
    """What one request may cost at most (docs/tenants.md: its body's bytes plus its completion limit per choice)."""
    size = len(json.dumps({**sent.body, "model": "tiny"}, separators=(",", ":"))) + 64  # the gateway adds stream_options
    limit = sent.body.get("max_tokens") or sent.body.get("max_output_tokens")
    return size + limit * sent.choices


def test_the_ledger_equals_the_engine(tiny_engine: Any, tmp_path: Path) -> None:
    keys = [{"name": name, "key": key, "limits": limits} for name, (key, limits) in KEYS.items()]
    state = tmp_path / "state"
    gateway = {"keys": keys, "admin_keys": ["admin"], "state_dir": str(state), "usage": {"flush_interval_s": 0.05}, "workers": WORKERS}
    config = tmp_path / "deploy.yaml"
    config.write_text(yaml.safe_dump({"models": {"tiny": {"url": tiny_engine.url}}, "gateway": gateway}))
    mix = _mix(random.Random(SEED))
    with server_process([*CLI, "serve", str(config), "--port", "{port}"], log_path=tmp_path / "gateway.log", ready_path="/health", timeout_s=90) as server:
        prompt_before, generated_before = _settled_engine_totals(tiny_engine.url)
        started = time.time()
        asyncio.run(_run(server.url, mix))
        elapsed = time.time() - started
        prompt_after, generated_after = _settled_engine_totals(tiny_engine.url)
        rows = _ledger_rows(state / "usage.sqlite3", len(mix))
    assert sorted(rows) == sorted(sent.request_id for sent in mix), "every request has its ledger row"

    answered = [sent for sent in mix if sent.status == 200]
    refused = [sent for sent in mix if sent.status == 429]
    assert len(answered) + len(refused) == len(mix), sorted({sent.status for sent in mix})
    assert len(answered) >= REQUESTS // 2 and refused, (len(answered), len(refused))  # the limits bound, the rest ran
    cut = [sent for sent in answered if sent.cut_after is not None]
    assert len(cut) >= 20, len(cut)  # of ~60 planned (a third of ~180 streams), those the limits let through: 28-33 seen
    for sent in answered:
        key, prompt, completion, _ = rows[sent.request_id]
        assert key == sent.key and prompt and completion is not None, (sent, rows[sent.request_id])

    # Prompts: SGLang counts n + 1 prompts for n > 1; a cut Responses stream is charged its prompt's bound (its bytes).
    def engine_prompts(sent: Sent) -> int:
        return sent.choices + (sent.choices > 1)

    exact = [sent for sent in answered if not (sent.cut_after is not None and sent.route == "responses")]
    bounded = [sent for sent in answered if sent not in exact]
    engine_prompt = prompt_after - prompt_before
    counted = sum(engine_prompts(sent) * rows[sent.request_id][1] for sent in exact)
    assert counted + len(bounded) <= engine_prompt <= counted + sum(rows[sent.request_id][1] for sent in bounded), (
        engine_prompt, counted, len(bounded))  # fmt: skip
    print(f"prompt: engine {engine_prompt:.0f}, ledger (x n + 1 prompts) {counted} + {len(bounded)} cut Responses streams bounded")

    # Completions: equal but for the cut streams, each within its stated bound either way.
    ledger_generated = sum(rows[sent.request_id][2] for sent in answered)
    engine_generated = generated_after - generated_before
    over = sum(FRAMING_EVENTS[sent.route] * sent.choices for sent in cut)
    under = sum(TOKENS_AFTER_THE_CUT_PER_CHOICE * sent.choices for sent in cut)
    print(f"completion: engine {engine_generated:.0f}, ledger {ledger_generated}, {len(cut)} cut streams (bound -{under}/+{over})")
    assert engine_generated - under <= ledger_generated <= engine_generated + over, (engine_generated, ledger_generated)

    # The limited keys: tokens charged within the rate's refill plus its burst, and the day budget, each plus the
    # stated overshoot (one request's real cost beyond the limit per worker process).
    for name, (_, limits) in KEYS.items():
        if not limits:
            continue
        mine = [sent for sent in answered if sent.key == name]
        charged = sum((rows[sent.request_id][1] or 0) + (rows[sent.request_id][2] or 0) for sent in mine)
        overshoot = WORKERS * max((_cost_bound(sent) for sent in mine), default=0)
        rate = limits["tokens_per_minute"]
        assert charged <= rate + rate * elapsed / 60 + overshoot, (name, charged, elapsed)
        if "tokens_per_day" in limits:
            assert charged <= limits["tokens_per_day"] + overshoot, (name, charged)
        print(f"{name}: {charged} tokens charged in {elapsed:.1f}s (tpm {rate}, {limits})")
