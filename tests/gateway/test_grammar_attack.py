"""The grammar attack on the real default model: schemas whose compile would starve the engine never reach it.

SmolLM2's 49k-token vocabulary makes xgrammar's compile of a string bounded by ``maxLength`` (under 128) cost about
0.6 s per property: ten properties of ten different bounds, about 6 s, each schema new. An attacker key sends six
such schemas at once and drops each after 3 s, as a client that does not wait; before the compile budget the
engine went on compiling each after the client left, its health probes failed, and the watchdog restarted it under
another key's request. With the budget (``request_bounds.max_grammar_compile_s``, default 2 s) each is measured by
the gateway's probe and refused: the engine's pid is unchanged, it never stopped answering, the bystander key is
served, and the same schema sent again is refused at once (remembered).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.test_residency import ADMIN, gateway
from tests.gateway_server import auth

pytestmark = pytest.mark.real_model

ATTACKER, BYSTANDER = "sk-attacker", "sk-bystander"


def attack(salt: int) -> dict[str, Any]:
    properties = {f"p{i}": {"type": "string", "maxLength": 100 + 2 * salt + i} for i in range(10)}
    schema = {"type": "object", "properties": properties, "required": ["p0"]}
    return {"model": "smollm2", "messages": [{"role": "user", "content": "Fill it."}], "max_tokens": 32,
            "response_format": {"type": "json_schema", "json_schema": {"name": "form", "schema": schema}}}  # fmt: skip


def test_six_costly_schemas_are_refused_and_the_engine_serves_on(default_model_dir: Path, tmp_path: Path) -> None:
    engine = {"model_path": str(default_model_dir), "device": "cpu", "dtype": "float32", "max_total_tokens": 4096,
              "json_disable_any_whitespace": True, }  # fmt: skip
    settings = {"keys": [{"name": "attacker", "key": ATTACKER}, {"name": "bystander", "key": BYSTANDER}],
                "watchdog": {"interval_s": 1, "unhealthy_after": 3}, "health_timeout_s": 5}  # fmt: skip
    with gateway(tmp_path, {"smollm2": {"engine": engine}}, timeout_s=300, start_timeout_s=300, **settings) as rig:
        url = rig.server.url + "/v1/chat/completions"
        pid = rig.models()["smollm2"]["engine"]["pid"]

        def dropped(salt: int) -> None:
            try:
                httpx.post(url, json=attack(salt), headers=auth(ATTACKER), timeout=3)
            except httpx.TimeoutException:
                pass  # the attacker does not wait

        attackers = [threading.Thread(target=dropped, args=(salt,)) for salt in range(6)]
        for thread in attackers:
            thread.start()
        plain = {"model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16, "temperature": 0}
        served = httpx.post(url, json=plain, headers=auth(BYSTANDER), timeout=300)
        for thread in attackers:
            thread.join()
        assert served.status_code == 200, served.text
        for salt in range(6):  # every schema was measured and refused (each the attacker's own turn, one at a time)
            refused = httpx.post(url, json=attack(salt), headers=auth(ATTACKER), timeout=300)
            assert refused.status_code == 400 and refused.json()["error"]["code"] == "grammar_too_costly", refused.text
            assert "max_grammar_compile_s" in refused.json()["error"]["message"]
        model = rig.models()["smollm2"]
        assert model["state"] == "ready" and model["engine"]["pid"] == pid, model  # never restarted
        assert rig.metric("gateway_engine_restarts_total", model="smollm2") == 0, "the engine was restarted"
        again = httpx.post(url, json=plain, headers=auth(BYSTANDER), timeout=300)
        assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"], again.text
        quarantined = httpx.get(rig.server.url + "/admin/quarantine", headers=auth(ADMIN), timeout=10).json()
        assert quarantined["refused"] == [], quarantined  # no freeze, nobody blamed
