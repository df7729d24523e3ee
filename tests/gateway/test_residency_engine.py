"""Residency end to end on real SGLang CPU engines: two tiny models in one group capped at one running engine.

The control-plane cases (idle stops and restarts, a busy member, reloads, errors, keep-alives) run on FAKE engines
in tests/gateway/test_residency.py; this one proves the same on the real engine, at three engine starts: concurrent first requests start a once, a
request for b stops a first, b stops when idle, and after a YAML edit of the asleep b its next request starts the
new config.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from launch.procgroup import group_pids
from tests.gateway.test_residency import gateway
from tests.gateway.test_swap import report
from tests.gateway_server import auth
from tests.waiting import wait_until


def _engine(model_dir: Path) -> dict[str, Any]:
    return {"model_path": str(model_dir), "device": "cpu", "dtype": "float32", "max_total_tokens": 2048, "skip_server_warmup": True, "startup_timeout_s": 300}


@pytest.mark.usefixtures("starts_engine")
def test_two_real_engines_take_turns_in_a_group_of_one(tiny_model_dir: Path, tmp_path: Path) -> None:
    group = {"on_demand": True, "group": "gpu0"}
    models = {
        "a": {"engine": _engine(tiny_model_dir), "residency": group},
        "b": {"engine": _engine(tiny_model_dir), "residency": {**group, "idle_stop_s": 3}},
    }
    # the default limits: a cold start (30-90 s here) waits past queue_timeout_s (30 s), bounded by startup_timeout_s;
    # min_resident_s 0: b's request stops a at once (the thrash guard is tested on fake engines)
    settings = {"residency_groups": {"gpu0": {"max_resident": 1, "min_resident_s": 0}}}
    with gateway(tmp_path, models, timeout_s=300, **settings) as rig:  # a cold start on a loaded 2-core machine: 30-90 s
        assert {name: m["state"] for name, m in rig.models().items()} == {"a": "sleeping", "b": "sleeping"}
        with ThreadPoolExecutor(3) as pool:  # concurrent first requests: one start
            answers = list(pool.map(lambda index: rig.chat("a", stream=index == 0), range(3)))
        assert all(answers), answers
        assert rig.metric("gateway_model_wakes_total", model="a", how="started") == 1
        a = rig.models()["a"]
        assert a["state"] == "ready" and a["engine"]["running"], a
        a_pid = a["engine"]["pid"]

        t0 = time.monotonic()
        assert rig.chat("b", stream=True)  # a is idle: stopped, then b started (a group of one)
        waited = time.monotonic() - t0
        now = rig.models()
        assert now["a"]["state"] == "sleeping" and now["b"]["state"] == "ready", now
        assert not group_pids(a_pid), "a's engine still runs beside b's"
        b_started = time.time() - now["b"]["engine"]["uptime_s"]
        stopped = next(e for e in rig.admin("GET", "/admin/models").json()["events"] if e["kind"] == "sleep" and e["model"] == "a")
        assert stopped["at"] <= b_started + 0.5, (stopped, b_started)  # a was gone before b's engine started
        start_s = rig.metric("gateway_model_wake_seconds_sum", model="b")
        assert 0 < start_s <= waited <= start_s + 15, (start_s, waited)  # the wait is the start (and a's stop)
        report("residency: a real engine's cold start in a group of one", cold_start_s=round(start_s, 1), request_waited_s=round(waited, 1))

        b_pid = now["b"]["engine"]["pid"]
        wait_until(  # idle_stop_s: 3; counted once stopped
            lambda: rig.metric("gateway_residency_stops_total", model="b", reason="idle"), lambda: rig.models()["b"], 30, every_s=0.25
        )
        assert rig.metric("gateway_residency_stops_total", model="b", reason="idle") == 1
        assert rig.models()["b"]["state"] == "sleeping" and not group_pids(b_pid), rig.models()["b"]
        assert rig.metric("gateway_engine_restarts_total", model="b") == 0
        ready = httpx.get(rig.server.url + "/ready", headers=auth(), timeout=30)
        assert ready.status_code == 200, ready.text  # both asleep: the gateway still takes their requests

        # a YAML edit of the asleep b: it stays asleep, and its next request starts the new config
        data = yaml.safe_load(rig.path.read_text())
        data["models"]["b"]["engine"]["served_model_name"] = "b-v2"
        rig.path.write_text(yaml.safe_dump(data, sort_keys=False))
        reload = rig.admin("POST", "/admin/reload")
        assert reload.status_code == 200 and reload.json()["ok"], reload.text
        item = reload.json()["models"]["b"]
        assert item["action"] == "engine_changed" and item["changed"] == ["engine.served_model_name"], item
        assert rig.models()["b"]["state"] == "sleeping"
        answer = rig.sdk.chat.completions.create(model="b", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert answer.model == "b-v2" and answer.choices[0].message.content  # the engine the request woke: the new one
        assert rig.models()["b"]["state"] == "ready" and rig.metric("gateway_model_wakes_total", model="b", how="started") == 2
        assert rig.metric("gateway_engine_restarts_total", model="b") == 0  # deliberate stops and starts, no failure
