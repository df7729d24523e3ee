"""The event loop wakes for work, not for timers of its own: a sparse stream costs about one pass of the loop per
event or less (the native relay thread writes its events without the loop), and an idle gateway with batches and a
ledger configured but unused schedules nothing of theirs.

Counted, not timed: the gateway is served on an asyncio loop that counts its passes and who schedules its timers
(:mod:`tests.loop_count`). The engine is a FAKE at the TCP level that sends an event every 50 ms (a decode step):
the real engine's pace cannot be set.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.config import gateway_settings
from gateway.core.registry import build_registry
from gateway.data.native_streams import BUILT as NATIVE_BUILT
from launch.config import parse_config
from tests.fake_upstreams import SSE_HEAD, fake_answering_upstream, http_chunk, read_request
from tests.gateway_server import GatewayServer
from tests.loop_count import COUNTING_LOOP, TALLY
from tests.waiting import wait_until

EVENTS = 40
STEP_S = 0.05  # between two of the fake's events
ROLE = b'data: {"id":"c1","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
TOKEN = b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"tok "},"finish_reason":null}]}\n\n'
FINISH = b'data: {"id":"c1","choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":null}\n\n'
DONE = b"data: [DONE]\n\n"


def _paced(conn: socket.socket) -> None:
    """A FAKE engine's chat stream: the head and role at once, then a token every STEP_S, then the finish and end."""
    with conn:
        try:
            read_request(conn)
            conn.sendall(SSE_HEAD + http_chunk(ROLE))
            for _ in range(EVENTS):
                time.sleep(STEP_S)
                conn.sendall(http_chunk(TOKEN))
            conn.sendall(http_chunk(FINISH) + http_chunk(DONE) + b"0\r\n\r\n")
        except OSError:
            return


@contextmanager
def _counted_gateway(models: dict[str, Any], gateway: dict[str, Any]) -> Iterator[GatewayServer]:
    """The gateway of ``models`` / ``gateway`` served by uvicorn on a counting loop."""
    deployment = parse_config({"models": models, "gateway": gateway})
    settings = gateway_settings(deployment)
    server = GatewayServer(create_app(settings, build_registry(deployment, settings)), settings)
    server.server.config.loop = COUNTING_LOOP
    server.start()
    try:
        yield server
    finally:
        TALLY.stop()
        server.stop()


def _stream(url: str) -> int:
    """One streamed chat through the gateway; the count of its token events."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    tokens = 0
    with httpx.Client(timeout=60, trust_env=False) as client, client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            tokens += '"content":"tok "' in line
    return tokens


@pytest.mark.parametrize(
    "relay", ["native", "python"], ids=["native relay", "python relay, no rests"]
)  # fmt: skip
def test_a_sparse_stream_wakes_the_loop_about_once_per_event_or_less(relay: str) -> None:
    """Events 50 ms apart: the loop passes the stream costs (its request, its events, its end, and any timer that
    ticks meanwhile) are at most 3 per event on average. Relayed natively, the events need no pass at all; relayed in
    Python with rests off, one pass each. A timer that probes every few milliseconds while a stream runs is 10-20."""
    if relay == "native" and not NATIVE_BUILT:
        pytest.skip("the native relay is not built in this install")
    settings = {"relay_native": True} if relay == "native" else {"relay_native": False, "stream_coalesce_ms": 0}
    with fake_answering_upstream(_paced) as url, _counted_gateway({"m": {"url": url}}, settings) as gateway:
        TALLY.start()
        tokens = _stream(gateway.url)
        TALLY.stop()
        pool = gateway.state.proxy.streams
        native = (pool.native_stats() or {}).get("events", 0)
    assert tokens == EVENTS
    if relay == "native":
        assert native >= EVENTS // 2, native  # the stream was the native thread's
    per_event = TALLY.passes / tokens
    assert per_event <= 3, (per_event, TALLY.passes, TALLY.timers.most_common(5))


def test_an_idle_gateway_with_batches_and_a_ledger_schedules_no_poll_of_theirs(tmp_path: Path) -> None:
    """A state_dir (so the batch API and the usage ledger are on) but no batch and no request: over a window of five
    of their poll intervals, neither the batch runner nor the ledger's writer nor residency schedules a timer; the
    loop's only timers are uvicorn's once-a-second tick (and the watchdog's)."""
    gateway = {"state_dir": str(tmp_path), "batches": {"poll_interval_s": 0.1}, "usage": {"flush_interval_s": 0.1}}
    with fake_answering_upstream(_paced) as url, _counted_gateway({"m": {"url": url}}, gateway) as server:
        assert server.app.state.batches is not None and server.app.state.batches.runner is not None
        ledger = server.state.ledger
        assert ledger.enabled
        wait_until(lambda: ledger._ready, "the ledger's writer did not open its database")  # the start's own work done
        time.sleep(0.1)  # (the writer from its first write to its wait; the runner's first look finds no database)
        TALLY.start()
        time.sleep(0.5)
        TALLY.stop()
    polls = {where: n for where, n in TALLY.timers.items() if where.startswith(("batches/", "tenants/", "control/residency"))}
    assert polls == {}, TALLY.timers
    assert set(TALLY.timers) <= {"edge/ticks.py:main_loop", "control/watchdog.py:run"}, TALLY.timers
