"""Replicas: two engines behind one model name (``replicas: 2``), on FAKE engines (tests/fake_engine.py).

What these tests check is the gateway's control plane (its balancer, its watchdog, its rolling swap, the router
it manages), and they kill and replace engines: so the engines are fakes, launched by the gateway itself exactly
as real ones (the engine config's ``python:``; tests/gateway/test_swap_fake_engine.py's ``fake_engine_section``),
and a SIGKILL hits a real process whose connections the kernel resets. The real-engine end-to-end tests of these
capabilities: a gateway over two real replicas, both balancing policies, each engine's own counters and prefix
cache: tests/benchmarks/test_affinity.py; a real engine SIGKILLed under load (behind SGLang's router):
tests/gateway/test_router_upstream.py; a real engine that died restarted by the watchdog: test_swap (h).

One gateway (started from a YAML file, owning its engines) serves the module; every test starts from whatever
the one before left (the YAML it reloads is the current one with its own change). The scenarios:
- requests spread over both replicas; ``/ready``, ``/admin/models`` and the metrics show each replica;
- with prefix affinity, requests that share a system prompt stay on one replica;
- one replica is SIGKILLed under a bounded loop of concurrent streaming and plain SDK requests: no plain
  request fails, the model never answers 503, the replica is restarted and serves again;
- a rolling swap of the two replicas under load: no failed request, never more than replicas + 1 engines alive;
- SGLang's real router (``router:``) put in front of the replicas by a reload (engines untouched): requests go
  through it, one replica SIGKILLed under load (no failed plain request, cut streams end with an error event, no
  internal address in any answer, the router's workers follow the restart), the router itself SIGKILLed
  (requests fall back to the replicas until the watchdog has restarted it), then taken away again by a reload.
  The router takes a fake as a worker: it probes ``/health`` (its ``/server_info`` and ``/model_info`` probes get
  404 and it goes on; the gateway passes it the tokenizer) and relays chat requests as to SGLang.

The numbers are printed (``-s``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.app import app_from_config
from launch.config import load_config
from launch.procgroup import group_pids
from tests.admin_client import AdminClient
from tests.chat import post_chat
from tests.fake_engine import fake_engine_python
from tests.gateway.test_swap import Load, report
from tests.gateway.test_swap_fake_engine import fake_engine_section
from tests.gateway_server import KEY, GatewayServer
from tests.model_code.helpers import engine_children
from tests.waiting import wait_until

ADMIN = "replicas-admin-key"


def _deployment(model_dir: Path, *, max_total_tokens: int = 4096, policy: str = "least_in_flight") -> dict[str, Any]:
    engine = {
        "model_path": str(model_dir), "device": "cpu", "dtype": "float32", "max_total_tokens": max_total_tokens,
        "skip_server_warmup": True, "startup_timeout_s": 300,
    }  # fmt: skip
    return {
        "models": {"tiny": {"replicas": 2, "engine": engine}},
        "gateway": {
            "api_keys": [KEY],
            "admin_keys": [ADMIN],
            "drain_timeout_s": 60,
            "watchdog": {"interval_s": 0.5, "backoff_initial_s": 0.5},
            "balancing": {"policy": policy, "max_imbalance": 2},
        },
    }


class Rig(AdminClient):
    """The module's gateway; every YAML it writes runs the engines on the fake (``python``)."""

    admin_key = ADMIN
    admin_timeout_s = 900

    def __init__(self, server: GatewayServer, config: Path, model_dir: Path, python: Path) -> None:
        self.server, self.config, self.model_dir, self.python = server, config, model_dir, python
        self.pids: set[int] = set()
        self.current = self.faked(_deployment(model_dir))

    def faked(self, data: dict[str, Any]) -> dict[str, Any]:
        tiny = data["models"]["tiny"]
        return {**data, "models": {"tiny": {**tiny, "engine": fake_engine_section(tiny["engine"], self.python)}}}

    def with_policy(self, policy: str) -> dict[str, Any]:
        """The current deployment with the balancing ``policy``."""
        gateway = self.current["gateway"]
        return {**self.current, "gateway": {**gateway, "balancing": {**gateway["balancing"], "policy": policy}}}

    def router_workers(self) -> list[str]:
        """The worker URLs SGLang's router itself lists (asked with the key only the gateway holds)."""
        route = self.server.app.state.controller.registry.route("tiny")
        assert route is not None and route.front is not None and route.front.router is not None
        return list(route.front.router.workers())

    def model(self) -> dict[str, Any]:
        (model,) = self.listed_models().values()
        self.pids |= {r["engine"]["pid"] for r in model["replicas"] if r["engine"]["pid"]}
        return model

    def served_by(self) -> dict[str, float]:
        return self.metric_values({r: ("gateway_replica_requests_total", {"model": "tiny", "replica": r}) for r in ("0", "1")})

    def reload(self, data: dict[str, Any]) -> dict[str, Any]:
        self.current = data = self.faked(data)
        self.config.write_text(yaml.safe_dump(data, sort_keys=False))
        response = self.admin("POST", "/admin/reload")
        assert response.status_code == 200, response.text
        return response.json()


@pytest.fixture(scope="module")
def rig(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    tmp = tmp_path_factory.mktemp("replicas")
    python = fake_engine_python(tmp)
    config = tmp / "deploy.yaml"
    started = time.monotonic()
    rig = Rig(None, config, tiny_model_dir, python)  # type: ignore[arg-type]
    config.write_text(yaml.safe_dump(rig.current, sort_keys=False))
    app, settings = app_from_config(load_config(config), log_dir=tmp / "logs")
    server = rig.server = GatewayServer(app, settings).start(timeout_s=120)
    report("replicas up", start_s=round(time.monotonic() - started, 1), ports=[r["engine"]["port"] for r in rig.model()["replicas"]])
    try:
        yield rig
    finally:
        server.stop()
        assert not [pid for pid in rig.pids if group_pids(pid)], "engine process groups still alive after shutdown"


def test_requests_spread_over_both_replicas(rig: Rig) -> None:
    model = rig.model()
    assert model["state"] == "ready" and model["ready_replicas"] == 2
    assert len({r["engine"]["port"] for r in model["replicas"]}) == 2
    assert len({r["engine"]["pid"] for r in model["replicas"]}) == 2
    ready = httpx.get(rig.server.url + "/ready", timeout=30).json()
    assert ready["models"]["tiny"] == {"ready": True, "replicas_ready": 2}
    before = rig.served_by()
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda n: post_chat(rig.server.url, "tiny", f"question {n}"), range(48)))
    assert all(answer.status_code == 200 for answer in answers)
    after = rig.served_by()
    counts = {replica: after[replica] - before[replica] for replica in after}
    report("spread (least in flight, 8 concurrent)", requests=48, per_replica=counts)
    assert sum(counts.values()) == 48 and min(counts.values()) > 0, counts


def test_prefix_affinity_keeps_a_system_prompt_on_one_replica(rig: Rig) -> None:
    before_policy = rig.current["gateway"]["balancing"]["policy"]
    outcome = rig.reload(rig.with_policy("prefix_affinity"))
    assert outcome["settings_changed"] == ["balancing"] and rig.model()["ready_replicas"] == 2
    system = "You grade documents about data platforms. " * 20
    before = rig.served_by()
    for n in range(12):
        assert post_chat(rig.server.url, "tiny", f"document {n}", system=system).status_code == 200
    after = rig.served_by()
    counts = {replica: after[replica] - before[replica] for replica in after}
    report("prefix affinity, one system prompt", requests=12, per_replica=counts)
    assert sorted(counts.values()) == [0, 12], counts
    before = after
    for n in range(16):  # different system prompts spread (rendezvous hashing over the two replicas)
        assert post_chat(rig.server.url, "tiny", "same question", system=f"persona {n}").status_code == 200
    after = rig.served_by()
    assert min(after[r] - before[r] for r in after) > 0
    rig.reload(rig.with_policy(before_policy))


def _kill_replica_until_back(rig: Rig, index: int, pid: int) -> tuple[float, float]:
    """SIGKILL replica ``index``'s engine ``pid``; wait until both replicas are ready again, that one on a new
    engine. (when it was killed, when it was back)"""
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    wait_until(
        lambda: (m := rig.model())["ready_replicas"] == 2 and m["replicas"][index]["engine"]["pid"] != pid,
        lambda: f"replica {index} not back: {rig.model()}", 300, every_s=0.25,
    )  # fmt: skip
    return killed, time.monotonic()


def test_sigkill_of_one_replica_under_load(rig: Rig) -> None:
    model = rig.model()
    victim = model["replicas"][0]["engine"]["pid"]
    restarts = [r["restarts"] for r in model["replicas"]]
    with Load(rig.server.url, workers=3) as load:
        load.wait_for_requests(6, 0)
        killed, back = _kill_replica_until_back(rig, 0, victim)
        load.wait_for_requests(6, back)
    kinds = load.counts(load.outcomes)
    plain_failures = [o for o in load.outcomes if not o.stream and o.kind != "ok"]
    assert not plain_failures, plain_failures[:3]  # retried on the other replica
    assert not [o for o in load.outcomes if o.kind == "503"], "the model answered 503 while a replica was healthy"
    cut = [o for o in load.outcomes if o.kind == "stream_cut"]
    assert all(o.started < killed for o in cut), "only streams running on the killed replica may be cut"
    after = rig.model()
    assert [r["restarts"] for r in after["replicas"]] == [restarts[0] + 1, restarts[1]]
    report(
        "SIGKILL of replica 0 under load", requests=len(load.outcomes), outcomes=kinds, streams_cut=len(cut),
        replica_back_after_s=round(back - killed, 1), old_pid=victim, new_pid=after["replicas"][0]["engine"]["pid"],
    )  # fmt: skip


def test_rolling_swap_under_load(rig: Rig) -> None:
    replicas = rig
    before = replicas.model()
    old_pids = {r["engine"]["pid"] for r in before["replicas"]}
    alive: list[int] = []
    stop = threading.Event()
    others = set(engine_children()) - old_pids  # engines of other tests in this session (the shared one)

    def count_engines() -> None:
        while not stop.is_set():
            alive.append(len(set(engine_children()) - others))
            time.sleep(0.1)

    counter = threading.Thread(target=count_engines, daemon=True)
    counter.start()
    try:
        with Load(replicas.server.url, workers=3) as load:
            load.wait_for_requests(4, 0)
            t0 = time.monotonic()
            tiny = replicas.current["models"]["tiny"]
            tokens = 2048 if tiny["engine"]["max_total_tokens"] != 2048 else 4096  # the other size than now
            changed = {**tiny, "engine": {**tiny["engine"], "max_total_tokens": tokens}}
            outcome = replicas.reload({**replicas.current, "models": {"tiny": changed}})
            done = time.monotonic()
            load.wait_for_requests(4, done)
    finally:
        stop.set()
        counter.join(5)
    tiny = outcome["models"]["tiny"]
    assert outcome["ok"] and tiny["action"] == "engine_changed" and tiny["policy"] == "rolling", outcome
    after = replicas.model()
    assert {r["engine"]["pid"] for r in after["replicas"]}.isdisjoint(old_pids) and after["ready_replicas"] == 2
    kinds = load.counts(load.outcomes)
    assert set(kinds) == {"ok"}, kinds  # nothing failed, nothing refused, no stream cut
    assert max(alive) <= 3, f"more than replicas + 1 engines alive: {max(alive)}"
    report(
        "rolling swap under load", requests=len(load.outcomes), outcomes=kinds, swap_s=round(done - t0, 1),
        max_engines_alive=max(alive), engines_before=2,
    )  # fmt: skip


def test_managed_router_in_front_of_the_replicas(rig: Rig) -> None:
    engines = {r["engine"]["pid"] for r in rig.model()["replicas"]}
    routed = {**rig.current, "models": {"tiny": {**rig.current["models"]["tiny"], "router": {"policy": "round_robin"}}}}
    outcome = rig.reload(routed)
    assert outcome["ok"] and outcome["models"]["tiny"]["changed"] == ["router"], outcome
    model = rig.model()
    router = model["router"]
    assert router["running"] and router["url"].startswith("http://127.0.0.1:")
    assert {r["engine"]["pid"] for r in model["replicas"]} == engines  # the engines were not touched
    assert httpx.get(router["url"] + "/workers", timeout=10).status_code == 401  # its API takes the replicas' key
    assert sorted(rig.router_workers()) == sorted(r["url"] for r in model["replicas"])

    before = rig.served_by()
    for n in range(4):
        assert post_chat(rig.server.url, "tiny", f"through the router {n}").status_code == 200
    assert rig.served_by() == before  # the router chose, not the gateway's balancer

    internal = {str(r["engine"]["port"]) for r in model["replicas"]} | {router["url"].rsplit(":", 1)[1]}
    victim = model["replicas"][1]["engine"]["pid"]
    with Load(rig.server.url, workers=3) as load:
        load.wait_for_requests(6, 0)
        killed, back = _kill_replica_until_back(rig, 1, victim)
        # the router's workers follow the restart (checked before the router itself is restarted, which would
        # start it in front of the replicas of the moment anyway)
        replicas_now = sorted(r["url"] for r in rig.model()["replicas"])
        wait_until(  # the router adds a worker in the background, in milliseconds
            lambda: sorted(rig.router_workers()) == replicas_now,
            lambda: f"the router's workers {sorted(rig.router_workers())} are not the replicas {replicas_now}", 10,
        )  # fmt: skip
        load.wait_for_requests(6, back)
        # the router itself dies: requests go to the replicas directly until the watchdog restarts it
        router_pid = rig.model()["router"]["pid"]
        os.kill(router_pid, signal.SIGKILL)
        wait_until(
            lambda: (m := rig.model()).get("router", {}).get("running") and m["router"]["pid"] != router_pid,
            lambda: f"router not restarted: {rig.model().get('router')}", 120, every_s=0.25,
        )  # fmt: skip
        load.wait_for_requests(6, time.monotonic())
    kinds = load.counts(load.outcomes)
    assert not [o for o in load.outcomes if not o.stream and o.kind != "ok"], kinds
    assert all(o.started < killed or o.kind != "stream_cut" or o.started >= back for o in load.outcomes)
    leaks = [o.detail for o in load.outcomes if o.detail and any(f":{port}" in o.detail for port in internal)]
    assert not leaks, leaks[:3]
    model = rig.model()
    assert sorted(rig.router_workers()) == sorted(r["url"] for r in model["replicas"])  # the restarted router's too
    report("managed router: engine and router SIGKILLed under load", requests=len(load.outcomes), outcomes=kinds,
           replica_back_after_s=round(back - killed, 1))  # fmt: skip

    plain = {**rig.current, "models": {"tiny": {k: v for k, v in rig.current["models"]["tiny"].items() if k != "router"}}}
    assert rig.reload(plain)["ok"]
    assert "router" not in rig.model()
