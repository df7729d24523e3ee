"""The status page's playground on the embedded default's real model (SmolLM2-135M-Instruct), in headless Chromium:
what a newcomer sees after `make serve`. Greedy, "What is the capital of France?" streams in as "The capital of
France is Paris.", with its stats and a `stop` finish; with the admin key the page shows the model's engine.

The docs' screenshots (docs/images/playground.png, status-page.png) are taken here: ``make screenshots`` runs this
test with ``SGLANG_GATEWAY_SCREENSHOTS=docs``; otherwise they go to ``tmp_path``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from launch.process import EngineProcess
from tests.browser import browser_missing, chromium_page, expect_text
from tests.gateway_server import serve

pytestmark = pytest.mark.real_model

KEY, ADMIN = "sk-playground", "sk-playground-admin"
QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."  # the README's quickstart answer, the same request


def test_the_playground_answers_on_the_default_model(smollm2_engine: EngineProcess, tmp_path: Path) -> None:
    missing = browser_missing()
    if missing:
        pytest.skip(missing)
    shots = Path(__file__).resolve().parents[2] / "docs" / "images" if os.environ.get("SGLANG_GATEWAY_SCREENSHOTS") == "docs" else tmp_path
    models = {"smollm2": {"engine": {"model_path": smollm2_engine.config.model_path, "device": "cpu"}, "aliases": ["default"]}}
    with serve(models, {"api_keys": [KEY], "admin_keys": [ADMIN]}, engines={"smollm2": smollm2_engine}) as server:
        with chromium_page(viewport={"width": 1200, "height": 900}) as page:
            page.goto(server.url + "/")
            expect_text(page.locator('#models-body tr[data-model="smollm2"] td.state'), "ready")
            page.fill("#client-key", KEY)
            page.click("#keys button[type=submit]")
            page.select_option("#pg-model", "default")
            page.fill("#pg-prompt", QUESTION)
            page.fill("#pg-temperature", "0")
            page.fill("#pg-max-tokens", "64")
            page.click("#pg-send")
            page.wait_for_selector("#pg-answer[data-done]", timeout=120_000)
            assert page.text_content("#pg-error") == ""
            assert page.text_content("#pg-answer").strip() == ANSWER
            stats = page.text_content("#pg-stats")
            assert re.search(r"TTFT \d+ ms · 8 tokens · [\d.]+ tokens/s · finish: stop", stats), stats
            page.screenshot(path=str(shots / "playground.png"), full_page=True)

            page.fill("#admin-key", ADMIN)
            page.click("#keys button[type=submit]")
            expect_text(page.locator('#engines-body tr[data-model="smollm2"] td:nth-child(4)'), str(smollm2_engine.pid))
            page.screenshot(path=str(shots / "status-page.png"), full_page=True)
            assert not page.problems, page.problems
