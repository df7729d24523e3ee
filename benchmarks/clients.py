"""What the gateway's upstream HTTP client costs: CPU per streamed request of aiohttp (what the gateway uses,
the session of ``gateway.data.upstream_session.upstream_session``) vs httpx (what it used before, configured as it was) vs
this package's raw asyncio client, against the fake upstream, in this process (CPU measured with
``time.process_time``). Evidence for gateway changes.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from benchmarks.loadgen import Workload, run_batch


async def _httpx(url: str, body: bytes, concurrency: int, requests: int) -> None:
    import httpx

    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=5), limits=limits, trust_env=False) as client:
        left = requests

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                request = client.build_request(
                    "POST", url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
                )
                response = await client.send(request, stream=True)
                try:
                    async for _ in response.aiter_raw():
                        pass
                finally:
                    await response.aclose()

        await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _aiohttp(url: str, body: bytes, concurrency: int, requests: int) -> None:
    from gateway.data.upstream_session import upstream_session

    async with upstream_session(5.0, 600.0, 256) as session:
        left = requests

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                async with session.post(
                    url + "/v1/chat/completions", data=body, headers={"content-type": "application/json"}
                ) as response:
                    async for _ in response.content.iter_any():
                        pass

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def measure(url: str, concurrency: int, requests: int, output_tokens: int) -> list[dict[str, Any]]:
    from benchmarks.loadgen import new_event_loop

    workload = Workload(stream=True, output_tokens=output_tokens)
    body = workload.body()
    rows = []
    kinds = {
        "aiohttp (gateway's client)": lambda n: _aiohttp(url, body, concurrency, n),
        "httpx (gateway's client before)": lambda n: _httpx(url, body, concurrency, n),
        "raw asyncio (bench loadgen)": lambda n: run_batch(url, workload, concurrency, n),
    }
    loop = new_event_loop()
    try:
        for _round in range(2):  # two alternating rounds: share the machine's noise
            for name, make in list(kinds.items()):
                if _round == 0:
                    try:
                        loop.run_until_complete(make(min(requests, 2 * concurrency)))  # warm-up, imports
                    except ImportError:
                        kinds[name] = None
                if kinds[name] is None:
                    continue
                cpu, wall = time.process_time(), time.perf_counter()
                loop.run_until_complete(make(requests))
                rows.append(
                    {
                        "client": name,
                        "round": _round,
                        "cpu_ms_per_req": 1000 * (time.process_time() - cpu) / requests,
                        "wall_s": time.perf_counter() - wall,
                    }
                )
    finally:
        loop.close()
    return rows
