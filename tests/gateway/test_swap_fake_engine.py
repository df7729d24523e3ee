"""Swap policies, the watchdog and rolling swaps, on FAKE engines (tests/fake_engine.py).

These scenarios start, kill, hang and replace engines again and again: on the real SGLang CPU engine each
start costs ~30-40 s of CPU, and what they check is the gateway's control plane, not the model. So the
engines here are fakes, launched by the gateway itself exactly as real ones are (the engine config's
``python:`` is the fake's interpreter wrapper; :class:`launch.process.EngineProcess` gives each its process
group, port, key file and log): a SIGKILL, a SIGSTOP, a drain, a stop and a restart hit a real process,
which answers OpenAI-shaped chat and Responses requests with a model-less echo. Each fake takes
``FAKE_START_S`` to come up, so "meanwhile" windows are there to observe.

Which real-engine end-to-end test each capability keeps (tests/gateway/test_swap.py unless said):
blue-green swap under load: ``test_a``; an engine that fails to start (its exit code and log tail):
tests/launch/test_process.py; an engine that died
restarted by the watchdog: ``test_h`` (a request crashes it); SGLang's router in front of real engines, one
SIGKILLed under load: tests/gateway/test_router_upstream.py; a gateway over two real replicas, both balancing
policies: tests/benchmarks/test_affinity.py.

The swap module's rig, helpers and load are reused (``SwapRig``, ``Load``): the same gateway started from a
YAML file, the same assertions on what clients see and on the ``/metrics`` counters, by value:

- two concurrent stop-first swaps share one; meanwhile only 503 + Retry-After (answered at once); stored
  responses of the replaced engine are gone (404, saying so);
- (c) the YAML points the model at a directory with a broken config.json: the new engine fails (the fake exits
  as SGLang does, with a traceback), the old one keeps serving, the reload reports the error with the log tail;
- (d) the engine SIGKILLed mid-stream: that stream ends with an error event naming the engine, ``/ready``
  names the model, requests get 503 + Retry-After (never a hang, never a 500) while the other model keeps
  serving, until the watchdog's restart;
- (e) a hung engine (SIGSTOP) is restarted after ``unhealthy_after`` failed probes; 503 at once meanwhile;
- (f) a stop-first reload to an engine that fails: a stream outliving ``drain_timeout_s`` is cut, the model
  answers 503 until the watchdog restarts the previous config;
- (g) with ``max_restarts: 0`` the watchdog gives up on a dead engine; an admin swap revives it.
- a batch (the batch API) runs through a stop-first swap: its refused lines wait and are sent again, none fails.

Replicas (spread, affinity, a replica SIGKILLed, a rolling swap, SGLang's router in front) run on fake engines
in tests/gateway/test_replicas.py, with this module's ``fake_engine_section``.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from gateway.app import app_from_config
from launch.config import EngineConfig, load_config
from launch.process import EngineProcess
from launch.procgroup import group_pids, signal_group
from tests.admin_client import prometheus_value
from tests.batches.helpers import chat_lines, results, upload, wait_ended
from tests.fake_engine import fake_engine_python
from tests.gateway.helpers import BackgroundStream, assert_openai_error
from tests.gateway.test_swap import (
    ENGINES,
    PROMPT,
    WATCHDOG,
    Load,
    SwapRig,
    _broken_model_dir,
    changes,
    report,
)
from tests.gateway_server import KEY, GatewayServer, auth
from tests.leaks import LeakCheck
from tests.waiting import wait_until

FAKE_START_S = "3"
"""How long a fake engine takes to listen (a real one: 30-40 s); the fakes' env, so no swap changes it."""


def fake_engine_section(engine: dict[str, Any], python: Path) -> dict[str, Any]:
    """An engine section of the swap or replica modules, run by the fake engine."""
    return {**engine, "python": str(python), "env": {"FAKE_ENGINE_START_S": FAKE_START_S}}


@dataclass
class FakeSwapRig(SwapRig):
    """``SwapRig`` whose YAML runs the model on the fake engine."""

    python: Path = Path()

    def write(self, text: str) -> None:
        data = yaml.safe_load(text)
        engine = data.get("models", {}).get("tiny", {}).get("engine") if isinstance(data, dict) else None
        if isinstance(engine, dict):
            data["models"]["tiny"]["engine"] = fake_engine_section(engine, self.python)
            text = yaml.safe_dump(data, sort_keys=False)
        self.config.write_text(text)


@pytest.fixture(scope="module")
def fake_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fake_engine_python(tmp_path_factory.mktemp("fake-engine"))


@pytest.fixture(scope="module")
def other_engine(fake_python: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """A fake engine the gateway reaches by URL, as the swap module's ``other`` model."""
    config = EngineConfig(model_path=str(tiny_model_dir), device="cpu", python=str(fake_python), env={"FAKE_ENGINE_START_S": "0"})
    with EngineProcess("tiny", config, log_dir=tmp_path_factory.mktemp("other-logs")) as engine:
        yield engine


@pytest.fixture(scope="module")
def rig(
    fake_python: Path, other_engine: EngineProcess, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SwapRig]:
    tmp = tmp_path_factory.mktemp("swap-fake")
    leaks = LeakCheck()
    rig = FakeSwapRig(None, tmp / "deploy.yaml", tiny_model_dir, tmp, other_engine.url, leaks, python=fake_python)  # type: ignore[arg-type]
    rig.deploy(tiny_model_dir)
    app, settings = app_from_config(load_config(rig.config), log_dir=tmp / "logs")
    rig.server = GatewayServer(app, settings).start(timeout_s=120)
    try:
        yield rig
        rig.model()  # the engine running now is watched too
        counters = rig.metrics()
    finally:
        rig.server.stop()
    engines = 1 + counters["swaps_ok"] + counters["restarts"]  # each swap or restart brought a new engine
    assert len(leaks.groups) >= engines, f"the module watched {len(leaks.groups)} engines of the {engines} it ran"
    leaks.assert_nothing_left()  # every engine of the module stopped


@pytest.fixture
def settled(rig: SwapRig) -> SwapRig:
    """As in test_swap: the model ready, the YAML of its running config with the module's settings, applied."""
    return rig.settle(timeout_s=120)


# ----------------------------------------------------------------------------- swap policies and the watchdog

@pytest.mark.usefixtures("settled")
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



@pytest.mark.usefixtures("settled")
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
    swap, reload = rig.admin("GET", "/admin/models").json()["events"][:2]  # newest first: the status page's list
    assert (swap["kind"], swap["model"], swap["ok"]) == ("swap", "tiny", False) and "old backend serves on" in swap["detail"], swap
    assert (reload["kind"], reload["ok"]) == ("reload", False) and reload["detail"] == "admin: engine_changed tiny", reload
    report(
        "(c) engine that cannot start",
        requests=len(load.outcomes), failed=len(failed), reload_s=round(took, 1),
        error=item["error"], log_tail_last_lines=item["log_tail"][-3:],
    )  # fmt: skip


@pytest.mark.usefixtures("settled")
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
        noticed_by = killed + 60  # far less than a restart takes: a /ready that never flips fails here
        ready = wait_until(
            lambda: (answer := httpx.get(rig.server.url + "/ready", timeout=10)).status_code != 200 and answer,
            "/ready to say 503 after the kill", noticed_by - time.monotonic(), every_s=0.05,
        )  # fmt: skip
        body = assert_openai_error(ready, 503, "not_ready")
        assert body["models"]["tiny"]["ready"] is False and body["models"]["other"]["ready"] is True
        assert "tiny" in body["error"]["message"] and "other" not in body["error"]["message"]
        assert rig.chat("other").status_code == 200  # the other model is served meanwhile

        def restarting() -> dict[str, Any] | None:  # "unavailable" until the watchdog's next look
            model = rig.model()
            assert model["state"] in ("restarting", "unavailable"), model
            return model if model["state"] == "restarting" else None

        down = wait_until(restarting, lambda: rig.model(), noticed_by - time.monotonic(), every_s=0.05)
        assert down["replicas"][0]["log_tail"], down  # why it is down, for the status page
        metrics = httpx.get(rig.server.url + "/metrics", headers=auth(KEY)).text
        assert prometheus_value(metrics, "gateway_engine_up", {"model": "tiny"}) == 0
        # "other" is a url model: its gauge is its /health at scrape time, which a loaded machine can let time out
        # (the fake engine starved of CPU): the other engine is up again by a later scrape, whatever tiny does
        wait_until(lambda: prometheus_value(httpx.get(rig.server.url + "/metrics", headers=auth(KEY)).text, "gateway_engine_up", {"model": "other"}) == 1,
                   "the other model's engine up in /metrics", 60)  # fmt: skip
        rig.wait_ready_after(pid)
        back = time.monotonic()
        load.wait_for_requests(6, back)
    after = rig.model()
    assert after["restarts"] == before["restarts"] + 1 and after["engine"]["pid"] != pid
    assert "log_tail" not in after["replicas"][0]
    restart, down_event = rig.admin("GET", "/admin/models").json()["events"][:2]
    assert (down_event["kind"], down_event["model"], down_event["ok"]) == ("engine_down", "tiny", False), down_event
    assert "exited with code -9" in down_event["detail"], down_event
    assert (restart["kind"], restart["ok"]) == ("restart", True) and "back in rotation" in restart["detail"], restart
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


@pytest.mark.usefixtures("settled")
def test_e_hung_engine_is_restarted_and_requests_get_503_meanwhile(rig: SwapRig) -> None:
    """An engine that stops answering (SIGSTOP: alive, but silent) is restarted after ``unhealthy_after``
    failed /health probes; meanwhile its model answers 503 at once instead of hanging requests."""
    before = rig.model()
    counters = rig.metrics()
    pid = before["engine"]["pid"]
    # Healthy for stable_after_s since the last restart: the next one starts a new backoff streak.
    wait_until(lambda: rig.model()["engine"]["uptime_s"] >= WATCHDOG["stable_after_s"] + 2, "a stable stretch", 60, every_s=0.5)
    signal_group(pid, signal.SIGSTOP)
    try:
        wait_until(lambda: rig.model()["state"] != "ready", lambda: f"the hung engine was not noticed: {rig.model()}", 120, every_s=0.2)
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



@pytest.mark.usefixtures("settled")
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



@pytest.mark.usefixtures("settled")
def test_g_watchdog_gives_up_then_a_swap_revives(rig: SwapRig) -> None:
    """With ``max_restarts: 0`` the watchdog does not restart a dead engine: the model stays down
    (503 naming what to do) until an operator swaps it."""
    rig.deploy_running(watchdog={**WATCHDOG, "max_restarts": 0})
    assert rig.admin("POST", "/admin/reload").json()["settings_changed"] == ["watchdog"]
    # The watchdog reads the settings before each interval_s sleep: a check already asleep at the reload runs
    # with the old max_restarts. Let that one pass before the kill (a real engine's slower probes hid this).
    time.sleep(2 * WATCHDOG["interval_s"])
    before = rig.model()
    counters = rig.metrics()
    pid = before["engine"]["pid"]
    try:
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: rig.model()["state"] == "failed", lambda: f"the watchdog did not give up: {rig.model()}", 60, every_s=0.2)
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


@pytest.mark.usefixtures("settled")
def test_a_batch_runs_through_a_stop_first_swap_and_loses_no_line(rig: SwapRig) -> None:
    """A stop-first swap (the model down until its new engine is up) in the middle of a batch: the lines it refuses
    (503) wait and are sent again to the new engine; no line fails, each ends once, in input order."""
    lines = 120  # 20 tokens each at the fake's 10 ms, 4 at a time: ~6 s of work, so the swap lands in the middle
    sdk = openai.OpenAI(base_url=rig.server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    batch = sdk.batches.create(
        input_file_id=upload(sdk, chat_lines(lines, model="tiny", max_tokens=20)), endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_until(lambda: sdk.batches.retrieve(batch.id).request_counts.completed >= 8, "8 lines of the batch answered", 60)
    before = rig.model()
    counters = rig.metrics()
    swapped = rig.admin("POST", "/admin/models/tiny/swap", params={"policy": "stop-first"})
    assert swapped.status_code == 200, swapped.text
    assert swapped.json()["new"]["pid"] != before["engine"]["pid"]
    during = sdk.batches.retrieve(batch.id)
    assert during.status == "in_progress" and during.request_counts.completed < lines, during  # the swap was mid-batch
    ended = wait_ended(sdk, batch.id, timeout_s=120)
    assert (ended.status, ended.request_counts.completed, ended.request_counts.failed) == ("completed", lines, 0), ended
    assert ended.error_file_id is None
    assert [line["custom_id"] for line in results(sdk, ended.output_file_id)] == [f"line-{i}" for i in range(lines)]
    assert changes(counters, rig.metrics()) == {"swaps_ok": 1}
