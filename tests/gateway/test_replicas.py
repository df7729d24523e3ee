"""Replicas: two engines behind one model name, with the real SGLang CPU engine (``replicas: 2``).

One gateway (started from a YAML file, owning its engines) serves the module. In order:
- requests spread over both replicas; ``/ready``, ``/admin/models`` and the metrics show each replica;
- with prefix affinity, requests that share a system prompt stay on one replica;
- one replica is SIGKILLed under a bounded loop of concurrent streaming and plain SDK requests: no plain
  request fails, the model never answers 503, the replica is restarted and serves again.

The rolling swap of the replicas under load (engine starts one after another) and SGLang's router put in front
of the replicas by a reload (the gateway's managed router: a replica and the router SIGKILLed under load) run on
fake engines behind the real router, in tests/gateway/test_swap_fake_engine.py (the blue-green swap under load
keeps its real-engine test in test_swap; the real router in front of real engines, one SIGKILLed under load, is
tests/gateway/test_router_upstream.py).

The numbers are printed (``-s``).
"""

from __future__ import annotations

import os
import signal
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
from tests.gateway.helpers import KEY, GatewayServer, auth, prometheus_value
from tests.gateway.test_swap import Load, report

pytestmark = pytest.mark.engine
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


class Rig:
    def __init__(self, server: GatewayServer, config: Path, model_dir: Path) -> None:
        self.server, self.config, self.model_dir = server, config, model_dir
        self.pids: set[int] = set()
        self.current = _deployment(model_dir)

    def admin(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.request(method, self.server.url + path, headers=auth(ADMIN), timeout=900, **kwargs)

    def router_workers(self) -> list[str]:
        """The worker URLs SGLang's router itself lists (asked with the key only the gateway holds)."""
        route = self.server.app.state.controller.registry.route("tiny")
        assert route is not None and route.front is not None and route.front.router is not None
        return list(route.front.router.workers())

    def model(self) -> dict[str, Any]:
        (model,) = self.admin("GET", "/admin/models").json()["models"]
        self.pids |= {r["engine"]["pid"] for r in model["replicas"] if r["engine"]["pid"]}
        return model

    def served_by(self) -> dict[str, float]:
        text = httpx.get(self.server.url + "/metrics", headers=auth(KEY), timeout=30).text
        return {r: prometheus_value(text, "gateway_replica_requests_total", {"model": "tiny", "replica": r}) or 0 for r in ("0", "1")}

    def reload(self, data: dict[str, Any]) -> dict[str, Any]:
        self.current = data
        self.config.write_text(yaml.safe_dump(data, sort_keys=False))
        response = self.admin("POST", "/admin/reload")
        assert response.status_code == 200, response.text
        return response.json()


@pytest.fixture(scope="module")
def rig(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    tmp = tmp_path_factory.mktemp("replicas")
    config = tmp / "deploy.yaml"
    config.write_text(yaml.safe_dump(_deployment(tiny_model_dir)))
    started = time.monotonic()
    app, settings = app_from_config(load_config(config), log_dir=tmp / "logs")
    server = GatewayServer(app, settings).start(timeout_s=600)
    rig = Rig(server, config, tiny_model_dir)
    report("replicas up", start_s=round(time.monotonic() - started, 1), ports=[r["engine"]["port"] for r in rig.model()["replicas"]])
    try:
        yield rig
    finally:
        server.stop()
        assert not [pid for pid in rig.pids if group_pids(pid)], "engine process groups still alive after shutdown"


def _chat(url: str, content: str, system: str | None = None) -> httpx.Response:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 2}, headers=auth(KEY), timeout=120)


def test_requests_spread_over_both_replicas(rig: Rig) -> None:
    model = rig.model()
    assert model["state"] == "ready" and model["ready_replicas"] == 2
    assert len({r["engine"]["port"] for r in model["replicas"]}) == 2 and len(rig.pids) == 2
    ready = httpx.get(rig.server.url + "/ready", timeout=30).json()
    assert ready["models"]["tiny"] == {"ready": True, "replicas_ready": 2}
    before = rig.served_by()
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda n: _chat(rig.server.url, f"question {n}"), range(48)))
    assert all(answer.status_code == 200 for answer in answers)
    after = rig.served_by()
    counts = {replica: after[replica] - before[replica] for replica in after}
    report("spread (least in flight, 8 concurrent)", requests=48, per_replica=counts)
    assert sum(counts.values()) == 48 and min(counts.values()) > 0, counts


def test_prefix_affinity_keeps_a_system_prompt_on_one_replica(rig: Rig) -> None:
    outcome = rig.reload(_deployment(rig.model_dir, policy="prefix_affinity"))
    assert outcome["settings_changed"] == ["balancing"] and rig.model()["ready_replicas"] == 2
    system = "You grade documents about data platforms. " * 20
    before = rig.served_by()
    for n in range(12):
        assert _chat(rig.server.url, f"document {n}", system=system).status_code == 200
    after = rig.served_by()
    counts = {replica: after[replica] - before[replica] for replica in after}
    report("prefix affinity, one system prompt", requests=12, per_replica=counts)
    assert sorted(counts.values()) == [0, 12], counts
    before = after
    for n in range(16):  # different system prompts spread (rendezvous hashing over the two replicas)
        assert _chat(rig.server.url, "same question", system=f"persona {n}").status_code == 200
    after = rig.served_by()
    assert min(after[r] - before[r] for r in after) > 0
    rig.reload(_deployment(rig.model_dir))


def _kill_replica_until_back(rig: Rig, index: int, pid: int) -> tuple[float, float]:
    """SIGKILL replica ``index``'s engine ``pid``; wait until both replicas are ready again, that one on a new
    engine. (when it was killed, when it was back)"""
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    deadline = killed + 300
    while not ((m := rig.model())["ready_replicas"] == 2 and m["replicas"][index]["engine"]["pid"] != pid):
        assert time.monotonic() < deadline, f"replica {index} not back within 300s: {m}"
        time.sleep(0.25)
    return killed, time.monotonic()


def test_sigkill_of_one_replica_under_load(rig: Rig) -> None:
    model = rig.model()
    victim = model["replicas"][0]["engine"]["pid"]
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
    assert after["replicas"][0]["restarts"] == 1 and after["replicas"][1]["restarts"] == 0
    report(
        "SIGKILL of replica 0 under load", requests=len(load.outcomes), outcomes=kinds, streams_cut=len(cut),
        replica_back_after_s=round(back - killed, 1), old_pid=victim, new_pid=after["replicas"][0]["engine"]["pid"],
    )  # fmt: skip
