"""The watchdog on the real SGLang engine (the tiny model on CPU): a busy engine is not a frozen one, a stopped one is.

SGLang's ``/health`` runs a one-token generation and looks for an answer a second later at the earliest, behind
whatever the batch is doing: on a loaded CPU it misses the gateway's probe while the engine works. That state is made
here, not hoped for: while slow streams keep the engine busy and two processes spin on the cores, the probe's timeout
is reloaded to 0.5 s, under the second SGLang's ``/health`` always takes, so every probe fails. The engine is never
restarted (its work counters move) and every request is answered. Then, probes as usual again and the engine idle,
the engine's process group is SIGSTOPped: it is down after ``unhealthy_after`` failed probes, as before, and its
restart scheduled (after a backoff longer than the test: starting the next engine is shown in test_swap.py's ``test_h``).
(The same on the FAKE engine, check by check: tests/gateway/test_watchdog.py.)
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import openai
import pytest
import yaml

from gateway.app import app_from_config
from launch.config import load_config
from launch.procgroup import signal_group
from tests.admin_client import AdminClient
from tests.gateway_server import KEY, GatewayServer
from tests.leaks import LeakCheck
from tests.load import ThreadedLoad
from tests.waiting import wait_until

ADMIN = "watchdog-admin-key"
WATCHDOG = {"interval_s": 1.0, "unhealthy_after": 2, "backoff_initial_s": 600, "progress_timeout_s": 10}
USUAL = {"health_timeout_s": 10, "watchdog": WATCHDOG}  # a loaded 2-core machine's idle engine answers within 10 s
MISSED = {"health_timeout_s": 0.5, "watchdog": WATCHDOG}  # under SGLang's 1 s: every /health probe fails
STREAMS = 6


def deployment(model_dir: Path, probes: dict[str, Any]) -> str:
    engine = {"model_path": str(model_dir), "device": "cpu", "dtype": "float32", "max_total_tokens": 4096, "startup_timeout_s": 300}
    gateway = {"api_keys": [KEY], "admin_keys": [ADMIN], **probes}
    return yaml.safe_dump({"models": {"tiny": {"engine": engine}}, "gateway": gateway}, sort_keys=False)


@dataclass
class Rig(AdminClient):
    admin_key: ClassVar[str] = ADMIN
    admin_timeout_s: ClassVar[float] = 120

    server: GatewayServer
    config: Path
    model_dir: Path
    leaks: LeakCheck

    def probes(self, probes: dict[str, Any]) -> None:
        """Reload the YAML with these probe settings (no engine changes)."""
        self.config.write_text(deployment(self.model_dir, probes))
        response = self.admin("POST", "/admin/reload")
        assert response.status_code == 200 and response.json()["models"]["tiny"]["action"] == "unchanged", response.text

    def engine(self) -> dict[str, Any]:
        """The model's entry in GET /admin/models (its engine must be gone when the module ends)."""
        model = self.listed_models()["tiny"]
        self.leaks.watch(model.get("engine", {}).get("pid"))
        return model

    def counters(self) -> dict[str, float]:
        return self.metric_values({
            "restarts": ("gateway_engine_restarts_total", {"model": "tiny"}),
            "busy_probes": ("gateway_engine_busy_probes_total", {"model": "tiny"}),
            "stream_errors": ("gateway_stream_errors_total", {"model": "tiny"}),
        })  # fmt: skip


@pytest.fixture(scope="module")
def rig(starts_engine: None, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    tmp = tmp_path_factory.mktemp("watchdog-engine")
    config = tmp / "deploy.yaml"
    config.write_text(deployment(tiny_model_dir, USUAL))
    leaks = LeakCheck()
    app, settings = app_from_config(load_config(config), log_dir=tmp / "logs")
    server = GatewayServer(app, settings).start(timeout_s=400)
    rig = Rig(server, config, tiny_model_dir, leaks)
    try:
        yield rig
        rig.engine()  # the engine running now is watched too
    finally:
        server.stop()
    leaks.assert_nothing_left()  # every engine of the module stopped, no /dev/shm file left


@dataclass
class Outcome:
    started: float
    kind: str  # ok, or what went wrong
    detail: str = ""


@dataclass
class SlowStreams(ThreadedLoad[Outcome]):
    """Streams of 300 tokens each, one after another on each worker: the engine always has a batch."""

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=KEY, max_retries=0, timeout=300)

    def one(self, client: openai.OpenAI, stream: bool) -> Outcome:
        out = Outcome(time.monotonic(), "ok")
        try:
            chunks = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Tell a long story."}], max_tokens=300, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            for _ in chunks:
                pass
        except openai.APIError as error:
            out.kind, out.detail = type(error).__name__, str(error)[:300]
        return out


@contextmanager
def cpu_load(processes: int) -> Iterator[None]:
    """Processes that spin on the cores (load added beside the engine's), stopped at the end."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def test_a_busy_engine_missing_every_probe_is_not_restarted_a_stopped_one_is(rig: Rig) -> None:
    pid = rig.engine()["engine"]["pid"]
    before = rig.counters()
    load = SlowStreams(rig.server.url, workers=STREAMS)
    with load, cpu_load(2):
        wait_until(lambda: rig.engine()["in_flight"] >= STREAMS, lambda: f"the streams are not all running: {rig.engine()}", 120)
        rig.probes(MISSED)
        try:
            # More failed probes than unhealthy_after, each excused: the engine worked meanwhile (or, before, a restart).
            wait_until(
                lambda: (now := rig.counters())["busy_probes"] - before["busy_probes"] > WATCHDOG["unhealthy_after"] + 1
                or now["restarts"] > before["restarts"],
                lambda: f"the watchdog excused no probes: {rig.counters()}", 120, every_s=0.25,
            )  # fmt: skip
        finally:
            rig.probes(USUAL)
    busy = rig.counters()
    assert busy["restarts"] == before["restarts"], f"a busy engine was restarted: {busy}"
    assert rig.engine()["engine"]["pid"] == pid
    failed = [o for o in load.outcomes if o.kind != "ok"]
    assert not failed and busy["stream_errors"] == before["stream_errors"], failed[:3]
    assert len(load.outcomes) >= STREAMS

    signal_group(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        down = wait_until(
            lambda: (model := rig.engine())["state"] == "restarting" and model,
            lambda: f"the stopped engine was not taken down: {rig.engine()}", 300, every_s=0.25,
        )  # fmt: skip
        noticed_s = time.monotonic() - stopped
    finally:
        signal_group(pid, signal.SIGCONT)  # the gateway's stop ends it (its restart waits for a backoff longer than the test)
    assert "failed 2 /health probes in a row with no progress; restarting (attempt 1)" in down["reason"], down
    print(
        f"\n[watchdog-engine] {len(load.outcomes)} streams answered, {busy['busy_probes'] - before['busy_probes']:.0f} missed probes"
        f" excused; the SIGSTOPped engine was taken down {noticed_s:.1f}s after the stop"
    )
