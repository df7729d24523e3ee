"""The quarantine does not blame a bystander, on a FAKE engine that a request crashes on demand.

A victim key runs a 200-line batch of one ordinary shape; meanwhile an attacker key sends two crashing requests of
two shapes of its own, each while victim lines are in flight. The victim's shape had been answered in full before
each crash, so it is no evidence: each crashing shape is the only suspect, refused for the attacker at once, and
every one of the victim's lines completes (those in flight at a crash are sent again once the engine is back)."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from loguru import logger

from tests.fake_engine import CRASH, fake_engine_python
from tests.gateway.test_residency import gateway
from tests.gateway_server import auth
from tests.waiting import wait_until

ATTACKER, VICTIM = "sk-attacker", "sk-victim"
LINES = 200


@pytest.fixture()
def loguru_lines() -> Iterator[list[str]]:
    lines: list[str] = []
    sink = logger.add(lambda message: lines.append(str(message)), level="INFO", format="{level} {message}")
    try:
        yield lines
    finally:
        logger.remove(sink)


def _victim_batch() -> bytes:
    """200 chat lines of one shape (the content's length class is the same on every line), 0.5 s each on the FAKE engine."""
    lines = [
        {"custom_id": f"v-{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": [{"role": "user", "content": f"v-{i:03d}"}], "max_tokens": 10}}
        for i in range(LINES)
    ]  # fmt: skip
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def test_an_attackers_crashes_beside_a_steady_batch_are_held_against_the_attacker_only(
    tiny_model_dir: Path, tmp_path: Path, loguru_lines: list[str]
) -> None:
    engine = {"model_path": str(tiny_model_dir), "device": "cpu", "python": str(fake_engine_python(tmp_path)), "env": {"FAKE_ENGINE_TOKEN_S": "0.05"}}
    settings = {
        "keys": [{"name": "attacker", "key": ATTACKER}, {"name": "victim", "key": VICTIM}], "state_dir": str(tmp_path / "state"),
        # the batch does not yield to the attacker's request (it would hold back the lines the crash must meet)
        "batches": {"max_concurrency": 8, "max_concurrency_beside_interactive": 8, "retry_backoff_s": 0.2, "poll_interval_s": 0.2},
        "watchdog": {"interval_s": 0.5, "backoff_initial_s": 0.2, "unhealthy_after": 2}, "health_timeout_s": 1,
    }  # fmt: skip
    crafted = [{"model": "m", "messages": [{"role": "user", "content": CRASH}], "max_tokens": n} for n in (2, 50)]  # two shapes
    with gateway(tmp_path, {"m": {"engine": engine}}, timeout_s=120, **settings) as rig:
        victim = openai.OpenAI(base_url=rig.server.url + "/v1", api_key=VICTIM, max_retries=0, timeout=60)
        file_id = victim.files.create(file=("input.jsonl", io.BytesIO(_victim_batch())), purpose="batch").id
        batch = victim.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")

        def completed() -> int:
            return victim.batches.retrieve(batch.id).request_counts.completed

        for body, progress in zip(crafted, (20, 80), strict=True):
            wait_until(lambda p=progress: completed() >= p, f"{progress} of the victim's lines", 120)  # its shape was answered
            old_pid = rig.models()["m"]["engine"]["pid"]
            wait_until(lambda: rig.models()["m"]["in_flight"] > 0, "a victim line upstream", 60, every_s=0.01)  # beside the crash
            crashed = httpx.post(rig.server.url + "/v1/chat/completions", json=body, headers=auth(ATTACKER), timeout=60)
            assert crashed.status_code in (502, 503), crashed.text
            wait_until(lambda o=old_pid: (m := rig.models()["m"])["state"] == "ready" and m["engine"]["pid"] != o, "the engine restarted", 60)
        ended = wait_until(lambda: (b := victim.batches.retrieve(batch.id)).status in ("completed", "failed", "cancelled", "expired") and b, "the batch", 180)
        assert ended.status == "completed" and ended.request_counts.completed == LINES and ended.request_counts.failed == 0, ended
        # each crash had the victim's lines in flight beside the attacker's request (2 distinct suspects, not 1)
        crashes = [line for line in loguru_lines if "the engine crashed" in line]
        assert len(crashes) == 2 and all("with 2 request(s) in flight; 1 request shape(s) are now refused" in line for line in crashes), crashes
        pid = rig.models()["m"]["engine"]["pid"]
        for body in crafted:  # the attacker is refused both shapes; the engine does not die again
            refused = httpx.post(rig.server.url + "/v1/chat/completions", json=body, headers=auth(ATTACKER), timeout=60)
            assert refused.status_code == 400 and refused.json()["error"]["code"] == "request_quarantined", refused.text
        served = httpx.post(rig.server.url + "/v1/chat/completions", headers=auth(VICTIM), timeout=60,
                            json={"model": "m", "messages": [{"role": "user", "content": "v-999"}], "max_tokens": 10})  # fmt: skip
        assert served.status_code == 200, served.text
        assert rig.models()["m"]["engine"]["pid"] == pid
        listing = rig.admin("GET", "/admin/quarantine").json()["refused"]
        assert len(listing) == 2 and all(entry["refused_for"] == ["attacker"] and not entry["everyone"] for entry in listing), listing
