"""Priority classes in a model's queue, through the gateway: with the model's one slot taken, a request of a key
with a higher class waiting behind 20 queued requests of a lower class is served next, and so is one whose
``x-gateway-priority`` header picks a higher class of its key. Upstream: the benchmarks' FAKE decode loop (one token
per stream every 20 ms), so requests hold their slot for a known time. The class reaches an engine that schedules by
priority: one the gateway launched (a FAKE engine process), and a ``url:`` model's server that says it does."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from loguru import logger

from benchmarks import processes
from tests.fake_engine import fake_engine_python, running_fake_engine
from tests.gateway_server import GatewayServer, serve
from tests.leaks import leaves_nothing
from tests.servers import CLI, ServerProcess
from tests.waiting import wait_until

BATCH, CHAT, PLAIN = "sk-batch-prio-0123456789", "sk-chat-prio-0123456789", "sk-plain-prio-0123456789"
LIMITS = {"max_concurrent": 1, "max_queue": 40, "queue_timeout_s": 60}  # one request upstream, the others queued
QUEUED_TOKENS = 10  # each queued request holds the slot 10 steps (200 ms)


@pytest.fixture(scope="module")
def paced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with processes.fake_upstream("paced", tmp_path_factory.mktemp("paced"), step_ms=20) as (url, _):
        yield url


def _stream(url: str, key: str, tokens: int, name: str, priority: str | None = None) -> threading.Thread:
    def run() -> None:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens, "stream": True}
        headers = {"authorization": f"Bearer {key}", "x-request-id": name, **({"x-gateway-priority": priority} if priority else {})}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=60) as response:
            assert response.status_code == 200, response.read()
            response.read()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _served_order(server: GatewayServer, low: int, high: tuple[str, str | None], lows: int = 20) -> list[str]:
    """The order in which the gateway ended the requests (each named by its request id): a 6 s holder of the model's
    one slot, ``lows`` requests of key ``low`` queued behind it, then one of ``high`` (key, x-gateway-priority header).

    Read from the gateway's own request records, in the order its loop wrote them: with one slot, a request cannot end
    before the one ahead of it has. (Read from when each client thread saw its end, two ends 200 ms apart were seen
    swapped on a loaded machine: a thread woken late.)"""
    limiter = server.state.registry.route("m").limiter

    def queued(count: int) -> None:
        wait_until(lambda: limiter.waiting >= count, lambda: f"{limiter.waiting} of {count} queued", 30, every_s=0.005)

    ended: list[str] = []
    sink = logger.add(lambda message: ended.append(message.record["extra"]["request_id"]), filter=_a_request_record, level="INFO")
    try:
        threads = [_stream(server.url, BATCH, 300, "holder")]  # 6 s on the one slot: time to queue the others
        while limiter.in_flight < 1:
            time.sleep(0.005)
        for index in range(lows):
            threads.append(_stream(server.url, BATCH, QUEUED_TOKENS, f"low-{index}"))
            queued(index + 1)
        threads.append(_stream(server.url, high[0], QUEUED_TOKENS, "high", high[1]))
        queued(lows + 1)
        for thread in threads:
            thread.join(60)
    finally:
        logger.remove(sink)
    return [name for name in ended if name == "holder" or name == "high" or name.startswith("low-")]


def _a_request_record(record: Any) -> bool:
    return record["extra"].get("path") == "/v1/chat/completions" and "request_id" in record["extra"]


def test_a_higher_class_waiting_behind_twenty_lower_ones_is_served_next(paced: str) -> None:
    keys = [{"name": "batch", "key": BATCH, "priority": 0}, {"name": "chat", "key": CHAT, "priority": 5}]
    with serve({"m": {"url": paced}}, {"keys": keys, "limits": LIMITS}) as server:
        order = _served_order(server, BATCH, (CHAT, None))
    assert len(order) == 22 and order[:2] == ["holder", "high"], order
    assert order[2:] == [f"low-{index}" for index in range(20)], order  # the others in their order of arrival


def test_a_class_picked_with_the_header_goes_ahead_of_the_keys_own(paced: str) -> None:
    # one key: its own class (normal, 0) for the queued ones, the header's (urgent, 5) for the last
    keys = [{"name": "batch", "key": BATCH, "priority": "normal", "allowed_priorities": ["urgent"]}]
    gateway = {"keys": keys, "limits": LIMITS, "priority_classes": {"normal": 0, "urgent": 5}}
    with serve({"m": {"url": paced}}, gateway) as server:
        order = _served_order(server, BATCH, (BATCH, "urgent"), lows=10)
    assert len(order) == 12 and order[:2] == ["holder", "high"], order
    assert order[2:] == [f"low-{index}" for index in range(10)], order


def test_an_engine_with_priority_scheduling_gets_the_keys_class(tmp_path: Path, tiny_model_dir: Path) -> None:
    # A FAKE engine the gateway launches with enable_priority_scheduling: it answers with the priority it received.
    engine = {"model_path": str(tiny_model_dir), "device": "cpu", "python": str(fake_engine_python(tmp_path)), "enable_priority_scheduling": True}
    config = {
        "gateway": {"workers": 1, "api_keys": [PLAIN], "keys": [{"name": "chat", "key": CHAT, "priority": 5}, {"name": "any", "key": BATCH}]},
        "models": {"m": {"engine": engine}},
    }
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(config))
    with leaves_nothing(shm=False) as check:
        server = ServerProcess([*CLI, "serve", str(path), "--port", "{port}"], log_path=tmp_path / "gateway.log")
        check.watch(server.pid)
        try:
            server.wait_http("/health", timeout_s=120)

            def priority(key: str, **extra: Any) -> Any:
                body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **extra}
                response = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=60)
                assert response.status_code == 200, response.text
                return response.json()["fake_priority"]

            assert server.wait_until(lambda: priority(CHAT) == 5, 60, "the engine to answer")
            assert priority(CHAT, priority=99) == 5  # the key's class, not the client's
            assert priority(PLAIN, priority=2) == 2 and priority(PLAIN) is None  # plain keys: as sent
            assert priority(BATCH, priority=3) == 3  # a named key without a class: as sent
        finally:
            assert server.stop(signal.SIGTERM, grace_s=30) == 0, server.log(3000)


def test_a_url_models_server_with_priority_scheduling_gets_the_class(tmp_path: Path) -> None:
    # A FAKE engine run by someone else (it answers with the priority it received), behind two url models: one says
    # its server schedules by priority, the other does not.
    with running_fake_engine(tmp_path) as engine:
        models = {"m": {"url": engine, "enable_priority_scheduling": True}, "other": {"url": engine, "served_model_name": "m"}}
        keys = [{"name": "chat", "key": CHAT, "priority": 5, "allowed_priorities": [-2]}, {"name": "any", "key": BATCH}]
        with serve(models, {"api_keys": [PLAIN], "keys": keys}) as server:

            def priority(key: str, model: str = "m", header: str | None = None, **extra: Any) -> Any:
                body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **extra}
                headers = {"authorization": f"Bearer {key}", **({"x-gateway-priority": header} if header else {})}
                response = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
                assert response.status_code == 200, response.text
                return response.json()["fake_priority"]

            assert priority(CHAT) == 5 and priority(CHAT, priority=99) == 5  # the key's class, not the client's
            assert priority(CHAT, header="-2") == -2  # the one its header picks
            assert priority(PLAIN, priority=2) == 2 and priority(BATCH) is None  # keys without a class: as sent
            assert priority(CHAT, "other") is None and priority(CHAT, "other", priority=7) == 7  # not a priority scheduler
