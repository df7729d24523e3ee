"""Streams at GPU batch sizes through the gateway, against the FAKE decode-loop upstream (``benchmarks.paced_upstream``).

The real CPU engine runs a handful of requests at once; a GPU engine runs hundreds, each fed one event per
decode step. The fake does exactly that with no model, so that the gateway's ceilings (connections, pools,
limits) show up here rather than on a GPU host: a thousand concurrent streams through the default settings
all complete, and a deliberately small configured pool answers what docs/configuration.md says, never a 504.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from benchmarks.apis import CHAT
from benchmarks.loadgen import new_event_loop
from benchmarks.paced import PacedResult, run_paced
from gateway.app import create_app
from gateway.config import GatewaySettings, gateway_settings
from gateway.core.registry import build_registry
from gateway.server import uvicorn_config
from launch.config import parse_config
from tests.chat import chat_body
from tests.fake_upstreams import fake_stalled_upstream
from tests.gateway.helpers import assert_openai_error
from tests.gateway.test_stream_pool import Behind
from tests.gateway_server import GatewayServer, serve
from tests.servers import REPO, ServerProcess, server_process

TOKENS = 20


@pytest.fixture(scope="module")
def paced_fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("paced") / "paced-upstream.log"
    argv = [sys.executable, "-m", "benchmarks.paced_upstream", "--port", "{port}", "--step-ms", "20"]
    with server_process(argv, log_path=log, ready_path="/health", timeout_s=60) as server:
        yield server


def _paced(gateway: GatewayServer, streams: int, ramp_s: float, timeout_s: float) -> PacedResult:
    """``streams`` paced chat streams of TOKENS tokens through ``gateway``, started over ``ramp_s``."""
    loop = new_event_loop()
    try:
        return loop.run_until_complete(run_paced(gateway.url, CHAT, streams, TOKENS, ramp_s=ramp_s, timeout_s=timeout_s, model="m"))
    finally:
        loop.close()


def test_a_thousand_concurrent_long_streams_through_the_default_settings_all_complete(paced_fake: ServerProcess) -> None:
    with serve({"m": {"url": paced_fake.url}}) as gateway:  # every gateway setting at its default
        result = _paced(gateway, 1000, ramp_s=1.0, timeout_s=120)
    # each stream: its role chunk + TOKENS content chunks + a finish chunk + usage + [DONE]
    assert (result.completed, result.statuses) == (1000, {}), result.summary()
    assert result.events == 1000 * (TOKENS + 4)
    assert len(result.ttft) == 1000


def test_a_few_streams_through_the_default_settings_get_every_event_as_it_comes(paced_fake: ServerProcess) -> None:
    """50 streams through the gateway's default settings are read as the engine sends them, each token's event on
    its own, like 50 streams read from the engine directly at the same time on the same client loop: a busy
    machine makes a late client find two events in one read on both paths alike, while a gateway that held events
    back (rests, ``stream_coalesce_ms``) would bring them together at about a third of the reads."""
    with serve({"m": {"url": paced_fake.url}}) as gateway:

        async def both() -> tuple[PacedResult, PacedResult]:
            return await asyncio.gather(
                run_paced(gateway.url, CHAT, 50, TOKENS, ramp_s=0.2, timeout_s=60, model="m"),
                run_paced(paced_fake.url, CHAT, 50, TOKENS, ramp_s=0.2, timeout_s=60, model="m"),
            )

        loop = new_event_loop()
        try:
            through, direct = loop.run_until_complete(both())
        finally:
            loop.close()
    summaries = {"gateway": through.summary(), "direct": direct.summary()}
    assert (through.completed, through.statuses, through.events) == (50, {}, 50 * (TOKENS + 4)), summaries
    assert direct.completed == 50, summaries
    # reads that brought events after each stream's first: ~50 x 19 on a quiet machine; coalesced: < 0.6 of that
    assert len(through.gaps) >= 0.8 * len(direct.gaps), summaries
    # one decode step apart, not one coalescing window (>= 40 ms)
    assert summaries["gateway"]["gap_p50_ms"] < max(30.0, summaries["direct"]["gap_p50_ms"] + 10), summaries


def test_coalesced_streams_all_complete_with_their_events_arriving_together(paced_fake: ServerProcess) -> None:
    """The Python relay (the native one needs no rests) in a process behind its work, ``stream_coalesce_ms: 60``
    against 20 ms decode steps: every stream and event
    arrives, most events in the same read as others (without rests, the client reads each token's event on its
    own, one step apart)."""
    with serve({"m": {"url": paced_fake.url}}, {"stream_coalesce_ms": 60, "relay_native": False}) as gateway:
        streams = gateway.state.proxy.streams
        streams.lag = Behind(0.02)
        assert streams.rest_for() == 0.06
        result = _paced(gateway, 50, ramp_s=0.2, timeout_s=60)
    assert (result.completed, result.statuses, result.events) == (50, {}, 50 * (TOKENS + 4)), result.summary()
    assert len(result.gaps) < 0.6 * 50 * TOKENS, result.summary()  # reads that brought events, after each stream's first
    assert result.summary()["gap_p50_ms"] >= 40, result.summary()  # ~one window apart, not one step


@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
def test_a_coalesced_stream_the_client_cuts_closes_its_engine_connection(paced_fake: ServerProcess, native: bool) -> None:
    """A process behind its work, so resting (the Python relay; the native one rests not at all): a client gone
    mid-stream, during a rest or not, has its engine connection closed (the engine aborts the request), not kept for
    reuse."""
    with serve({"m": {"url": paced_fake.url}}, {"relay_native": native}) as gateway, httpx.Client(timeout=30) as http:
        streams = gateway.state.proxy.streams
        streams.lag = Behind(0.02)
        with http.stream("POST", gateway.url + "/v1/chat/completions", json=chat_body("m", max_tokens=150, stream=True)) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: ")).startswith("data: {")
            assert streams.rest_for() > 0
        for _ in range(100):  # the gateway sees the client go, and the engine connection's close completes
            if streams.busy == 0 and not streams._open:
                break
            threading.Event().wait(0.02)
        assert streams.busy == 0 and not streams._open, "the engine connection was kept after the client left"


def test_a_small_configured_pool_answers_503_upstream_pool_full_never_504(paced_fake: ServerProcess) -> None:
    gateway_settings = {"upstream_max_connections": 2, "upstream_connect_timeout_s": 0.5}
    with serve({"m": {"url": paced_fake.url}}, gateway_settings) as gateway, httpx.Client(base_url=gateway.url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=chat_body("m", max_tokens=150, stream=True)) as first, http.stream(
            "POST", "/v1/chat/completions", json=chat_body("m", max_tokens=150, stream=True)
        ) as second:
            assert first.status_code == second.status_code == 200
            refused = http.post("/v1/chat/completions", json=chat_body("m", max_tokens=TOKENS, stream=True))
            body = assert_openai_error(refused, 503, "upstream_pool_full")
            assert refused.headers["retry-after"] == "1" and "upstream_max_connections" in body["error"]["message"]
            first.close()
        for _ in range(50):  # the closed stream's connection is given back: the next request gets one
            answer = http.post("/v1/chat/completions", json=chat_body("m", max_tokens=TOKENS, stream=False))
            if answer.status_code == 200:
                break
        assert answer.status_code == 200, answer.text
        assert gateway.state.proxy.streams.busy == 0


def test_plain_requests_waiting_for_a_capped_pool_get_503_upstream_pool_full() -> None:
    settings = {"upstream_max_connections": 1, "upstream_connect_timeout_s": 0.5, "upstream_read_timeout_s": 3}
    with fake_stalled_upstream() as stalled, serve({"m": {"url": stalled}}, settings) as gateway:

        async def two() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
                held = asyncio.ensure_future(http.post("/v1/chat/completions", json=chat_body("m", max_tokens=TOKENS, stream=False)))
                await asyncio.sleep(0.3)  # the first holds the only connection (the fake never answers)
                return [await http.post("/v1/chat/completions", json=chat_body("m", max_tokens=TOKENS, stream=False)), await held]

        refused, timed_out = asyncio.run(two())
    assert_openai_error(refused, 503, "upstream_pool_full")
    assert_openai_error(timed_out, 504, "upstream_timeout")  # the engine itself never answered: that one is the engine's


class _PlainUvicornGateway(GatewayServer):
    """The gateway under uvicorn's own httptools protocol (not the gateway's): no transport for the relay."""

    def __init__(self, app: FastAPI, settings: GatewaySettings) -> None:
        super().__init__(app, settings)
        config = uvicorn_config(app, self.settings, log_level="warning")
        config.http = "httptools"
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name=f"plain-gateway-{self.port}", daemon=True)


def test_streams_relay_alike_through_asgi_messages_under_another_server(paced_fake: ServerProcess) -> None:
    """Under a server other than the gateway's own uvicorn protocol, events go out as ASGI messages: same stream."""
    deployment = parse_config({"models": {"m": {"url": paced_fake.url}}})
    settings = gateway_settings(deployment)
    plain = _PlainUvicornGateway(create_app(settings, build_registry(deployment, settings, None)), settings).start()
    try:
        with serve({"m": {"url": paced_fake.url}}) as guarded, httpx.Client(timeout=30) as http:
            ours, theirs = _events(http, guarded.url), _events(http, plain.url)
    finally:
        plain.stop()
    assert len(ours) == len(theirs) == TOKENS + 3  # role chunk, tokens, finish chunk, [DONE]
    assert ours[-1] == theirs[-1] == "data: [DONE]"
    assert [event.split('"created"')[0] for event in ours] == [event.split('"created"')[0] for event in theirs]


def _events(http: httpx.Client, url: str) -> list[str]:
    with http.stream("POST", url + "/v1/chat/completions", json=chat_body("m", max_tokens=TOKENS, stream=True)) as response:
        assert response.status_code == 200
        text = response.read().decode()
    return [event for event in text.split("\n\n") if event]


def test_the_gateway_raises_its_open_file_limit_and_warns_when_streams_would_not_fit() -> None:
    """Each stream holds about three descriptors; a container's default soft limit (often 1024) would cap
    the gateway near 300 streams with EMFILE errors, so it raises the soft limit to the hard one at start."""
    script = (
        "import resource, sys\n"
        "from loguru import logger\n"
        "logger.remove(); logger.add(sys.stdout, format='{message}')\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "from gateway.server import raise_open_file_limit\n"
        "now = raise_open_file_limit(10)\n"
        "print('raised', now == hard or hard == resource.RLIM_INFINITY, resource.getrlimit(resource.RLIMIT_NOFILE)[0] == now)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))\n"
        "raise_open_file_limit(10_000)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert "raised True True" in result.stdout
    assert "open-file limit 256 is below the 30256 that http.max_connections=10000 streams need" in result.stdout
