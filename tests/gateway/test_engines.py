"""The boot of a deployment (the lifespan's first step): a stop request while engines start stops them at once."""

from __future__ import annotations

import asyncio
import os

import pytest

from gateway.app import app_from_config
from gateway.control import StartAborted
from launch.config import DeploymentConfig
from tests.model_code.helpers import engine_children

pytestmark = pytest.mark.engine


def test_abort_during_boot_stops_engines(tiny_deployment: DeploymentConfig) -> None:
    app, _ = app_from_config(tiny_deployment)
    controller = app.state.controller
    before = set(engine_children())
    started: list[int] = []

    async def scenario() -> None:
        booting = asyncio.ensure_future(controller.boot())
        await asyncio.sleep(2.0)
        assert not booting.done()
        started.extend(set(engine_children()) - before)  # the engines being started
        controller.abort_start()  # what SIGTERM / Ctrl-C does before the server serves
        with pytest.raises(StartAborted):
            await asyncio.wait_for(booting, 30)
        await controller.close()

    asyncio.run(scenario())
    assert started, "no engine was starting"
    for pid in started:
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)
    assert controller.registry.routes() == ()  # nothing half-started was installed
