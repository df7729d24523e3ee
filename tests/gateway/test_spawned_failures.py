"""A start that fails after every request waiting for it left (its client gave up while the group had no room) is logged in one line, not as asyncio's "Task exception was never retrieved" with a traceback.
In-process gateway of FAKE engines (tests/fake_engine.py), with the residency tests' rig."""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from loguru import logger

from tests.fake_engine import fake_engine_python
from tests.gateway.test_residency import _engine, gateway
from tests.gateway_server import auth
from tests.waiting import wait_until


@pytest.fixture()
def loguru_lines() -> Iterator[list[str]]:
    lines: list[str] = []
    sink = logger.add(lambda message: lines.append(str(message)), level="INFO", format="{level} {message}")
    try:
        yield lines
    finally:
        logger.remove(sink)


def test_a_start_nobody_waits_for_fails_without_an_unretrieved_task_exception(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, loguru_lines: list[str]
) -> None:
    python = fake_engine_python(tmp_path)
    slow = _engine(tiny_model_dir, python)
    slow["env"] = {**slow["env"], "FAKE_ENGINE_TOKEN_S": "0.3"}
    residency = {"on_demand": True, "group": "gpu0"}
    broken = tmp_path / "broken-model"  # b's FAKE engine fails a moment into its start (its config.json is no JSON)
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    models = {"a": {"engine": slow, "residency": residency}, "b": {"engine": _engine(broken, python), "residency": residency}}
    caplog.set_level(logging.ERROR, logger="asyncio")
    with gateway(tmp_path, models, residency_groups={"gpu0": {"max_resident": 1}}, model_limits={"b": {"queue_timeout_s": 0.5}}) as rig:
        assert rig.chat("a")
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(lambda: rig.sdk.chat.completions.create(model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=8))
            wait_until(lambda: rig.models()["a"]["in_flight"] == 1, "a's request upstream", every_s=0.02)
            with pytest.raises(httpx.ReadTimeout):  # b's start waits for room; its only request leaves (the client gives up)
                httpx.post(rig.server.url + "/v1/chat/completions", headers=auth(), timeout=0.5,
                           json={"model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})  # fmt: skip
            assert running.result(timeout=60).choices[0].finish_reason is not None
        wait_until(lambda: any("model b:" in line and "WARNING" in line for line in loguru_lines), lambda: loguru_lines[-20:], 30)  # b's start gave up
        gc.collect()  # where asyncio reports a failed task nobody retrieved
    assert "never retrieved" not in caplog.text, caplog.text
