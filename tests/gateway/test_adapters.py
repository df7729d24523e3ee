"""LoRA adapters in the gateway's control plane, on FAKE engines (tests/fake_engine.py: it answers
``<model>:<adapter>`` only for the adapters of its ``--lora-paths``, and says which model a request named).

A reload that adds an adapter swaps the engine (its command line loads the adapters) with no failed request,
and routes the new name only once the new engine serves it; a reload that removes one makes its name the
gateway's 404 at once. The real engine serving adapters: tests/gateway/test_adapters_engine.py.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.gateway.helpers import KEY, auth
from tests.gateway.test_residency import Rig, _engine, fake_python, gateway  # noqa: F401 (fake_python: a fixture)


def _ask(rig: Rig, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return httpx.post(rig.server.url + "/v1/chat/completions", json=body, headers=auth(KEY), timeout=60)


def _reload(rig: Rig, adapters: dict[str, str]) -> dict[str, Any]:
    data = yaml.safe_load(rig.path.read_text())
    data["models"]["tiny"]["adapters"] = adapters
    rig.path.write_text(yaml.safe_dump(data, sort_keys=False))
    response = rig.admin("POST", "/admin/reload")
    assert response.status_code == 200, response.text
    return response.json()["models"]["tiny"]


def test_a_reload_adds_and_removes_adapters_and_routes_them_when_the_engine_serves_them(
    tiny_model_dir: Path, fake_python: Path, tmp_path: Path  # noqa: F811 (the fixture)
) -> None:
    models = {"tiny": {"engine": _engine(tiny_model_dir, fake_python), "adapters": {"a1": "/adapters/a1"}}}
    with gateway(tmp_path, models) as rig:
        assert _ask(rig, "tiny:a1").json()["fake_model"] == "tiny:a1"  # SGLang's spelling, on the served name
        assert _ask(rig, "tiny").json()["fake_model"] == "tiny"
        assert _ask(rig, "tiny:a2").status_code == 404  # not in the YAML: the gateway's answer, not the engine's
        pid = rig.models()["tiny"]["engine"]["pid"]

        with ThreadPoolExecutor(1) as pool:
            reloading = pool.submit(_reload, rig, {"a1": "/adapters/a1", "a2": "/adapters/a2"})
            rig.wait_state("tiny", "swapping")
            during = _ask(rig, "tiny:a2")  # the old engine lacks it: not routed yet (the engine would answer 400)
            item = reloading.result()
        assert during.status_code == 404, during.text
        assert item["action"] == "engine_changed" and item["ok"] and "engine.lora_paths" in item["changed"], item
        assert rig.models()["tiny"]["engine"]["pid"] != pid  # the new engine loads both
        assert [_ask(rig, name).json()["fake_model"] for name in ("tiny:a1", "tiny:a2")] == ["tiny:a1", "tiny:a2"]
        assert rig.cards()["tiny:a2"]["parent"] == "tiny"

        _reload(rig, {"a2": "/adapters/a2"})
        gone = _ask(rig, "tiny:a1")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found", gone.text
        assert "tiny:a1" not in rig.cards() and _ask(rig, "tiny:a2").status_code == 200
        # metrics name the adapter as the client did (its two requests answered above)
        assert rig.metric("gateway_requests_total", model="tiny:a2", route="/v1/chat/completions", status="200") == 2
