"""Every token accounted, against the real tiny engine: a stream that did not ask for usage is charged (and its
client sees no usage event), a cut stream is charged what it was relayed, a day budget holds under a burst of
concurrent requests, and a restarted gateway starts from what its ledger says the key spent."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.chat import chat_body
from tests.gateway_server import serve
from tests.servers import CLI, server_process

pytestmark = pytest.mark.engine

BUDGETED = "sk-budgeted-key"
TOKENS = "sk-tokens-key"


def _gateway(state_dir: Path, *keys: dict[str, Any]) -> dict[str, Any]:
    return {"keys": list(keys), "state_dir": str(state_dir), "usage": {"flush_interval_s": 0.05}}


def _events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def _ledger(url: str, key: str) -> tuple[int, int, int]:
    usage = httpx.get(url + "/admin/usage", params={"key": key}, headers={"Authorization": "Bearer admin"}, timeout=30).json()
    row = usage["rows"][0] if "rows" in usage else usage
    return row["requests"], row["prompt_tokens"], row["completion_tokens"]


def _settled(url: str, key: str, requests: int) -> tuple[int, int, int]:
    """The ledger's (requests, prompt, completion) of ``key`` once it holds ``requests`` rows."""
    deadline = time.monotonic() + 20
    while True:
        found = _ledger(url, key)
        if found[0] >= requests or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_streams_are_charged_whether_or_not_they_ask_for_usage(tiny_engine: Any, tmp_path: Path) -> None:
    key = {"name": "meter", "key": TOKENS, "limits": {"tokens_per_minute": 100000}}
    gateway = {**_gateway(tmp_path, key), "admin_keys": ["admin"]}
    with serve({"tiny": {"url": tiny_engine.url}}, gateway) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        headers = {"Authorization": f"Bearer {TOKENS}"}
        silent = http.post("/v1/chat/completions", json=chat_body(max_tokens=12, stream=True, ignore_eos=True, n=2), headers=headers)
        assert silent.status_code == 200
        assert all("usage" not in event or event["usage"] is None for event in _events(silent.text)), silent.text
        assert silent.text.rstrip().endswith("data: [DONE]")
        asked = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 5, "stream": True, "ignore_eos": True,
                                                    "stream_options": {"include_usage": True}}, headers=headers)  # fmt: skip
        usage = [event["usage"] for event in _events(asked.text) if event.get("usage")]
        assert usage and usage[-1]["completion_tokens"] == 5
        with http.stream("POST", "/v1/chat/completions", json=chat_body(max_tokens=1900, stream=True, ignore_eos=True), headers=headers) as cut:
            lines = 0
            for line in cut.iter_lines():
                lines += line.startswith("data: ")
                if lines == 10:
                    break
        requests, prompt, completion = _settled(server.url, "meter", 3)
        assert requests == 3
        # 24 (n=2 x 12) + 5 fully reported; the cut stream: the events the gateway wrote before it saw the client go
        # (the client read 10, the role event among them; on a loaded machine the gateway wrote hundreds more before it
        # saw the close: 596 in one run beside two busy processes), never the 1,900 its request reserved
        assert 24 + 5 + 9 <= completion < 24 + 5 + 1900, completion
        assert prompt > 0


def test_a_plain_request_the_client_abandons_is_charged_its_prompt(tiny_engine: Any, tmp_path: Path) -> None:
    """A client that gives up on a plain request (499): the engine took its prompt, counted by the engine's tokenizer
    like the same request answered; what the engine generated before the abort is not seen, and not charged."""
    key = {"name": "quitter", "key": TOKENS}
    gateway = {**_gateway(tmp_path, key), "admin_keys": ["admin"]}
    headers = {"Authorization": f"Bearer {TOKENS}"}

    async def abandon(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(http.post("/v1/chat/completions", json=chat_body(max_tokens=1900, stream=False, ignore_eos=True), headers=headers), 0.5)

    with serve({"tiny": {"url": tiny_engine.url}}, gateway) as server:
        answered = httpx.post(server.url + "/v1/chat/completions", json=chat_body(max_tokens=3, stream=False, ignore_eos=True), headers=headers, timeout=60).json()
        asyncio.run(abandon(server.url))
        requests, prompt, completion = _settled(server.url, "quitter", 2)
    assert requests == 2
    assert (prompt, completion) == (2 * answered["usage"]["prompt_tokens"], 3), (prompt, completion, answered["usage"])


def test_a_day_budget_holds_under_a_burst_and_across_a_restart(tiny_engine: Any, tmp_path: Path) -> None:
    key = {"name": "budgeted", "key": BUDGETED, "limits": {"tokens_per_day": 300}}
    gateway = {**_gateway(tmp_path, key), "admin_keys": ["admin"]}
    body = chat_body(max_tokens=20, stream=False, ignore_eos=True)
    bound = len(json.dumps(body, separators=(",", ":"))) + 20  # one request's reservation: the stated overshoot

    async def burst(url: str) -> list[int]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            answers = await asyncio.gather(*[http.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {BUDGETED}"}) for _ in range(20)])
        return [answer.status_code for answer in answers]

    with serve({"tiny": {"url": tiny_engine.url}}, gateway) as server:
        statuses = asyncio.run(burst(server.url))
        assert 200 in statuses and 429 in statuses, statuses
        _, prompt, completion = _settled(server.url, "budgeted", statuses.count(200))
        assert prompt + completion <= 300 + bound, (prompt + completion, statuses)
        for _ in range(40):  # spend the rest, one at a time, until the budget says no
            answer = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {BUDGETED}"}, timeout=60)
            if answer.status_code == 429:
                break
        assert answer.status_code == 429 and answer.json()["error"]["code"] == "insufficient_quota", answer.text
    with serve({"tiny": {"url": tiny_engine.url}}, gateway) as server:  # the same state_dir: the same ledger
        again = httpx.post(server.url + "/v1/chat/completions", json=chat_body(max_tokens=200, stream=False, ignore_eos=True), headers={"Authorization": f"Bearer {BUDGETED}"}, timeout=60)
        assert again.status_code == 429 and again.json()["error"]["code"] == "insufficient_quota", again.text


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_a_key_at_its_budget_stays_at_it_after_sigkill_and_restart(database: str, tiny_engine: Any, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """``workers: 2``: the control process rebuilds the day budget from the ledger; SIGKILL flushes nothing."""
    usage: dict[str, Any] = {"flush_interval_s": 0.05}
    if database == "postgresql":
        usage["database_url"] = request.getfixturevalue("postgres").url
    key = {"name": "budgeted", "key": BUDGETED, "limits": {"tokens_per_day": 300}}
    gateway = {"keys": [key], "admin_keys": ["admin"], "state_dir": str(tmp_path / "state"), "usage": usage, "workers": 2}
    config = tmp_path / "deploy.yaml"
    config.write_text(yaml.safe_dump({"models": {"tiny": {"url": tiny_engine.url}}, "gateway": gateway}))
    headers = {"Authorization": f"Bearer {BUDGETED}"}
    body = chat_body(max_tokens=40, stream=False, ignore_eos=True)
    with server_process([*CLI, "serve", str(config), "--port", "{port}"], log_path=tmp_path / "first.log", ready_path="/health", timeout_s=90) as server:
        admitted = 0
        for _ in range(40):
            answer = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
            if answer.status_code == 429 and answer.json()["error"]["code"] == "rate_limit_exceeded":  # held by a reservation
                time.sleep(1)
                continue
            if answer.status_code != 200:
                break
            admitted += 1
        assert answer.status_code == 429 and answer.json()["error"]["code"] == "insufficient_quota", answer.text
        _, prompt, completion = _settled(server.url, "budgeted", admitted)
        assert prompt + completion >= 300 - (len(json.dumps(body)) + 40)  # refused only near the budget
        server.stop(signal.SIGKILL, grace_s=0)
    with server_process([*CLI, "serve", str(config), "--port", "{port}"], log_path=tmp_path / "second.log", ready_path="/health", timeout_s=90) as server:
        statuses: dict[str, list[int]] = {}  # worker -> its answers (each request a new connection: either worker)
        for _ in range(40):
            again = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
            statuses.setdefault(again.headers["x-gateway-worker"], []).append(again.status_code)
            if len(statuses) == 2 and min(map(len, statuses.values())) >= 3:
                break
        # the budget goes on from the ledger: at most one more request per worker (one that ran alone), then spent on both
        more = sum(answers.count(200) for answers in statuses.values())
        assert len(statuses) == 2 and min(map(len, statuses.values())) >= 3, statuses
        assert more <= 2 and all(answers[-1] == 429 for answers in statuses.values()), statuses
        assert again.json()["error"]["code"] == "insufficient_quota", again.text
        _, prompt, completion = _settled(server.url, "budgeted", admitted + more)
        assert prompt + completion <= 300 + 2 * (len(json.dumps(body)) + 40)
