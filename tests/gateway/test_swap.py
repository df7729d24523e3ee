"""Model swaps and engine crashes under real load, with the real SGLang CPU engine.

One gateway (started from a YAML file, owning its engine) serves the whole module while a bounded
loop of concurrent streaming and plain requests runs through the ``openai`` SDK. The tests run in any
order, each alone too: before each one, ``settled`` waits for the model to be ready, on one of the two
engine configs of ``ENGINES``, and rewrites and reloads the YAML to say so with the module's settings
(a reload that changes no engine: no test start costs an engine start). The scenarios:

(b) a broken YAML is reloaded: nothing changes;
(c) the YAML points the model at a directory with a broken config.json: the new engine fails,
    the old one keeps serving, the reload reports the error with the engine's log tail;
(a) the engine section changes (to the other config of ``ENGINES``: max_total_tokens and served_model_name):
    zero failed requests, new requests reach the new engine, the old process is gone after the drain;
    a second reload sent at the same time finds nothing left to do;
(-) two concurrent stop-first swaps share one swap: only 503 + Retry-After while the model is down;
(d) the engine is SIGKILLed mid-stream: that stream ends with an error event naming the engine,
    ``/ready`` names the model, requests get 503 (never a hang, never a 500) while the other model
    (``other``: the session's engine, by URL) keeps serving, until the watchdog's restart;
(e) the engine hangs (SIGSTOP): after ``unhealthy_after`` failed probes the model answers 503 at once
    and the watchdog restarts it (a new backoff streak, since it had been stable);
(f) a stop-first reload to a broken engine: a stream outliving ``drain_timeout_s`` is cut, the new
    engine fails, the model answers 503 until the watchdog restarts the previous config;
(g) with ``max_restarts: 0`` the watchdog gives up on a dead engine; an admin swap revives it;
(h) a request crashes the engine (its vocabulary hidden from the gateway, so the token-id check cannot
    stop it): the engine is restarted without backoff, and the same request is refused afterwards;
(i) the managed engine refuses requests that do not carry its own key.

Both engines keep Responses API state, so the module also shows that stored responses are read,
cancelled and continued on the engine that created them, and are gone (404) once that engine was
replaced (by the stop-first swap).

Every scenario checks the swap, reload and restart counters of ``/metrics`` by value, and the module
leaves no engine process and no ``/dev/shm`` file behind. The numbers (failed requests, swap time,
outage length) are printed (run with ``-s`` to see them).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from gateway.app import app_from_config
from gateway.registry import Backend
from launch.config import load_config
from launch.process import EngineProcess
from launch.procgroup import group_pids, signal_group
from tests.gateway.helpers import (
    KEY,
    BackgroundStream,
    GatewayServer,
    assert_openai_error,
    auth,
    prometheus_value,
)
from tests.leaks import LeakCheck
from tests.load import ThreadedLoad

ADMIN = "swap-admin-key"
PROMPT = [{"role": "user", "content": "Say something."}]


# ----------------------------------------------------------------------------- load


@dataclass
class Outcome:
    started: float
    ended: float
    stream: bool
    kind: str  # ok | 503 | stream_cut | timeout | error
    model: str | None = None
    status: int | None = None
    retry_after: str | None = None
    detail: str = ""


@dataclass
class Load(ThreadedLoad[Outcome]):
    """A bounded loop of concurrent requests (half streaming) through the openai SDK, recorded."""

    join_s: float = 90

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)

    def pause(self, outcome: Outcome) -> float:
        return 0.05 if outcome.kind == "ok" else 0.5  # a polite client (Retry-After, shortened)

    def one(self, client: openai.OpenAI, stream: bool) -> Outcome:
        started = time.monotonic()
        out = Outcome(started, started, stream, "ok")
        try:
            if stream:
                chunks = client.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=8, temperature=0, stream=True)
                for chunk in chunks:
                    out.model = chunk.model
            else:
                reply = client.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=8, temperature=0)
                out.model = reply.model
        except openai.APITimeoutError as error:
            out.kind, out.detail = "timeout", str(error)
        except openai.APIStatusError as error:
            out.status = error.status_code
            out.kind = "503" if error.status_code == 503 else "error"
            out.retry_after = error.response.headers.get("retry-after")
            out.detail = str(error.body)[:300]
        except openai.APIError as error:  # an error event inside a 200 stream
            out.kind, out.detail = ("stream_cut" if stream else "error"), f"{type(error).__name__}: {error}"[:300]
        out.ended = time.monotonic()
        return out

    def counts(self, outcomes: list[Outcome]) -> dict[str, int]:
        out: dict[str, int] = {}
        for o in outcomes:
            out[o.kind] = out.get(o.kind, 0) + 1
        return out

    def wait_for_requests(self, n: int, since: float, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while len([o for o in self.since(since) if o.kind == "ok"]) < n:
            assert time.monotonic() < deadline, f"fewer than {n} successful requests in {timeout_s}s: {self.counts(self.since(since))}"
            time.sleep(0.1)


def report(title: str, **numbers: Any) -> None:
    print(f"\n[swap-test] {title}: " + json.dumps(numbers, default=str), flush=True)


# ----------------------------------------------------------------------------- the gateway


ENGINES: dict[str, dict[str, Any]] = {
    "tiny": {"max_total_tokens": 4096},
    "tiny-v2": {"max_total_tokens": 2048, "served": "tiny-v2"},
}
"""The model's two engine configs, by the name the engine serves: the module starts on ``tiny``; (a) swaps
to the other one, whichever runs; every other test keeps the one it finds."""
WATCHDOG = {"interval_s": 0.5, "unhealthy_after": 2, "backoff_initial_s": 0.5, "max_restarts": 3, "stable_after_s": 5}


def _deployment(
    model_dir: Path | str, *, other_url: str, max_total_tokens: int = 4096, served: str | None = None, **gateway: Any
) -> dict[str, Any]:
    engine: dict[str, Any] = {
        "model_path": str(model_dir),
        "device": "cpu",
        "dtype": "float32",
        "max_total_tokens": max_total_tokens,
        "skip_server_warmup": True,
        "enable_response_store": True,
        "startup_timeout_s": 300,
    }
    if served:
        engine["served_model_name"] = served
    return {
        "models": {"tiny": {"engine": engine}, "other": {"url": other_url, "served_model_name": "tiny"}},
        "gateway": {
            "api_keys": [KEY],
            "admin_keys": [ADMIN],
            "drain_timeout_s": 60,
            "swap_retry_after_s": 2,
            "health_timeout_s": 2,
            "watchdog": WATCHDOG,
            **gateway,
        },
    }


def _broken_model_dir(tmp: Path) -> Path:
    """A model directory whose config.json is cut short: preflight passes, the engine fails in seconds."""
    broken = tmp / "broken-model"
    broken.mkdir(exist_ok=True)
    (broken / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", ')
    return broken


@dataclass
class SwapRig:
    server: GatewayServer
    config: Path
    model_dir: Path
    tmp: Path
    other_url: str  # the session's engine, served as model "other": what must keep working meanwhile
    leaks: LeakCheck = field(default_factory=LeakCheck)

    def write(self, text: str) -> None:
        self.config.write_text(text)

    def deploy(self, model_dir: Path | str, **options: Any) -> None:
        """Write the deployment YAML (see ``_deployment``) for the next reload."""
        self.write(yaml.safe_dump(_deployment(model_dir, other_url=self.other_url, **options), sort_keys=False))

    def running(self) -> str:
        """The config of ``ENGINES`` the model's engine runs (its served name)."""
        name = self.model()["served_model_name"]
        assert name in ENGINES, name
        return name

    def deploy_running(self, **options: Any) -> None:
        """Write the YAML of the running engine config (a reload of it changes no engine), with ``options``."""
        self.deploy(self.model_dir, **ENGINES[self.running()], **options)

    def admin(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.request(method, self.server.url + path, headers=auth(ADMIN), timeout=600, **kwargs)

    def model(self) -> dict[str, Any]:
        """The model's entry in GET /admin/models (its engine must be gone when the module ends)."""
        model = {m["name"]: m for m in self.admin("GET", "/admin/models").json()["models"]}["tiny"]
        self.leaks.watch(model.get("engine", {}).get("pid"))
        return model

    def metrics(self) -> dict[str, float]:
        """The gateway's own counters of swaps, reloads and restarts of the model, by value."""
        text = httpx.get(self.server.url + "/metrics", headers=auth(KEY), timeout=30).text
        series = {
            "swaps_ok": ("gateway_model_swaps_total", {"model": "tiny", "result": "ok"}),
            "swaps_failed": ("gateway_model_swaps_total", {"model": "tiny", "result": "failed"}),
            "reloads_ok": ("gateway_config_reloads_total", {"result": "ok"}),
            "reloads_partial": ("gateway_config_reloads_total", {"result": "partial"}),
            "reloads_invalid": ("gateway_config_reloads_total", {"result": "invalid"}),
            "restarts": ("gateway_engine_restarts_total", {"model": "tiny"}),
            "restart_failures": ("gateway_engine_restart_failures_total", {"model": "tiny"}),
            "stream_errors": ("gateway_stream_errors_total", {"model": "tiny"}),
        }
        return {key: prometheus_value(text, name, labels) or 0.0 for key, (name, labels) in series.items()}

    def wait_ready_after(self, old_pid: int, timeout_s: float = 300) -> dict[str, Any]:
        """Until the model is ready again on an engine other than ``old_pid``."""
        deadline = time.monotonic() + timeout_s
        while (model := self.model())["state"] != "ready" or model["engine"]["pid"] == old_pid:
            assert time.monotonic() < deadline, f"not back within {timeout_s}s: {model}"
            time.sleep(0.25)
        return model

    def chat(self, model: str = "tiny") -> httpx.Response:
        body = {"model": model, "messages": PROMPT, "max_tokens": 2}
        return httpx.post(self.server.url + "/v1/chat/completions", json=body, headers=auth(KEY), timeout=120)


def changes(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The counters that moved, and by how much."""
    return {key: after[key] - before[key] for key in after if after[key] != before[key]}


@pytest.fixture(scope="module")
def rig(
    starts_engine: None, tiny_engine: EngineProcess, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SwapRig]:
    tmp = tmp_path_factory.mktemp("swap")
    config = tmp / "deploy.yaml"
    config.write_text(yaml.safe_dump(_deployment(tiny_model_dir, other_url=tiny_engine.url)))
    started = time.monotonic()
    leaks = LeakCheck()
    app, settings = app_from_config(load_config(config), log_dir=tmp / "logs")
    server = GatewayServer(app, settings).start(timeout_s=400)
    rig = SwapRig(server, config, tiny_model_dir, tmp, tiny_engine.url, leaks)
    report("gateway up", start_s=round(time.monotonic() - started, 1), engine=rig.model()["engine"])
    try:
        yield rig
        rig.model()  # the engine running now is watched too
        counters = rig.metrics()
    finally:
        server.stop()
    engines = 1 + counters["swaps_ok"] + counters["restarts"]  # each swap or restart brought a new engine
    assert len(leaks.groups) >= engines, f"the module watched {len(leaks.groups)} engines of the {engines} it ran"
    leaks.assert_nothing_left()  # every engine of the module stopped, no /dev/shm file left


@pytest.fixture(autouse=True)
def settled(rig: SwapRig) -> SwapRig:
    """Whatever ran before: the model ready, the YAML of its running config with the module's settings, applied."""
    deadline = time.monotonic() + 300
    while (model := rig.model())["state"] != "ready":
        assert time.monotonic() < deadline, f"the model is not ready after the previous test: {model}"
        time.sleep(0.25)
    rig.deploy_running()
    response = rig.admin("POST", "/admin/reload")
    assert response.status_code == 200, response.text
    assert response.json()["models"]["tiny"]["action"] == "unchanged", response.text  # no engine started here
    return rig


# ----------------------------------------------------------------------------- scenarios


def test_0_stored_responses_reach_the_engine_that_created_them(rig: SwapRig) -> None:
    sdk = openai.OpenAI(base_url=rig.server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    mine = sdk.responses.create(model="tiny", input="Remember this.", max_output_tokens=4, temperature=0)
    theirs = sdk.responses.create(model="other", input="Remember that.", max_output_tokens=4, temperature=0)
    for created in (mine, theirs):  # each engine answers for its own response only
        assert sdk.responses.retrieve(created.id).output_text == created.output_text
    follow = sdk.responses.create(model="tiny", input="Go on.", previous_response_id=mine.id, max_output_tokens=4)
    assert follow.previous_response_id == mine.id
    with pytest.raises(openai.BadRequestError):  # the state lives on the other engine
        sdk.responses.create(model="other", input="Go on.", previous_response_id=mine.id, max_output_tokens=4)
    background = sdk.responses.create(model="tiny", input="Slowly.", max_output_tokens=64, background=True)
    try:
        cancelled = sdk.responses.cancel(background.id)
        assert cancelled.id == background.id
    except openai.BadRequestError as error:  # it may have finished already; the engine says so, in OpenAI's shape
        assert "cancel" in error.message.lower()


def test_b_broken_yaml_changes_nothing(rig: SwapRig) -> None:
    before = rig.model()
    counters = rig.metrics()
    with Load(rig.server.url) as load:
        load.wait_for_requests(4, 0)
        t0 = time.monotonic()
        rig.write("models:\n  tiny:\n    engine:\n      model_path: x\n      max_total_tokenz: 1\n")
        response = rig.admin("POST", "/admin/reload")
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert "deploy.yaml: models.tiny.engine.max_total_tokenz: unknown key" in message, message
        rig.write("models: [unclosed\n")
        assert "invalid YAML" in rig.admin("POST", "/admin/reload").json()["error"]["message"]
        load.wait_for_requests(4, time.monotonic())
    after = rig.model()
    assert after["engine"]["pid"] == before["engine"]["pid"] and after["state"] == "ready"
    during = load.since(t0)
    assert load.counts(during).keys() == {"ok"}, load.counts(during)
    assert changes(counters, rig.metrics()) == {"reloads_invalid": 2}
    report("(b) broken YAML", requests=len(load.outcomes), failed=sum(o.kind != "ok" for o in load.outcomes), error=message)


def test_c_engine_that_cannot_start_leaves_the_old_one_serving(rig: SwapRig) -> None:
    broken = _broken_model_dir(rig.tmp)
    before = rig.model()
    counters = rig.metrics()
    rig.deploy(broken)
    with Load(rig.server.url) as load:
        load.wait_for_requests(4, 0)
        t0 = time.monotonic()
        response = rig.admin("POST", "/admin/reload")
        took = time.monotonic() - t0
        load.wait_for_requests(4, time.monotonic())
    assert response.status_code == 502, response.text
    body = response.json()
    assert body["error"]["code"] == "engine_start_failed" and "tiny" in body["error"]["message"]
    item = body["reload"]["models"]["tiny"]
    assert item["action"] == "engine_changed" and item["ok"] is False
    assert "failed to start" in item["error"] and item["log_tail"], item
    after = rig.model()
    assert after["engine"]["pid"] == before["engine"]["pid"] and after["state"] == "ready"
    assert "failed to start" in after["last_error"]
    failed = [o for o in load.outcomes if o.kind != "ok"]
    assert not failed, failed[:3]
    assert changes(counters, rig.metrics()) == {"reloads_partial": 1, "swaps_failed": 1}
    report(
        "(c) engine that cannot start",
        requests=len(load.outcomes), failed=len(failed), reload_s=round(took, 1),
        error=item["error"], log_tail_last_lines=item["log_tail"][-3:],
    )  # fmt: skip


def test_a_engine_change_swaps_blue_green_without_failed_requests(rig: SwapRig) -> None:
    before = rig.model()
    counters = rig.metrics()
    old_pid, old_port = before["engine"]["pid"], before["engine"]["port"]
    old_name = before["served_model_name"]
    new_name = next(name for name in ENGINES if name != old_name)
    rig.deploy(rig.model_dir, **ENGINES[new_name])
    with Load(rig.server.url) as load:
        load.wait_for_requests(6, 0)
        t0 = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(rig.admin, "POST", "/admin/reload")
            time.sleep(1.0)
            second = pool.submit(rig.admin, "POST", "/admin/reload")  # arrives while the first one works
            response, again = first.result(), second.result()
        swapped_at = time.monotonic()
        assert not group_pids(old_pid), "the old engine is still running after the reload returned"
        load.wait_for_requests(8, swapped_at)
        ended = time.monotonic()
    assert response.status_code == 200, response.text
    item = response.json()["models"]["tiny"]
    assert item["action"] == "engine_changed" and item["ok"] is True
    assert set(item["changed"]) == {"engine.max_total_tokens", "engine.served_model_name"}
    assert again.status_code == 200 and again.json()["models"]["tiny"]["action"] == "unchanged"
    assert changes(counters, rig.metrics()) == {"reloads_ok": 2, "swaps_ok": 1}
    after = rig.model()
    assert (after["engine"]["pid"], after["engine"]["port"]) != (old_pid, old_port)
    assert after["served_model_name"] == new_name and after["retiring"] == [] and after["state"] == "ready"

    failed = [o for o in load.outcomes if o.kind != "ok"]
    assert not failed, failed[:3]
    old_answers = [o for o in load.since(0, swapped_at) if o.model == old_name]
    new_answers = [o for o in load.since(swapped_at, ended)]
    assert old_answers and new_answers and all(o.model == new_name for o in new_answers), {o.model for o in new_answers}
    during = load.since(t0, swapped_at)
    report(
        "(a) blue-green swap under load",
        requests=len(load.outcomes), failed=len(failed), requests_during_swap=len(during),
        served_by_old=sum(o.model == old_name for o in load.outcomes), served_by_new=sum(o.model == new_name for o in load.outcomes),
        reload_s=round(swapped_at - t0, 1), new_engine_start_s=round(item["start_s"], 1), drain_s=round(item["drain_s"], 2),
        old={"pid": old_pid, "port": old_port}, new={"pid": after["engine"]["pid"], "port": after["engine"]["port"]},
    )  # fmt: skip


def test_stop_first_swap_answers_503_with_retry_after_meanwhile(rig: SwapRig) -> None:
    """Two concurrent stop-first swaps share one; meanwhile only 503 + Retry-After. The responses stored on
    the replaced engine are gone afterwards (404, saying so)."""
    sdk = openai.OpenAI(base_url=rig.server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    stored = sdk.responses.create(model="tiny", input="Remember this.", max_output_tokens=4, temperature=0)
    assert sdk.responses.retrieve(stored.id).id == stored.id
    before = rig.model()
    counters = rig.metrics()
    with Load(rig.server.url, workers=2) as load:
        load.wait_for_requests(4, 0)
        t0 = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            calls = [pool.submit(rig.admin, "POST", "/admin/models/tiny/swap", params={"policy": "stop-first"}) for _ in range(2)]
            responses = [call.result() for call in calls]
        done = time.monotonic()
        load.wait_for_requests(4, done)
    results = [r.json() for r in responses]
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    assert results[0] == results[1], "two concurrent swap calls must share one swap"
    assert changes(counters, rig.metrics()) == {"swaps_ok": 1}
    assert results[0]["policy"] == "stop-first" and results[0]["new"]["pid"] != before["engine"]["pid"]
    after = rig.model()
    assert after["engine"]["pid"] == results[0]["new"]["pid"] and not group_pids(before["engine"]["pid"])
    during = load.since(t0, done)
    kinds = load.counts(load.outcomes)
    assert set(kinds) <= {"ok", "503"}, [o for o in load.outcomes if o.kind not in ("ok", "503")][:3]
    refused = [o for o in load.outcomes if o.kind == "503"]
    assert refused and all(o.retry_after == "2" for o in refused), refused[:3]
    # Answered at once, not held until the new engine was up (which took start_s).
    assert max(o.ended - o.started for o in refused) < results[0]["start_s"] / 2, refused
    gone = httpx.get(f"{rig.server.url}/v1/responses/{stored.id}", headers=auth(KEY), timeout=30)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "response_not_found", gone.text
    assert "replaced" in gone.json()["error"]["message"], gone.text
    report(
        "stop-first swap (two concurrent calls)",
        requests=len(load.outcomes), outcomes=kinds, requests_during_swap=len(during),
        swap_s=round(done - t0, 1), unavailable_s=round(results[0]["unavailable_s"], 1), new_engine_start_s=round(results[0]["start_s"], 1),
    )  # fmt: skip


def test_d_sigkilled_engine_is_restarted_and_requests_get_503_meanwhile(rig: SwapRig) -> None:
    before = rig.model()
    counters = rig.metrics()
    pid = before["engine"]["pid"]
    sdk = openai.OpenAI(base_url=rig.server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    with Load(rig.server.url, workers=2) as load:
        load.wait_for_requests(4, 0)
        long = sdk.chat.completions.create(
            model="tiny", messages=PROMPT, max_tokens=1900, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = iter(long)
        for _ in range(3):
            assert next(chunks).object == "chat.completion.chunk"
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(openai.APIError) as cut_short:  # the stream running at the kill ends with an error event
            for _ in chunks:
                pass
        assert "tiny" in cut_short.value.message and "engine" in cut_short.value.message
        assert cut_short.value.body["type"] == "service_unavailable"
        deadline = killed + 60  # far less than a restart takes: a /ready that never flips fails here
        while (ready := httpx.get(rig.server.url + "/ready", timeout=10)).status_code == 200:
            assert time.monotonic() < deadline, "/ready still 200 after the kill"
            time.sleep(0.05)
        body = assert_openai_error(ready, 503, "not_ready")
        assert body["models"]["tiny"]["ready"] is False and body["models"]["other"]["ready"] is True
        assert "tiny" in body["error"]["message"] and "other" not in body["error"]["message"]
        assert rig.chat("other").status_code == 200  # the other model is served meanwhile
        metrics = httpx.get(rig.server.url + "/metrics", headers=auth(KEY)).text
        assert prometheus_value(metrics, "gateway_engine_up", {"model": "tiny"}) == 0
        assert prometheus_value(metrics, "gateway_engine_up", {"model": "other"}) == 1
        rig.wait_ready_after(pid)
        back = time.monotonic()
        load.wait_for_requests(6, back)
    after = rig.model()
    assert after["restarts"] == before["restarts"] + 1 and after["engine"]["pid"] != pid
    metrics = httpx.get(rig.server.url + "/metrics", headers=auth(KEY)).text
    assert prometheus_value(metrics, "gateway_engine_up", {"model": "tiny"}) == 1
    assert prometheus_value(metrics, "gateway_in_flight_requests", {"model": "tiny"}) == 0
    assert httpx.get(rig.server.url + "/ready").status_code == 200

    kinds = load.counts(load.outcomes)
    bad = [o for o in load.outcomes if o.kind not in ("ok", "503", "stream_cut")]
    assert not bad, bad[:3]  # no 500, no other error, no timeout (hang)
    refused = [o for o in load.outcomes if o.kind == "503"]
    assert refused and all(o.retry_after for o in refused)
    cut = [o for o in load.outcomes if o.kind == "stream_cut"]
    assert all(o.started < killed for o in cut), "only streams already running at the kill may be cut"
    assert changes(counters, rig.metrics()) == {"restarts": 1, "stream_errors": len(cut) + 1}
    first_ok = min(o.ended for o in load.since(killed) if o.kind == "ok")
    report(
        "(d) SIGKILL and automatic restart",
        requests=len(load.outcomes), outcomes=kinds, answered_503=len(refused), streams_cut_by_the_kill=len(cut) + 3,
        slowest_503_s=round(max(o.ended - o.started for o in refused), 3),
        outage_s=round(first_ok - killed, 1), restart_detected_to_ready_s=round(back - killed, 1),
        old_pid=pid, new_pid=after["engine"]["pid"],
    )  # fmt: skip


def test_e_hung_engine_is_restarted_and_requests_get_503_meanwhile(rig: SwapRig) -> None:
    """An engine that stops answering (SIGSTOP: alive, but silent) is restarted after ``unhealthy_after``
    failed /health probes; meanwhile its model answers 503 at once instead of hanging requests."""
    before = rig.model()
    counters = rig.metrics()
    pid = before["engine"]["pid"]
    # Healthy for stable_after_s since the last restart: the next one starts a new backoff streak.
    deadline = time.monotonic() + 60
    while rig.model()["engine"]["uptime_s"] < WATCHDOG["stable_after_s"] + 2:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    signal_group(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 120
        while (model := rig.model())["state"] == "ready":
            assert time.monotonic() < deadline, f"the hung engine was not noticed: {model}"
            time.sleep(0.2)
        refused = rig.chat()
        message = assert_openai_error(refused, 503, "engine_unavailable")["error"]["message"]
        assert refused.headers["retry-after"]
        assert "failed 2 /health probes in a row" in message, message
        assert "attempt 1 of 3" in message, message  # the streak was reset by the stable stretch before
        after = rig.wait_ready_after(pid)
    finally:
        signal_group(pid, signal.SIGCONT)  # the restart stops it; this only matters if it did not
    assert not group_pids(pid), "the hung engine is still there after the restart"
    assert rig.chat().status_code == 200
    assert after["restarts"] == before["restarts"] + 1
    assert changes(counters, rig.metrics()) == {"restarts": 1}


def test_f_stop_first_swap_to_an_engine_that_fails(rig: SwapRig) -> None:
    """Stop-first drains the old engine (a stream outlives drain_timeout_s and is cut), stops it, and
    the new one fails to start: the model answers 503 until the watchdog brings the previous config back."""
    before = rig.model()
    counters = rig.metrics()
    pid = before["engine"]["pid"]
    rig.deploy(_broken_model_dir(rig.tmp), drain_timeout_s=1, swap_policy={"tiny": "stop-first"})
    body = {"model": "tiny", "messages": PROMPT, "max_tokens": 1900, "ignore_eos": True, "stream": True}
    stream = BackgroundStream(rig.server.url + "/v1/chat/completions", body, auth(KEY)).start()
    response = rig.admin("POST", "/admin/reload")
    events = stream.finish()
    assert response.status_code == 502, response.text
    item = response.json()["reload"]["models"]["tiny"]
    assert item["action"] == "engine_changed" and item["ok"] is False and item["policy"] == "stop-first"
    assert item["drain_timed_out"] is True and item["drain_s"] >= 1
    assert "the watchdog restarts it with the previous config" in item["error"], item["error"]
    assert events[-1].startswith('data: {"error"'), events[-3:]  # the stream cut by the stop, said so
    refused = rig.chat()  # the old engine is stopped and the new one failed: down until the watchdog acts
    assert_openai_error(refused, 503, "engine_unavailable")
    assert refused.headers["retry-after"]
    after = rig.wait_ready_after(pid)
    assert after["served_model_name"] == before["served_model_name"]
    assert rig.chat().status_code == 200
    assert changes(counters, rig.metrics()) == {"reloads_partial": 1, "swaps_failed": 1, "restarts": 1, "stream_errors": 1}
    rig.deploy(rig.model_dir, **ENGINES[before["served_model_name"]])  # what is running again
    assert rig.admin("POST", "/admin/reload").json()["models"]["tiny"]["action"] == "unchanged"


def test_g_watchdog_gives_up_then_a_swap_revives(rig: SwapRig) -> None:
    """With ``max_restarts: 0`` the watchdog does not restart a dead engine: the model stays down
    (503 naming what to do) until an operator swaps it."""
    rig.deploy_running(watchdog={**WATCHDOG, "max_restarts": 0})
    assert rig.admin("POST", "/admin/reload").json()["settings_changed"] == ["watchdog"]
    before = rig.model()
    counters = rig.metrics()
    pid = before["engine"]["pid"]
    try:
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while (model := rig.model())["state"] != "failed":
            assert time.monotonic() < deadline, f"the watchdog did not give up: {model}"
            time.sleep(0.2)
        refused = rig.chat()
        assert "an operator must swap or reload model 'tiny'" in assert_openai_error(refused, 503, "engine_unavailable")["error"]["message"]
        time.sleep(3 * WATCHDOG["interval_s"])
        assert rig.model()["state"] == "failed" and rig.model()["engine"]["pid"] == pid  # no restart behind our back
        revived = rig.admin("POST", "/admin/models/tiny/swap")
        assert revived.status_code == 200, revived.text
        assert rig.chat().status_code == 200
        rig.wait_ready_after(pid, timeout_s=10)  # the listing says "failed" until the watchdog's next look
        assert changes(counters, rig.metrics()) == {"swaps_ok": 1}
    finally:
        rig.deploy_running()
        rig.admin("POST", "/admin/reload")


def test_h_request_that_crashed_the_engine_is_refused_afterwards(rig: SwapRig, monkeypatch: pytest.MonkeyPatch) -> None:
    # As for a hub model not in the local cache: the gateway does not know the vocabulary, so an id just
    # past it reaches the engine and crashes its scheduler. Only the quarantine is left to stop a retry.
    monkeypatch.setattr(Backend, "vocab_size", property(lambda self: None))
    before = rig.model()
    pid, restarts = before["engine"]["pid"], before["restarts"]
    poison = {"model": "tiny", "prompt": [512], "max_tokens": 2}  # the tiny model's vocabulary is 512 tokens
    with httpx.Client(base_url=rig.server.url, headers=auth(KEY), timeout=120) as http:
        crashed = time.monotonic()
        first = http.post("/v1/completions", json=poison)
        assert first.status_code in (502, 503), first.text  # the engine died under it
        deadline = crashed + 300
        while rig.model()["state"] != "ready" or rig.model()["engine"]["pid"] == pid:
            assert time.monotonic() < deadline, f"not restarted within 300s: {rig.model()}"
            time.sleep(0.25)
        back = time.monotonic()
        again = http.post("/v1/completions", json=poison)
        assert again.status_code == 400 and again.json()["error"]["code"] == "request_quarantined", again.text
        other = http.post("/v1/completions", json={**poison, "prompt": [1, 2, 3]})
        assert other.status_code == 200, other.text
    after = rig.model()
    assert after["restarts"] == restarts + 1 and after["engine"]["pid"] != pid
    assert after["state"] == "ready"
    report("(h) request-triggered crash", restart_s=round(back - crashed, 1), first_status=first.status_code, old_pid=pid, new_pid=after["engine"]["pid"])


def test_i_managed_engine_refuses_requests_without_its_key(rig: SwapRig) -> None:
    """Each managed engine has a random key only the gateway knows: local processes cannot go around it."""
    engine_url = rig.model()["url"]
    direct = httpx.post(engine_url + "/v1/chat/completions", json={"model": "tiny", "messages": PROMPT, "max_tokens": 2}, timeout=30)
    assert direct.status_code == 401
    assert httpx.get(engine_url + "/get_model_info", timeout=30).status_code == 401  # it would show model_path
    assert httpx.get(engine_url + "/health", timeout=30).status_code == 200  # probes need no key
    through = httpx.post(rig.server.url + "/v1/chat/completions", json={"model": "tiny", "messages": PROMPT, "max_tokens": 2}, headers=auth(KEY), timeout=60)
    assert through.status_code == 200
    assert httpx.get(rig.server.url + "/get_model_info", headers=auth(KEY), timeout=30).status_code == 404
