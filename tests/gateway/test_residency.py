"""Residency (gateway/control/residency.py) on FAKE engines (tests/fake_engine.py): models whose engines start at
their first request, stop when idle, and share a group capped at one running engine.

These start and stop engines again and again; what they check is the gateway's control plane, so the engines are
fakes the gateway launches exactly as real ones (their own process groups, ports, key files and logs), each taking
``FAKE_START_S`` to listen. The real CPU engines' end-to-end test is tests/gateway/test_residency_engine.py.
"""

from __future__ import annotations

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
from gateway.control.residency import wait_bound
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
from tests.admin_client import AdminClient
from tests.docs.readme_blocks import marked_blocks
from tests.fake_engine import fake_engine_python
from tests.gateway_server import KEY, GatewayServer, auth
from tests.leaks import LeakCheck
from tests.waiting import wait_until

ADMIN = "residency-admin-key"
FAKE_START_S = 0.5


@pytest.fixture(scope="module")
def fake_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fake_engine_python(tmp_path_factory.mktemp("fake-engine"))


class Rig(AdminClient):
    """One gateway over fake engines, from a YAML file the test may rewrite and reload."""

    admin_key = ADMIN

    def __init__(self, path: Path, server: GatewayServer, leaks: LeakCheck, timeout_s: float = 60) -> None:
        self.path, self.server, self.leaks = path, server, leaks
        self.sdk = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=timeout_s)

    def models(self) -> dict[str, dict[str, Any]]:
        """``GET /admin/models`` by name; every engine pid seen is watched (gone at the end)."""
        found = self.listed_models()
        for model in found.values():
            self.leaks.watch(model.get("engine", {}).get("pid"))
        return found

    def cards(self) -> dict[str, dict[str, Any]]:
        return {card["id"]: card for card in httpx.get(self.server.url + "/v1/models", headers=auth(), timeout=30).json()["data"]}

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
        return wait_until(
            lambda: (found := self.models()[model])["state"] == state and found,
            lambda: f"{model} stayed {self.models()[model]['state']!r}, not {state!r}: {self.models()[model]}", timeout_s,
        )  # fmt: skip

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
        wait_until(lambda: not group_pids(pid), "the stopped engine's processes to go", 15)
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
    with gateway(tmp_path, models, residency_groups={"gpu0": {"max_resident": 1, "min_resident_s": 0}}) as rig:
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


def _long_stream(rig: Rig, model: str, tokens: int) -> list[Any]:
    return list(rig.sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=tokens, stream=True))


def test_a_member_kept_busy_past_its_turn_is_stopped_between_requests_and_the_waiting_model_is_served(
    tiny_model_dir: Path, fake_python: Path, tmp_path: Path
) -> None:
    """Key A keeps member ``a`` busy without a gap (two overlapping slow streams, each sent again as it ends) while
    ``b`` asks for the group's one place. Past ``a``'s turn (``turn_s``) ``a`` takes no new request, its streams run to
    their end, it stops, and ``b`` is served: within turn_s + the longest stream in flight + b's start (the stated bound),
    though b's ``queue_timeout_s`` (1 s) is far shorter. A's requests sent meanwhile wait for a's next turn and are served."""
    slow = _engine(tiny_model_dir, fake_python)
    slow["env"] = {**slow["env"], "FAKE_ENGINE_TOKEN_S": "0.25"}
    residency = {"on_demand": True, "group": "gpu0"}
    models = {"a": {"engine": slow, "residency": residency}, "b": {"engine": _engine(tiny_model_dir, fake_python), "residency": residency}}
    turn_s, stream_s = 2.0, 8 * 0.25
    groups = {"gpu0": {"max_resident": 1, "turn_s": turn_s, "min_resident_s": 0}}
    with gateway(tmp_path, models, residency_groups=groups, model_limits={"b": {"queue_timeout_s": 1.0}}) as rig:
        assert rig.chat("a")
        stop = False
        finished: list[list[Any]] = []

        def keep_busy() -> None:
            while not stop:
                finished.append(_long_stream(rig, "a", 8))

        with ThreadPoolExecutor(2) as pool:
            holders = [pool.submit(keep_busy)]
            time.sleep(stream_s / 2)
            holders.append(pool.submit(keep_busy))  # overlapping: a is never idle between two requests
            wait_until(lambda: rig.models()["a"]["in_flight"] == 2, "both of a's streams upstream", every_s=0.02)
            asked = time.monotonic()
            answer = httpx.post(rig.server.url + "/v1/chat/completions", headers=auth(), timeout=60,
                                json={"model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})  # fmt: skip
            waited = time.monotonic() - asked
            stop = True
            for holder in holders:
                holder.result(timeout=120)  # every stream of a (those sent while b was served too) answered
        assert answer.status_code == 200, answer.text
        assert waited <= turn_s + stream_s + FAKE_START_S + 10, waited  # the stated bound, with room for a loaded machine
        assert finished and all(chunks[-1].choices[0].finish_reason == "length" for chunks in finished)  # none cut
        assert sum(len(chunks) for chunks in finished) == len(finished) * len(finished[0])
        kinds = rig.events("turn", "wake", "sleep")
        assert kinds[:4] == [("wake", "a"), ("turn", "a"), ("sleep", "a"), ("wake", "b")], kinds
        detail = [e["detail"] for e in rig.admin("GET", "/admin/models").json()["events"] if e["kind"] == "sleep" and e["model"] == "a"]
        assert any("its turn was over" in text for text in detail), detail


def test_a_key_alternating_between_members_causes_a_bounded_number_of_cold_starts(
    tiny_model_dir: Path, fake_python: Path, tmp_path: Path
) -> None:
    """One key alternates a, b ten times in a ``max_resident: 1`` group with ``wakes_per_key_per_hour: 3``: three cold
    starts, two evictions; its later requests for the asleep member are 429 ``wake_limit_exceeded`` with Retry-After,
    the resident one stays served, and another key still wakes the asleep member (min_resident_s 0 here)."""
    residency = {"on_demand": True, "group": "gpu0"}
    models = {name: {"engine": _engine(tiny_model_dir, fake_python), "residency": residency} for name in ("a", "b")}
    groups = {"gpu0": {"max_resident": 1, "min_resident_s": 0, "wakes_per_key_per_hour": 3}}
    with gateway(tmp_path, models, residency_groups=groups, api_keys=[KEY, "other-key"]) as rig:
        statuses = []
        for index in range(10):
            name = "ab"[index % 2]
            answer = httpx.post(rig.server.url + "/v1/chat/completions", headers=auth(), timeout=60,
                                json={"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})  # fmt: skip
            statuses.append(answer.status_code)
            if answer.status_code == 429:
                assert answer.json()["error"]["code"] == "wake_limit_exceeded" and int(answer.headers["retry-after"]) > 0, answer.text
        assert statuses == [200, 200, 200, 429, 200, 429, 200, 429, 200, 429], statuses
        starts = sum(rig.metric("gateway_model_wakes_total", model=m, how="started") for m in "ab")
        evictions = sum(rig.metric("gateway_residency_stops_total", model=m, reason="evicted") for m in "ab")
        assert (starts, evictions) == (3, 2)
        other = httpx.post(rig.server.url + "/v1/chat/completions", headers=auth("other-key"), timeout=60,
                           json={"model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})  # fmt: skip
        assert other.status_code == 200, other.text  # the limit is the key's, not the group's


def test_min_resident_s_keeps_an_idle_member_up_and_the_other_waits_for_it(tiny_model_dir: Path, fake_python: Path, tmp_path: Path) -> None:
    """With ``min_resident_s``, ten alternating requests cause at most 1 + elapsed / min_resident_s evictions: a request
    for the asleep member waits (no error) until the resident one was up that long."""
    residency = {"on_demand": True, "group": "gpu0"}
    models = {name: {"engine": _engine(tiny_model_dir, fake_python), "residency": residency} for name in ("a", "b")}
    guard = 1.0
    with gateway(tmp_path, models, residency_groups={"gpu0": {"max_resident": 1, "min_resident_s": guard}}) as rig:
        t0 = time.monotonic()
        for index in range(4):
            assert rig.chat("ab"[index % 2])
        elapsed = time.monotonic() - t0
        evictions = sum(rig.metric("gateway_residency_stops_total", model=m, reason="evicted") for m in "ab")
        assert evictions == 3 and elapsed >= evictions * guard, (evictions, elapsed)  # each eviction waited its guard


def test_a_cold_start_longer_than_queue_timeout_answers_200_and_says_starting_meanwhile(
    tiny_model_dir: Path, fake_python: Path, tmp_path: Path
) -> None:
    """The wait for a cold start is bounded by the engine's startup_timeout_s (default 900 s), not queue_timeout_s: a
    start of 3 s with queue_timeout_s 1 s answers 200, and while it starts /v1/models, /ready (the status page's data)
    and /admin/models say ``starting``. (The default-config claim: the next test.)"""
    engine = _engine(tiny_model_dir, fake_python)
    engine["env"] = {**engine["env"], "FAKE_ENGINE_START_S": "3"}
    models = {"a": {"engine": engine, "residency": {"on_demand": True}}}
    with gateway(tmp_path, models, limits={"queue_timeout_s": 1.0}) as rig, ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(rig.chat, "a")

        def starting() -> bool:
            said = rig.cards()["a"].get("status") == "starting"
            assert said or not waiting.done(), "never said starting"
            return said

        wait_until(starting, "the card to say starting", 10, every_s=0.05)
        ready = httpx.get(rig.server.url + "/ready", timeout=30).json()["models"]["a"]
        assert ready == {"ready": True, "asleep": True, "starting": True}, ready
        assert rig.models()["a"]["state"] == "starting"
        assert waiting.result(timeout=60)
        assert rig.cards()["a"]["status"] == "resident" and "starting" not in httpx.get(rig.server.url + "/ready", timeout=30).json()["models"]["a"]


def test_the_wait_for_a_cold_start_defaults_to_the_engine_start_timeout_not_the_slot_queue() -> None:
    deployment = parse_config({"models": {"a": {"engine": {"model_path": "/m"}, "residency": {"on_demand": True, "group": "g"}}},
                               "gateway": {"residency_groups": {"g": {}}}})  # fmt: skip
    settings = gateway_settings(deployment)
    engine = deployment.models["a"].engine
    assert engine is not None and engine.startup_timeout_s == 900 and settings.limits.queue_timeout_s == 30
    group = settings.residency_groups["g"]
    assert (group.turn_s, group.min_resident_s, group.wakes_per_key_per_hour) == (300, 30, 60)
    bound = wait_bound(deployment.models["a"], group, settings.limits.queue_timeout_s)
    assert bound == 900 + 300  # far past a GPU cold start; queue_timeout_s plays no part


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
    gpu0 = settings.residency_groups["gpu0"]
    assert (gpu0.max_resident, gpu0.turn_s, gpu0.min_resident_s) == (1, 300, 60)
    assert settings.limits.queue_timeout_s == 30  # the default: a cold start's wait is not bounded by it
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
