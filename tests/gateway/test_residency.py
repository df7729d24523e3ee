"""Residency (gateway/control/residency.py) on FAKE engines (tests/fake_engine.py): models whose engines start at
their first request, stop when idle, and share a group capped at one running engine.

These start and stop engines again and again; what they check is the gateway's control plane, so the engines are
fakes the gateway launches exactly as real ones (their own process groups, ports, key files and logs), each taking
``FAKE_START_S`` to listen. The real CPU engines' end-to-end test is tests/gateway/test_residency_engine.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from gateway.app import app_from_config, create_app
from gateway.config import gateway_settings
from gateway.core.backends import EngineBackend
from gateway.core.registry import ModelRoute, Registry
from launch.argv import build_argv
from launch.config import (
    ConfigError,
    DeploymentConfig,
    EngineConfig,
    ModelEntry,
    ResidencyConfig,
    load_config,
    parse_config,
)
from launch.process import EngineProcess
from launch.procgroup import group_pids
from tests.docs.readme_blocks import marked_blocks
from tests.fake_engine import fake_engine_python
from tests.gateway.helpers import KEY, GatewayServer, auth, prometheus_value
from tests.leaks import LeakCheck

ADMIN = "residency-admin-key"
FAKE_START_S = 0.5


@pytest.fixture(scope="module")
def fake_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fake_engine_python(tmp_path_factory.mktemp("fake-engine"))


class Rig:
    """One gateway over fake engines, from a YAML file the test may rewrite and reload."""

    def __init__(self, path: Path, server: GatewayServer, leaks: LeakCheck, timeout_s: float = 60) -> None:
        self.path, self.server, self.leaks = path, server, leaks
        self.sdk = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=timeout_s)

    def admin(self, method: str, path: str) -> httpx.Response:
        return httpx.request(method, self.server.url + path, headers=auth(ADMIN), timeout=60)

    def models(self) -> dict[str, dict[str, Any]]:
        """``GET /admin/models`` by name; every engine pid seen is watched (gone at the end)."""
        found = {m["name"]: m for m in self.admin("GET", "/admin/models").json()["models"]}
        for model in found.values():
            self.leaks.watch(model.get("engine", {}).get("pid"))
        return found

    def cards(self) -> dict[str, dict[str, Any]]:
        return {card["id"]: card for card in httpx.get(self.server.url + "/v1/models", headers=auth(), timeout=30).json()["data"]}

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(self.server.url + "/metrics", headers=auth(), timeout=30).text
        return prometheus_value(text, name, labels) or 0.0

    def chat(self, model: str, stream: bool = False) -> str:
        """Four tokens' text. ``ignore_eos``: a real tiny engine samples its random weights, and an end-of-sequence
        token first (one chance in ~500 a request) would make an empty answer of a request that was answered."""
        request: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "extra_body": {"ignore_eos": True}}
        if stream:
            pieces = self.sdk.chat.completions.create(**request, stream=True)
            return "".join(chunk.choices[0].delta.content or "" for chunk in pieces if chunk.choices)
        answer = self.sdk.chat.completions.create(**request)
        return answer.choices[0].message.content or ""

    def wait_state(self, model: str, state: str, timeout_s: float = 20) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.models()[model]
            if found["state"] == state:
                return found
            assert time.monotonic() < deadline, f"{model} stayed {found['state']!r}, not {state!r}: {found}"
            time.sleep(0.1)

    def events(self, *kinds: str) -> list[tuple[str, str]]:
        """(kind, model) of the residency events, oldest first."""
        listed = self.admin("GET", "/admin/models").json()["events"]
        return [(e["kind"], e["model"]) for e in reversed(listed) if e["kind"] in kinds]


def _engine(tiny_model_dir: Path, python: Path, **more: Any) -> dict[str, Any]:
    return {"model_path": str(tiny_model_dir), "device": "cpu", "python": str(python), "env": {"FAKE_ENGINE_START_S": str(FAKE_START_S)}, **more}


@contextmanager
def gateway(
    tmp_path: Path, models: dict[str, Any], timeout_s: float = 60, start_timeout_s: float = 60, **settings: Any
) -> Iterator[Rig]:
    """A gateway of ``models`` (``timeout_s``: its clients' wait for an answer, cold starts included;
    ``start_timeout_s``: its own start, which waits for the engines that are not on demand)."""
    path = tmp_path / "deploy.yaml"
    gateway_section = {"api_keys": [KEY], "admin_keys": [ADMIN], "log_requests": False, **settings}
    path.write_text(yaml.safe_dump({"models": models, "gateway": gateway_section}, sort_keys=False))
    leaks = LeakCheck()
    app, gateway_config = app_from_config(load_config(path), log_dir=tmp_path / "logs")
    server = GatewayServer(app, gateway_config).start(timeout_s=start_timeout_s)
    rig = Rig(path, server, leaks, timeout_s)
    try:
        rig.models()
        yield rig
        rig.models()
    finally:
        server.stop()
    leaks.assert_nothing_left()


def test_an_on_demand_model_starts_at_its_first_request_once_however_many_wait(tiny_model_dir: Path, fake_python: Path, tmp_path: Path) -> None:
    models = {"a": {"engine": _engine(tiny_model_dir, fake_python), "residency": {"on_demand": True}}}
    with gateway(tmp_path, models) as rig:
        asleep = rig.models()["a"]
        assert asleep["state"] == "sleeping" and asleep["residency"] == "sleeping" and "engine" not in asleep, asleep
        assert asleep["replicas"][0]["state"] == "sleeping"
        assert rig.cards()["a"]["status"] == "sleeping" and rig.metric("gateway_model_resident", model="a") == 0
        ready = httpx.get(rig.server.url + "/ready", timeout=30)
        assert ready.status_code == 200 and ready.json()["models"]["a"] == {"ready": True, "asleep": True}, ready.text
        t0 = time.monotonic()
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda index: rig.chat("a", stream=index % 2 == 1), range(6)))
        waited = time.monotonic() - t0
        assert all(answers), answers
        assert waited >= FAKE_START_S, waited  # they waited for the start, which they did not do six times:
        assert rig.metric("gateway_model_wakes_total", model="a", how="started") == 1
        assert rig.metric("gateway_model_wake_seconds_count", model="a") == 1
        awake = rig.models()["a"]
        assert awake["state"] == "ready" and awake["residency"] == "resident" and awake["engine"]["running"], awake
        assert rig.cards()["a"]["status"] == "resident" and rig.metric("gateway_model_resident", model="a") == 1
        assert rig.events("wake", "sleep") == [("wake", "a")]
        swap = rig.admin("POST", "/admin/models/a/swap")
        assert swap.status_code == 200, swap.text  # a running on-demand engine swaps like any other


def test_an_idle_model_stops_after_idle_stop_s_and_its_next_request_starts_it_again(tiny_model_dir: Path, fake_python: Path, tmp_path: Path) -> None:
    models = {"a": {"engine": _engine(tiny_model_dir, fake_python), "residency": {"idle_stop_s": 1.5}}}
    with gateway(tmp_path, models) as rig:
        first = rig.models()["a"]
        assert first["state"] == "ready" and first["residency"] == "resident", first  # started at boot
        pid = first["engine"]["pid"]
        assert rig.chat("a")
        used = time.monotonic()
        asleep = rig.wait_state("a", "sleeping")
        assert time.monotonic() - used >= 1.5, "stopped before it was idle for idle_stop_s"
        assert "engine" not in asleep  # out of the registry first: no request reaches it while it stops
        deadline = time.monotonic() + 15
        while group_pids(pid):
            assert time.monotonic() < deadline, "the stopped engine's processes are still there"
            time.sleep(0.1)
        assert rig.metric("gateway_residency_stops_total", model="a", reason="idle") == 1
        assert rig.metric("gateway_engine_restarts_total", model="a") == 0  # a deliberate stop is no failure
        swap = rig.admin("POST", "/admin/models/a/swap")
        assert swap.status_code == 409 and swap.json()["error"]["code"] == "model_asleep", swap.text
        assert rig.chat("a", stream=True)
        again = rig.models()["a"]
        assert again["state"] == "ready" and again["engine"]["pid"] != pid, again


def test_a_group_of_one_alternates_its_models_stopping_the_idle_one_before_starting_the_other(
    tiny_model_dir: Path, fake_python: Path, tmp_path: Path
) -> None:
    residency = {"on_demand": True, "group": "gpu0"}
    models = {name: {"engine": _engine(tiny_model_dir, fake_python), "residency": residency} for name in ("a", "b")}
    with gateway(tmp_path, models, residency_groups={"gpu0": {"max_resident": 1}}) as rig:
        order = ["a", "b", "a", "b"]
        for name in order:
            assert rig.chat(name, stream=name == "b"), name
            states = {model: item["state"] for model, item in rig.models().items()}
            other = "b" if name == "a" else "a"
            assert states == {name: "ready", other: "sleeping"}, states
        assert rig.events("wake", "sleep") == [
            ("wake", "a"), ("sleep", "a"), ("wake", "b"), ("sleep", "b"), ("wake", "a"), ("sleep", "a"), ("wake", "b"),
        ]  # fmt: skip
        rig.chat("b")  # resident: no start, no stop
        body = {"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
        with httpx.stream("POST", rig.server.url + "/v1/chat/completions", headers=auth(), json=body, timeout=30) as streamed:
            events = streamed.read().decode().split("\n\n")
        assert events[0] == ": model a is starting for this request" and events[-2] == "data: [DONE]", events
        assert any('"content"' in event for event in events[1:-2]), events
        assert rig.metric("gateway_residency_stops_total", model="a", reason="evicted") == 2
        assert rig.metric("gateway_model_wakes_total", model="b", how="started") == 2 and rig.metric("gateway_model_wakes_total", model="a", how="started") == 3


def test_a_busy_group_member_is_not_stopped_and_a_wait_past_queue_timeout_is_503(tiny_model_dir: Path, fake_python: Path, tmp_path: Path) -> None:
    """``a`` streams slowly while ``b`` asks for the group's one place: ``b`` waits (never cutting ``a``), and
    answers 503 ``model_starting`` with Retry-After once its queue_timeout_s is over."""
    slow = _engine(tiny_model_dir, fake_python)
    slow["env"] = {**slow["env"], "FAKE_ENGINE_TOKEN_S": "0.5"}
    residency = {"on_demand": True, "group": "gpu0"}
    models = {"a": {"engine": slow, "residency": residency}, "b": {"engine": _engine(tiny_model_dir, fake_python), "residency": residency}}
    limits = {"b": {"queue_timeout_s": 1.0}}
    with gateway(tmp_path, models, residency_groups={"gpu0": {"max_resident": 1}}, model_limits=limits) as rig:
        assert rig.chat("a")
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(
                lambda: list(rig.sdk.chat.completions.create(model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True))
            )
            time.sleep(0.5)
            refused = httpx.post(rig.server.url + "/v1/chat/completions", headers=auth(), timeout=30,
                                 json={"model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})  # fmt: skip
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_starting", refused.text
            assert refused.headers["retry-after"] and "queue_timeout_s" in refused.json()["error"]["message"]
            body = {"model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
            with httpx.stream("POST", rig.server.url + "/v1/chat/completions", headers=auth(), json=body, timeout=30) as streamed:
                assert streamed.status_code == 200  # at once: the keep-alive comment, then the failure as an event
                events = streamed.read().decode().split("\n\n")
            assert events[0] == ": model b is starting for this request", events
            error = json.loads(events[-2].removeprefix("data: "))["error"]
            assert error["code"] == "model_starting" and "queue_timeout_s" in error["message"], events
            chunks = running.result(timeout=60)
        assert chunks and chunks[-1].choices[0].finish_reason is not None  # the stream of a ran to its end
        assert rig.models()["a"]["state"] == "ready"


def test_a_reload_of_an_asleep_model_keeps_it_asleep_and_its_next_request_starts_the_new_config(
    tiny_model_dir: Path, fake_python: Path, tmp_path: Path
) -> None:
    models = {"a": {"engine": _engine(tiny_model_dir, fake_python, max_total_tokens=1024), "residency": {"on_demand": True}}}
    with gateway(tmp_path, models) as rig:
        data = yaml.safe_load(rig.path.read_text())
        data["models"]["a"]["engine"]["max_total_tokens"] = 2048
        data["models"]["b"] = {"engine": _engine(tiny_model_dir, fake_python), "residency": {"on_demand": True}}  # added asleep
        rig.path.write_text(yaml.safe_dump(data, sort_keys=False))
        reload = rig.admin("POST", "/admin/reload")
        assert reload.status_code == 200, reload.text
        states = {name: item["state"] for name, item in rig.models().items()}
        assert states == {"a": "sleeping", "b": "sleeping"}, states
        assert rig.chat("a")
        assert rig.cards()["a"]["context_length"] == 2048  # the fake reports max_total_tokens; the engine that started is the reloaded config's
        del data["models"]["b"]
        rig.path.write_text(yaml.safe_dump(data, sort_keys=False))
        assert rig.admin("POST", "/admin/reload").status_code == 200  # an asleep model removed: nothing to drain
        assert set(rig.models()) == {"a"}
        data["models"]["c"] = {"engine": _engine(tiny_model_dir, fake_python), "residency": {"on_demand": True}}
        rig.path.write_text(yaml.safe_dump(data, sort_keys=False))
        assert rig.admin("POST", "/admin/reload").status_code == 200
        del data["models"]["c"]["residency"]  # asleep, and no longer on demand: its next request still starts it
        rig.path.write_text(yaml.safe_dump(data, sort_keys=False))
        assert rig.admin("POST", "/admin/reload").status_code == 200
        assert rig.models()["c"]["state"] == "sleeping"
        assert rig.chat("c")
        assert rig.models()["c"]["state"] == "ready"


@pytest.mark.parametrize(
    ("models", "gateway_section", "message"),
    [
        ({"a": {"url": "http://127.0.0.1:1", "residency": {"on_demand": True}}}, {}, "deploy.yaml: models.a: residency needs an 'engine' section without a router"),
        ({"a": {"engine": {"model_path": "/m"}, "residency": {"group": "gpu9"}}}, {}, "models.a.residency.group: 'gpu9' is not in gateway.residency_groups (none is defined)"),
        ({"a": {"engine": {"model_path": "/m"}, "residency": {"on_demand": True}}}, {"workers": 2}, "models.a.residency: needs gateway.workers: 1"),
        ({"a": {"engine": {"model_path": "/m"}, "residency": {"idle_stop_s": 0}}}, {}, "models.a.residency.idle_stop_s: Input should be greater than 0"),
        ({"a": {"engine": {"model_path": "/m"}, "residency": {"on_demnd": True}}}, {}, "models.a.residency.on_demnd: unknown key"),
    ],
)
def test_residency_settings_are_checked_with_a_message_naming_the_key(models: dict[str, Any], gateway_section: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        gateway_settings(parse_config({"models": models, "gateway": gateway_section}, "deploy.yaml"))
    assert message in str(caught.value), str(caught.value)


def test_workers_auto_is_one_process_with_residency() -> None:
    deployment = parse_config({"models": {"a": {"engine": {"model_path": "/m"}, "residency": {"on_demand": True}}}, "gateway": {"workers": "auto"}})
    assert gateway_settings(deployment).worker_count() == 1


def test_the_documented_residency_config_is_valid_and_means_what_the_page_says() -> None:
    (block,) = marked_blocks("residency-config")
    deployment = parse_config(yaml.safe_load(block.code), "docs/residency.md")
    settings = gateway_settings(deployment)
    residency = {name: entry.residency for name, entry in deployment.models.items()}
    assert {name: (r.on_demand, r.group) for name, r in residency.items() if r} == {"day-model": (True, "gpu0"), "night-model": (True, "gpu0")}
    assert residency["night-model"] is not None and residency["night-model"].idle_stop_s == 900
    assert settings.residency_groups["gpu0"].max_resident == 1 and settings.limits.queue_timeout_s == 300
    assert settings.worker_count() == 1


def test_memory_saver_sleep_drains_releases_then_resumes_before_serving(tiny_model_dir: Path, fake_python: Path, tmp_path: Path) -> None:
    """``sleep: memory_saver`` (GPU only: the config refuses it on cpu) against a FAKE engine that records SGLang's
    memory calls: an idle engine is drained (a stream longer than idle_stop_s runs to its end first), releases its
    memory with its process kept, and takes it back before the next request reaches it. The deployment in force is
    built past validation (model_construct) to run the GPU path on this CPU machine; the fake ignores the device."""
    calls = tmp_path / "calls.txt"
    env = {"FAKE_ENGINE_START_S": "0", "FAKE_ENGINE_TOKEN_S": "0.5", "FAKE_ENGINE_CALLS": str(calls)}
    config = EngineConfig(model_path=str(tiny_model_dir), device="cpu", python=str(fake_python), env=env, enable_memory_saver=True, enable_weights_cpu_backup=True)
    assert "--enable-memory-saver" in build_argv(config, port=1) and "--enable-weights-cpu-backup" in build_argv(config, port=1)
    residency = ResidencyConfig(sleep="memory_saver", idle_stop_s=1.0)
    entry = ModelEntry.model_construct(engine=config, residency=residency, aliases=[], replicas=1, replica_gpus=None, router=None, url=None)
    settings = gateway_settings(parse_config({"models": {"a": {"url": "http://127.0.0.1:1"}}, "gateway": {"api_keys": [KEY], "admin_keys": [ADMIN]}}))
    leaks = LeakCheck()
    with EngineProcess("a", config, log_dir=tmp_path / "logs") as engine:
        leaks.watch(engine.pid)
        app = create_app(settings, Registry([ModelRoute("a", EngineBackend("a", engine))]))
        app.state.controller.applier.deployment = DeploymentConfig.model_construct(models={"a": entry}, gateway={}, source=None)
        server = GatewayServer(app, settings).start()
        rig = Rig(tmp_path / "none.yaml", server, leaks)
        try:
            streamed = rig.chat("a", stream=True)  # 4 pieces at 0.5 s: 2 s, past idle_stop_s
            assert streamed.count("tok") == 4, streamed
            asleep = rig.wait_state("a", "sleeping")
            assert asleep["replicas"][0]["state"] == "sleeping" and rig.metric("gateway_model_resident", model="a") == 0
            assert asleep["engine"]["running"] and asleep["engine"]["pid"] == engine.pid, asleep  # the process is kept
            assert rig.cards()["a"]["status"] == "sleeping"
            # From here on no idle stop (as after a reload that turns them off): the checks below read counts and events
            # that a second idle sleep, 1 s after the next answer on a loaded machine, would change under them.
            awake = entry.model_copy(update={"residency": ResidencyConfig(sleep="memory_saver", idle_stop_s=None)})
            app.state.controller.applier.deployment = DeploymentConfig.model_construct(models={"a": awake}, gateway={}, source=None)
            assert rig.chat("a") == "tok " * 4
            assert rig.models()["a"]["state"] == "ready" and rig.metric("gateway_model_resident", model="a") == 1
            assert calls.read_text().split() == ["chat", "chat-end", "release", "resume", "chat"]
            assert rig.metric("gateway_residency_stops_total", model="a", reason="idle") == 1
            assert rig.metric("gateway_model_wakes_total", model="a", how="resumed") == 1 and rig.metric("gateway_engine_restarts_total", model="a") == 0
            assert rig.metric("gateway_model_wakes_total", model="a", how="started") == 0
            events = [e for e in rig.admin("GET", "/admin/models").json()["events"] if e["kind"] in ("wake", "sleep")]
            assert "GPU memory released, processes kept" in events[-1]["detail"] and events[0]["detail"].startswith("resumed"), events
        finally:
            server.stop()
    leaks.assert_nothing_left()
