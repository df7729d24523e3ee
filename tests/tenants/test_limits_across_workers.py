"""A named key's limits hold across ``gateway.workers: 2`` (``sglang-gateway serve`` as a user runs it, in front
of the benchmarks' FAKE upstream): requests on fresh connections spread over both workers, and together they
admit no more than the key's limit (within what refills meanwhile), nor much fewer."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from benchmarks import processes
from tests.gateway.test_workers import WORKER, serve
from tests.servers import ServerProcess

KEY = "sk-tenant-across-workers"
LIMIT = 10  # requests per minute


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("limits-across-workers")
    with processes.fake_upstream("starlette", tmp) as (upstream, _):
        config = {
            "gateway": {"workers": 2, "keys": [{"name": "batch", "key": KEY, "limits": {"requests_per_minute": LIMIT}}]},
            "models": {"m": {"url": upstream}},
        }
        server = serve(config, Path(tmp))
        try:
            yield server
        finally:
            server.stop()


def test_requests_per_minute_hold_across_two_workers(gateway: ServerProcess) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    outcomes = []
    started = time.monotonic()
    with httpx.Client(base_url=gateway.url, headers={"authorization": f"Bearer {KEY}"}, timeout=30,
                      limits=httpx.Limits(max_keepalive_connections=0)) as client:  # fmt: skip
        for _ in range(30):
            response = client.post("/v1/chat/completions", json=body)
            outcomes.append((response.status_code, response.headers[WORKER], response.headers.get("retry-after")))
            time.sleep(0.06)  # a client that keeps asking: the workers' rounds (every ~0.1 s) keep up
    elapsed = time.monotonic() - started
    admitted = [o for o in outcomes if o[0] == 200]
    refused = [o for o in outcomes if o[0] == 429]
    assert len(admitted) + len(refused) == 30, outcomes
    assert {worker for _, worker, _ in admitted} == {"0", "1"}, outcomes  # both workers served the key
    refilled = math.ceil(elapsed * LIMIT / 60)
    assert len(admitted) <= LIMIT + refilled, (len(admitted), refilled, outcomes)  # one worker alone would admit 10
    assert len(admitted) >= LIMIT - 2, (len(admitted), outcomes)  # shares handed back each round
    assert all(retry is not None and int(retry) >= 1 for _, _, retry in refused)
