"""Work a client left behind is what the quarantine blames, not the bystander in flight when it froze the engine.

On a FAKE engine (the real one cannot be made to freeze on demand later than a request): an attacker key sends a
request with a grammar that the engine works on after the client gave up (FREEZE_LATER: no answer, then the engine's
event loop blocks a second later, as a grammar compile that goes on after its client left), and drops it. A bystander
key's plain chat, of a shape the engine had answered in full, is the only request in flight when the watchdog finds
the engine frozen. The attacker's aborted request stays a suspect for ``watchdog.suspect_linger_s``: it is the
evidence, refused for the attacker; the bystander's shape is served after the restart.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx

from tests.fake_engine import FREEZE_LATER, fake_engine_python
from tests.gateway.test_residency import ADMIN, gateway
from tests.gateway_server import auth
from tests.waiting import wait_until

ATTACKER, BYSTANDER = "sk-attacker", "sk-bystander"
PLAIN = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 40}


def _left_behind(content: str = FREEZE_LATER) -> dict[str, Any]:
    schema = {"type": "object", "properties": {"a": {"type": "string", "enum": ["x", "y"]}}}
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}  # fmt: skip


def test_the_attackers_work_left_behind_is_blamed_and_the_bystander_served(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = {"model_path": str(tiny_model_dir), "device": "cpu", "python": str(fake_engine_python(tmp_path)),
              "env": {"FAKE_ENGINE_TOKEN_S": "0.1", "FAKE_ENGINE_FREEZE_AFTER_S": "1"}}  # fmt: skip
    settings = {
        "keys": [{"name": "attacker", "key": ATTACKER}, {"name": "bystander", "key": BYSTANDER}], "state_dir": str(tmp_path / "state"),
        "watchdog": {"interval_s": 0.5, "backoff_initial_s": 0.2, "unhealthy_after": 2, "progress_timeout_s": 0.5}, "health_timeout_s": 0.5,
    }  # fmt: skip
    with gateway(tmp_path, {"m": {"engine": engine}}, timeout_s=120, **settings) as rig:
        url = rig.server.url + "/v1/chat/completions"
        assert httpx.post(url, json=PLAIN, headers=auth(BYSTANDER), timeout=60).status_code == 200  # its shape: answered
        # the attacker's grammar, measured by the gateway's compile budget once (a prompt of another length: another
        # shape), so that the request it leaves behind goes upstream at once
        assert httpx.post(url, json=_left_behind("x"), headers=auth(ATTACKER), timeout=120).status_code == 200
        old_pid = rig.models()["m"]["engine"]["pid"]
        in_flight: list[int] = []
        bystander = threading.Thread(target=lambda: in_flight.append(httpx.post(url, json=PLAIN, headers=auth(BYSTANDER), timeout=60).status_code))
        bystander.start()
        wait_until(lambda: rig.models()["m"]["in_flight"] == 1, "the bystander's request upstream", 30, every_s=0.01)
        try:  # the attacker gives up on its request before the engine does: the engine's work for it goes on
            httpx.post(url, json=_left_behind(), headers=auth(ATTACKER), timeout=0.5)
        except httpx.TimeoutException:
            pass
        wait_until(lambda: (m := rig.models()["m"])["state"] == "ready" and m["engine"]["pid"] != old_pid, "the frozen engine restarted", 90)
        bystander.join(60)
        served = httpx.post(url, json=PLAIN, headers=auth(BYSTANDER), timeout=60)
        assert served.status_code == 200, served.text  # the bystander's shape is not blamed
        refused = httpx.post(url, json=_left_behind(), headers=auth(ATTACKER), timeout=10)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "request_quarantined", refused.text
        entries = httpx.get(rig.server.url + "/admin/quarantine", headers=auth(ADMIN), timeout=10).json()
        assert [entry["refused_for"] for entry in entries["refused"]] == [["attacker"]], entries

