"""Model swaps and engine crashes under real load, with the real SGLang CPU engine.

One gateway (started from a YAML file, owning its engine) serves the whole module while a bounded
loop of concurrent streaming and plain requests runs through the ``openai`` SDK. The tests run in any
order, each alone too: before each one, ``settled`` waits for the model to be ready, on one of the two
engine configs of ``ENGINES``, and rewrites and reloads the YAML to say so with the module's settings
(a reload that changes no engine: no test start costs an engine start). The scenarios:

(b) a broken YAML is reloaded: nothing changes;
(a) the engine section changes (to the other config of ``ENGINES``: max_total_tokens and served_model_name):
    zero failed requests, new requests reach the new engine, the old process is gone after the drain;
    a second reload sent at the same time finds nothing left to do;
(h) a request crashes the engine (its vocabulary hidden from the gateway, so the token-id check cannot
    stop it): the engine is restarted without backoff, and the same request is refused afterwards; the
    status page, in a real browser, follows it (and its playground streams before);
(i) the managed engine refuses requests that do not carry its own key.

Both engines keep Responses API state, so the module also shows that stored responses are read,
cancelled and continued on the engine that created them (that they are gone, 404, once that engine was
replaced is shown with the stop-first swap in tests/gateway/test_swap_fake_engine.py).

The swap policies and watchdog scenarios that only the control plane decides (two concurrent stop-first
swaps, (c) a blue-green swap to an engine that cannot start, (d) a SIGKILLed engine's 503 window until the
watchdog's restart, a hung engine, a stop-first swap to an engine that fails, a watchdog that gives up) start an engine each and run on fake engines in
tests/gateway/test_swap_fake_engine.py, with this module's rig and load; this module keeps one real-engine
end-to-end test per capability (a real engine that died restarted by the watchdog: (h) here; a real engine
SIGKILLed under load: tests/gateway/test_router_upstream.py; a real engine that fails to start, its exit code
and log tail: tests/launch/test_process.py).

Every scenario checks the swap, reload and restart counters of ``/metrics`` by value, and the module
leaves no engine process and no ``/dev/shm`` file behind. The numbers (failed requests, swap time,
outage length) are printed (run with ``-s`` to see them).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import httpx
import openai
import pytest
import yaml

from gateway.app import app_from_config
from gateway.core.backends import EngineBackend
from launch.config import load_config
from launch.process import EngineProcess
from launch.procgroup import group_pids
from tests.admin_client import AdminClient
from tests.browser import browser_missing, chromium_page, expect_text
from tests.gateway_server import KEY, GatewayServer, auth
from tests.leaks import LeakCheck
from tests.load import ThreadedLoad
from tests.waiting import wait_until

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
        # a polite client (Retry-After, shortened); ~12 requests a second from the 3 workers: load enough for a
        # swap to fail some, without taking the CPU the new engine starts on (the suite runs on 2 cores)
        return 0.2 if outcome.kind == "ok" else 0.5

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
        wait_until(
            lambda: len([o for o in self.since(since) if o.kind == "ok"]) >= n,
            lambda: f"fewer than {n} successful requests: {self.counts(self.since(since))}", timeout_s,
        )  # fmt: skip


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
# The real engine's probes: as quick to see a dead engine (a refused probe fails at once), slower to call a live one
# frozen. On a loaded 2-core machine the real engine swapped in a moment ago missed two 2 s probes and was restarted
# under (a). (The fake engines of test_swap_fake_engine keep the quick ones: a hung fake is what they test.)
REAL_ENGINE_PROBES: dict[str, Any] = {"health_timeout_s": 10, "watchdog": {**WATCHDOG, "unhealthy_after": 3}}


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
class SwapRig(AdminClient):
    admin_key: ClassVar[str] = ADMIN
    admin_timeout_s: ClassVar[float] = 600

    server: GatewayServer
    config: Path
    model_dir: Path
    tmp: Path
    other_url: str  # the session's engine, served as model "other": what must keep working meanwhile
    leaks: LeakCheck = field(default_factory=LeakCheck)
    probes: dict[str, Any] = field(default_factory=dict)  # gateway settings every deployment of the rig gets

    def write(self, text: str) -> None:
        self.config.write_text(text)

    def deploy(self, model_dir: Path | str, **options: Any) -> None:
        """Write the deployment YAML (see ``_deployment``) for the next reload."""
        self.write(yaml.safe_dump(_deployment(model_dir, other_url=self.other_url, **{**self.probes, **options}), sort_keys=False))

    def running(self) -> str:
        """The config of ``ENGINES`` the model's engine runs (its served name)."""
        name = self.model()["served_model_name"]
        assert name in ENGINES, name
        return name

    def settle(self, timeout_s: float) -> SwapRig:
        """Whatever ran before: the model ready, the YAML of its running config with the module's settings, applied
        (a reload that starts no engine)."""
        wait_until(
            lambda: self.model()["state"] == "ready",
            lambda: f"the model is not ready after the previous test: {self.model()}", timeout_s, every_s=0.25,
        )  # fmt: skip
        self.deploy_running()
        response = self.admin("POST", "/admin/reload")
        assert response.status_code == 200, response.text
        assert response.json()["models"]["tiny"]["action"] == "unchanged", response.text  # no engine started here
        return self

    def deploy_running(self, **options: Any) -> None:
        """Write the YAML of the running engine config (a reload of it changes no engine), with ``options``."""
        self.deploy(self.model_dir, **ENGINES[self.running()], **options)

    def model(self) -> dict[str, Any]:
        """The model's entry in GET /admin/models (its engine must be gone when the module ends)."""
        model = self.listed_models()["tiny"]
        self.leaks.watch(model.get("engine", {}).get("pid"))
        return model

    def metrics(self) -> dict[str, float]:
        """The gateway's own counters of swaps, reloads and restarts of the model, by value."""
        return self.metric_values({
            "swaps_ok": ("gateway_model_swaps_total", {"model": "tiny", "result": "ok"}),
            "swaps_failed": ("gateway_model_swaps_total", {"model": "tiny", "result": "failed"}),
            "reloads_ok": ("gateway_config_reloads_total", {"result": "ok"}),
            "reloads_partial": ("gateway_config_reloads_total", {"result": "partial"}),
            "reloads_invalid": ("gateway_config_reloads_total", {"result": "invalid"}),
            "restarts": ("gateway_engine_restarts_total", {"model": "tiny"}),
            "restart_failures": ("gateway_engine_restart_failures_total", {"model": "tiny"}),
            "stream_errors": ("gateway_stream_errors_total", {"model": "tiny"}),
        })

    def wait_ready_after(self, old_pid: int, timeout_s: float = 300) -> dict[str, Any]:
        """Until the model is ready again on an engine other than ``old_pid``."""
        return wait_until(
            lambda: (model := self.model())["state"] == "ready" and model["engine"]["pid"] != old_pid and model,
            lambda: f"not back: {self.model()}", timeout_s, every_s=0.25,
        )  # fmt: skip

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
    config.write_text(yaml.safe_dump(_deployment(tiny_model_dir, other_url=tiny_engine.url, **REAL_ENGINE_PROBES)))
    started = time.monotonic()
    leaks = LeakCheck()
    app, settings = app_from_config(load_config(config), log_dir=tmp / "logs")
    server = GatewayServer(app, settings).start(timeout_s=400)
    rig = SwapRig(server, config, tiny_model_dir, tmp, tiny_engine.url, leaks, REAL_ENGINE_PROBES)
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
    return rig.settle(timeout_s=300)


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
            # the first holds the model (a fixed 1 s pause was not enough on a loaded machine: the second came first)
            wait_until(lambda: rig.model()["state"] == "swapping", "the first reload to start its swap", timeout_s=60, every_s=0.05)
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


def test_h_request_that_crashed_the_engine_is_refused_afterwards_and_the_status_page_follows(
    rig: SwapRig, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A request crashes the engine, which is restarted and refuses that request afterwards; meanwhile the status
    page, open in a real browser (:class:`StatusPage`), shows the engine restarting, then ready on its new process
    (one engine restart serves both: it is the slowest step of the module)."""
    # As for a hub model not in the local cache: the gateway does not know the vocabulary, so an id just
    # past it reaches the engine and crashes its scheduler. Only the quarantine is left to stop a retry.
    monkeypatch.setattr(EngineBackend, "vocab_size", property(lambda self: None))
    before = rig.model()
    pid, restarts = before["engine"]["pid"], before["restarts"]
    poison = {"model": "tiny", "prompt": [512], "max_tokens": 2}  # the tiny model's vocabulary is 512 tokens
    with StatusPage.opened(rig, tmp_path) as page, httpx.Client(base_url=rig.server.url, headers=auth(KEY), timeout=120) as http:
        if page is not None:
            page.before_the_crash(pid)
        crashed = time.monotonic()
        first = http.post("/v1/completions", json=poison)
        assert first.status_code in (502, 503), first.text  # the engine died under it
        if page is not None:
            page.shows("tiny", "restarting", timeout_s=60)
        rig.wait_ready_after(pid, timeout_s=crashed + 300 - time.monotonic())
        back = time.monotonic()
        if page is not None:
            page.after_the_restart(rig.model()["engine"]["pid"])
        again = http.post("/v1/completions", json=poison)
        assert again.status_code == 400 and again.json()["error"]["code"] == "request_quarantined", again.text
        other = http.post("/v1/completions", json={**poison, "prompt": [1, 2, 3]})
        assert other.status_code == 200, other.text
    after = rig.model()
    assert after["restarts"] == restarts + 1 and after["engine"]["pid"] != pid
    assert after["state"] == "ready"
    report("(h) request-triggered crash", restart_s=round(back - crashed, 1), first_status=first.status_code, old_pid=pid, new_pid=after["engine"]["pid"])
    if page is None:
        pytest.skip(f"the crash and the quarantine passed; the status page part did not run: {browser_missing()}")


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


class StatusPage:
    """The status page in headless Chromium against the module's gateway, as (h) drives it around its crash.

    Without keys it lists the models as ready and shows no admin part (the admin API stays 401 to it); with the
    client key the playground streams an answer that grows in the page over several animation frames; with the
    admin key it shows the engine; the crashed engine shows as restarting, then ready on its new process, with
    both events listed. Screenshots go to ``tmp_path``."""

    def __init__(self, page: Any, shots: Path) -> None:
        self.page, self.shots = page, shots

    @classmethod
    @contextmanager
    def opened(cls, rig: SwapRig, tmp_path: Path) -> Iterator[StatusPage | None]:
        if browser_missing():
            yield None
            return
        shots = tmp_path  # the docs' screenshots are the real model's: tests/gateway/test_playground_real_model.py
        with chromium_page(viewport={"width": 1200, "height": 1000}) as page:
            page.goto(rig.server.url + "/")
            yield cls(page, shots)
            assert not page.problems, page.problems

    def cell(self, model: str, table: str = "models", column: int | None = None) -> Any:
        row = self.page.locator(f'#{table}-body tr[data-model="{model}"]')
        return row.locator("td.state" if column is None else f"td:nth-child({column})")

    def shows(self, model: str, state: str, timeout_s: float = 30) -> None:
        expect_text(self.cell(model), state, timeout_s)

    def before_the_crash(self, engine_pid: int) -> None:
        page = self.page
        self.shows("tiny", "ready")  # from /ready, which needs no key
        assert page.locator('#models-body tr[data-model="other"]').count() == 1
        assert page.locator("section#engines").is_hidden() and page.locator("section#events").is_hidden()
        assert page.evaluate("fetch('/admin/models').then(r => r.status)") == 401
        assert "enter a client key" in page.text_content("#models-note")

        page.fill("#client-key", KEY)
        page.click("#keys button[type=submit]")
        page.select_option("#pg-model", "tiny")
        page.fill("#pg-prompt", "Say something.")
        page.fill("#pg-temperature", "0")
        page.fill("#pg-max-tokens", "400")  # ~0.1-3 s of the tiny model: several frames
        # the answer's length at every animation frame until it is done
        page.evaluate("""() => { window.lengths = []; const answer = document.getElementById('pg-answer');
            const sample = () => { window.lengths.push(answer.textContent.length); if (!answer.dataset.done) requestAnimationFrame(sample); };
            requestAnimationFrame(sample); }""")
        page.click("#pg-send")
        page.wait_for_selector("#pg-answer[data-done]", timeout=120_000)
        assert page.text_content("#pg-error") == ""
        lengths = page.evaluate("window.lengths")
        partial = {n for n in lengths if 0 < n < lengths[-1]}
        assert len(partial) >= 2, f"the answer did not grow token by token over frames: frame lengths {lengths[:80]}"
        stats = page.text_content("#pg-stats")
        assert re.search(r"TTFT \d+ ms · \d+ tokens · [\d.]+ tokens/s", stats), stats
        expect_text(self.cell("tiny", column=8), re.compile(r"^\d+"))  # errors: from /metrics, with the client key
        assert page.locator("section#engines").is_hidden(), "a client key must not open the admin parts"
        page.screenshot(path=str(self.shots / "playground.png"), full_page=True)

        page.fill("#admin-key", ADMIN)
        page.click("#keys button[type=submit]")
        expect_text(self.cell("tiny", "engines", 4), str(engine_pid))
        page.screenshot(path=str(self.shots / "status-page.png"), full_page=True)

    def after_the_restart(self, engine_pid: int) -> None:
        self.shows("tiny", "ready")
        expect_text(self.cell("tiny", "engines", 4), str(engine_pid))
        events = self.page.text_content("#events-list")
        assert "engine_down tiny failed" in events and "restart tiny ok" in events, events
