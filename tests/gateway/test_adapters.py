"""LoRA adapters in the gateway's control plane, on FAKE engines (tests/fake_engine.py: it answers
``<model>:<adapter>`` only for the adapters it has loaded, from ``--lora-paths`` and then through SGLang's
``/load_lora_adapter`` and ``/unload_lora_adapter``, and says which model a request named).

A reload that adds or removes adapters loads and unloads them in the running engines, every replica, with no
failed request under load; a removed adapter's name is the gateway's 404 at once, an added one's once every
replica serves it; an adapter that fails to load is reported by name while the others serve; a watchdog restart
loads the adapters loaded at run time again. The real engine serving adapters: tests/gateway/test_adapters_engine.py.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.gateway.test_residency import Rig, _engine, fake_python, gateway  # noqa: F401 (fake_python: a fixture)
from tests.gateway.test_swap import WATCHDOG
from tests.gateway_server import KEY, auth
from tests.waiting import wait_until


def _ask(rig: Rig, model: str, tokens: int = 2) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens}
    return httpx.post(rig.server.url + "/v1/chat/completions", json=body, headers=auth(KEY), timeout=60)


def _reload(rig: Rig, adapters: dict[str, str]) -> dict[str, Any]:
    data = yaml.safe_load(rig.path.read_text())
    data["models"]["tiny"]["adapters"] = adapters
    rig.path.write_text(yaml.safe_dump(data, sort_keys=False))
    response = rig.admin("POST", "/admin/reload")
    assert response.status_code == 200, response.text
    return response.json()["models"]["tiny"]


class Load:
    """Clients asking ``models`` in turn, one thread each, until stopped: each answer's (model, status)."""

    def __init__(self, rig: Rig, models: list[str]) -> None:
        self.rig, self.models, self.answers = rig, models, []  # type: list[tuple[str, int]]
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(len(models))
        self._runs = [self._pool.submit(self._ask, model) for model in models]

    def _ask(self, model: str) -> None:
        while not self._stop.is_set():
            self.answers.append((model, _ask(self.rig, model).status_code))

    def stop(self) -> dict[str, list[int]]:
        """Every status each model got."""
        self._stop.set()
        for run in self._runs:
            run.result()
        self._pool.shutdown()
        statuses: dict[str, list[int]] = {}
        for model, status in self.answers:
            statuses.setdefault(model, []).append(status)
        return statuses


def _fake_engine(tiny_model_dir: Path, python: Path, calls: Path) -> dict[str, Any]:
    env = {"FAKE_ENGINE_START_S": "0", "FAKE_ENGINE_TOKEN_S": "0.05", "FAKE_ENGINE_CALLS": str(calls)}
    return _engine(tiny_model_dir, python, env=env)


def _calls(path: Path, kind: str) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.startswith(kind)]


def test_a_reload_loads_and_unloads_adapters_in_every_running_replica_with_no_failed_request(
    tiny_model_dir: Path, fake_python: Path, tmp_path: Path  # noqa: F811 (the fixture)
) -> None:
    calls = tmp_path / "calls"
    models = {"tiny": {"engine": _fake_engine(tiny_model_dir, fake_python, calls), "replicas": 2, "adapters": {"a1": "/adapters/a1"}}}
    # two requests upstream at once: the others queue in the gateway, where an unload finds some of them
    with gateway(tmp_path, models, limits={"max_concurrent": 2, "max_queue": 64}) as rig:
        pids = [replica["engine"]["pid"] for replica in rig.models()["tiny"]["replicas"]]
        assert _ask(rig, "tiny:a2").status_code == 404  # not in the YAML: the gateway's answer, not the engine's

        load = Load(rig, ["tiny", "tiny:a1", "tiny", "tiny:a1"])
        time.sleep(0.5)
        item = _reload(rig, {"a1": "/adapters/a1", "a2": "/adapters/a2"})
        assert item["action"] == "adapters_changed" and item["ok"] and item["adapters"] == {"a2": "loaded"}, item
        assert _ask(rig, "tiny:a2").json()["fake_model"] == "tiny:a2"  # SGLang's spelling, on the served name
        assert rig.cards()["tiny:a2"]["parent"] == "tiny"
        statuses = load.stop()
        assert set(statuses) == {"tiny", "tiny:a1"} and {s for got in statuses.values() for s in got} == {200}, statuses

        with ThreadPoolExecutor(2) as pool:
            long = [pool.submit(_ask, rig, "tiny", 40) for _ in range(2)]  # 2 s each: they hold both slots
            time.sleep(0.3)
            load = Load(rig, ["tiny", "tiny:a2", "tiny:a1", "tiny:a1", "tiny:a1"])  # all queued
            time.sleep(0.3)
            item = _reload(rig, {"a2": "/adapters/a2"})
            assert item["action"] == "adapters_changed" and item["adapters"] == {"a1": "unloaded"}, item
            gone = _ask(rig, "tiny:a1")
            assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found", gone.text
            assert [answer.result().status_code for answer in long] == [200, 200]
        statuses = load.stop()
        # the a1 requests queued when the reload came are the gateway's 404 when their turn comes (counted under their
        # model's name), as are the later ones: none reached an engine without the adapter (the engine's 400)
        assert set(statuses["tiny:a1"]) == {404}, statuses["tiny:a1"]
        assert rig.metric("gateway_requests_total", model="tiny:a1", route="/v1/chat/completions", status="404") >= 3
        assert set(statuses["tiny"]) == set(statuses["tiny:a2"]) == {200}, statuses
        assert "tiny:a1" not in rig.cards() and _ask(rig, "tiny:a2").status_code == 200
        # the same engines throughout, each asked once per change
        assert [replica["engine"]["pid"] for replica in rig.models()["tiny"]["replicas"]] == pids
        assert _calls(calls, "load") == ["load a2"] * 2 and _calls(calls, "unload") == ["unload a1"] * 2
        assert rig.metric("gateway_model_swaps_total", model="tiny", result="ok") == 0


def test_an_adapter_that_fails_to_load_is_reported_by_name_and_the_others_serve(
    tiny_model_dir: Path, fake_python: Path, tmp_path: Path  # noqa: F811 (the fixture)
) -> None:
    calls = tmp_path / "calls"
    models = {
        "tiny": {"engine": _fake_engine(tiny_model_dir, fake_python, calls), "adapters": {"a1": "/adapters/a1"},
                 "adapter_aliases": {"helpdesk": "a1"}},
    }  # fmt: skip
    with gateway(tmp_path, models) as rig:
        assert _ask(rig, "helpdesk").json()["fake_model"] == "tiny:a1" and rig.cards()["helpdesk"]["parent"] == "tiny"
        data = yaml.safe_load(rig.path.read_text())
        data["models"]["tiny"]["adapter_aliases"] = {"helpdesk": "a1", "paperwork": "a3"}
        data["models"]["tiny"]["adapters"] = {"a1": "/adapters/a1", "a2": "/adapters/a2", "a3": "/adapters/broken"}
        rig.path.write_text(yaml.safe_dump(data, sort_keys=False))
        response = rig.admin("POST", "/admin/reload")
        assert response.status_code == 502, response.text
        report = response.json()
        assert "model tiny: adapter(s) a3 failed to load; the others serve on" in report["error"]["message"], report
        item = report["reload"]["models"]["tiny"]
        assert item["adapters"]["a2"] == "loaded", item
        assert item["adapters"]["a3"].startswith("failed on replica 0: /load_lora_adapter: HTTP 400: Failed to load"), item
        assert [_ask(rig, name).status_code for name in ("tiny:a1", "tiny:a2", "tiny:a3", "paperwork")] == [200, 200, 404, 404]
        # a serving platform's route: the body's model selects an adapter of the default model, any other name the base
        chosen = [
            httpx.post(rig.server.url + "/invocations", json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
                       headers=auth(KEY), timeout=60).json()["fake_model"]
            for model in ("tiny:a2", "my-endpoint")
        ]  # fmt: skip
        assert chosen == ["tiny:a2", "tiny"]
        assert "tiny:a3" not in rig.cards() and "paperwork" not in rig.cards()  # an alias of an adapter not served
        # the adapter not served is not in force: the same file reloaded tries it again
        again = rig.admin("POST", "/admin/reload").json()["reload"]["models"]["tiny"]
        assert again["action"] == "adapters_changed" and list(again["adapters"]) == ["a3"], again
        assert _calls(calls, "load") == ["load a2", "load a3", "load a3"]


def test_adapters_loaded_at_run_time_answer_again_after_the_watchdog_restarts_a_killed_engine(
    tiny_model_dir: Path, fake_python: Path, tmp_path: Path  # noqa: F811 (the fixture)
) -> None:
    calls = tmp_path / "calls"
    models = {"tiny": {"engine": _fake_engine(tiny_model_dir, fake_python, calls), "adapters": {"a1": "/adapters/a1"}}}
    with gateway(tmp_path, models, watchdog=WATCHDOG) as rig:
        _reload(rig, {"a1": "/adapters/a1", "a2": "/adapters/a2"})
        pid = rig.models()["tiny"]["engine"]["pid"]
        os.kill(pid, signal.SIGKILL)
        engine = wait_until(
            lambda: (tiny := rig.models()["tiny"])["state"] == "ready" and tiny.get("engine", {}).get("pid") not in (pid, None) and tiny["engine"],
            lambda: rig.models()["tiny"], 60, every_s=0.2,
        )  # fmt: skip
        assert engine["pid"] != pid
        # the new engine loads both from its command line (no call to its API)
        assert [_ask(rig, name).json()["fake_model"] for name in ("tiny:a1", "tiny:a2")] == ["tiny:a1", "tiny:a2"]
        assert _calls(calls, "load") == ["load a2"]
        assert rig.metric("gateway_engine_restarts_total", model="tiny") == 1
